"""The xpu int4 op's contract (issue 54, item 7): quantprep calls
`aten._weight_int4pack_mm_with_scales_and_zeros` by position; the installed torch's schema is read
at load and in `selftest`, and one the call does not fit is refused in one line at load, not in the
first forward. pytorch#194692 (open) makes qZeros `Tensor?`: the call, with int8 zero points, fits it.
No XPU here: the schemas are torch's own (the installed one, and strings through torch's parser)."""

import pytest
import torch

import quantprep
from quantprep.errors import ArtifactMismatch
from quantprep.targets import xpu
from quantprep.targets.xpu import xpu_op_note

OP = "aten::_weight_int4pack_mm_with_scales_and_zeros"
TORCH_2_8 = f"{OP}(Tensor self, Tensor mat2, int qGroupSize, Tensor qScale, Tensor qZeros) -> Tensor"
PR_194692 = f"{OP}(Tensor self, Tensor mat2, int qGroupSize, Tensor qScale, Tensor? qZeros=None) -> Tensor"
SCALES_LAST = f"{OP}(Tensor self, Tensor mat2, int qGroupSize, Tensor qZeros, Tensor qScale) -> Tensor"


def test_the_installed_torchs_schema_fits_the_call():
    schema = xpu.kernel_schema()  # torch 2.14.1: TORCH_2_8
    assert [a.name for a in schema.arguments] == [name for name, _ in xpu.KERNEL_CALL]
    assert xpu.kernel_schema_problem(schema) is None


def test_the_pr_194692_schema_with_optional_zeros_fits():
    schema = torch._C.parse_schema(PR_194692)
    assert xpu.kernel_schema_problem(schema) is None
    assert "optional here: qZeros" in xpu_op_note(schema)


@pytest.mark.parametrize("schema,why", [
    (SCALES_LAST, "qScale is argument 4, quantprep passes it as argument 3"),
    (f"{OP}(Tensor self, Tensor mat2, Tensor qScale, Tensor qZeros, int qGroupSize) -> Tensor", "qGroupSize is argument 4"),
    (f"{OP}(Tensor self, Tensor mat2, int qGroupSize, Tensor qScale) -> Tensor", "it takes 4 arguments, quantprep passes 5"),
    (f"{OP}(Tensor self, Tensor mat2, int qGroupSize, Tensor qScale, *, Tensor qZeros) -> Tensor", "keyword-only"),
    (f"{OP}(Tensor self, Tensor mat2, int[] qGroupSize, Tensor qScale, Tensor qZeros) -> Tensor",
     "argument 2 (qGroupSize) is List[int], quantprep passes qGroupSize as int"),
    (f"{OP}(Tensor self, Tensor mat2, int qGroupSize, Tensor qScale, Tensor qZeros, ScalarType dtype) -> Tensor",
     "it requires dtype, which quantprep does not pass"),
    (f"{OP}(Tensor self, Tensor mat2, int qGroupSize, Tensor qScale, Tensor qZeros) -> (Tensor, Tensor)", "does not return one Tensor"),
])
def test_a_schema_the_call_does_not_fit_is_named(schema, why):
    assert why in (xpu.kernel_schema_problem(torch._C.parse_schema(schema)) or "")


def test_selftest_reports_the_live_schema_and_whether_the_call_fits():
    schema = xpu.kernel_schema()
    assert xpu_op_note(schema).startswith(f"int4 op `{schema}`: quantprep's call fits it")
    assert xpu_op_note(torch._C.parse_schema(TORCH_2_8)) == f"int4 op `{TORCH_2_8}`: quantprep's call fits it"
    assert "does NOT fit it: qScale is argument 4" in xpu_op_note(torch._C.parse_schema(SCALES_LAST))


def test_load_refuses_an_xpu_artifact_in_one_line_when_the_call_does_not_fit(random_gptq, tmp_path, monkeypatch):
    from quantprep.build.pipeline import prepack

    art = tmp_path / "xpu"
    prepack(random_gptq, "xpu", art)
    with pytest.raises(ArtifactMismatch, match="no XPU device"):  # the real schema: only the missing card stops it
        quantprep.load(art)
    monkeypatch.setattr(xpu, "kernel_schema", lambda: torch._C.parse_schema(SCALES_LAST))  # quantprep's reader, not torch
    with pytest.raises(ArtifactMismatch) as e:
        quantprep.load(art)
    message = str(e.value)
    assert "\n" not in message and str(art) in message and f"{xpu.KERNEL} is `{SCALES_LAST}`" in message
    assert "qScale is argument 4" in message and "no XPU device" not in message
    assert quantprep.load(art, device="cpu") is not None  # the CPU emulator never calls the op
