"""Which modules of a loaded cpu artifact run quantprep's C kernels (issue 54, item 4): load sets
`model.quantprep_c` (cpu_layers.c_modules) and warns once when quantprep has C for the model but its
libraries did not build or load here (c_library.library returning None), not when QUANTPREP_NATIVE=0
asked for torch's ops. The libraries are made unavailable the way a machine makes them: a cache
directory others can write, which c_library.py refuses, in a fresh process (nothing compiled or cached
by this one)."""

import json
import os
import warnings

import pytest
from conftest import TINY_LLAMA, fresh_process, random_cpu_artifact

import quantprep
from quantprep.runtime import cpu_layers, plan
from quantprep.targets.cpu import CpuInt4Linear

# 1 layer, q/k/v and gate/up fused: 4 int4 linears (their dense path tiles in C from 384 rows), the
# C attention kernel, 2 RMSNorms + the final one, the gated MLP, the decoder layer (its projections'
# int4 path at one row: one decode_layer call), the float bfloat16 lm_head
ALL_C = {"quantized_linears": 4, "attention": 1, "norms": 3, "mlps": 1, "decoder_layers": 1, "float_linears": 1}
NO_C = dict.fromkeys(ALL_C, 0)

LOAD_CHILD = """
import json, sys, warnings
import quantprep
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = quantprep.load(sys.argv[1])
print(json.dumps({"c": model.quantprep_c, "warnings": [str(w.message) for w in caught if "C kernels" in str(w.message)]}))
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return random_cpu_artifact(tmp_path_factory.mktemp("c"), TINY_LLAMA, bits=4, group_size=64, desc_act=True, sym=False)


def c_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "C kernels" in str(w.message)]


def test_a_cpu_load_reports_the_modules_that_run_c(artifact):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = quantprep.load(artifact)
    assert model.quantprep_c == ALL_C
    assert c_warnings(caught) == []


def test_a_plan_at_one_row_decides_whether_each_decoder_layer_is_one_c_call(artifact):
    """int4_a8 or int4 at one row: decode_layer; the dequantize path at one row: the modules."""
    model = quantprep.load(artifact)
    if not all("int4_a8" in m.paths() for m in model.modules() if isinstance(m, CpuInt4Linear)):
        pytest.skip("no int4_a8 kernel on this CPU (neither AVX512-VNNI with VBMI nor AVX2)")
    for first, layers in (("int4_a8", 1), ("dequant", 0)):
        shapes = {shape: [[1, first], [8, "int4"]] for shape in plan.planned_modules(model)}
        plan.apply(model, {"version": 1, "key": plan.plan_key("cpu"), "max_m": 16, "shapes": shapes}, "cpu")
        assert cpu_layers.c_modules(model) == ALL_C | {"decoder_layers": layers}, first


def test_without_the_c_libraries_the_load_warns_once_naming_why(artifact, tmp_path):
    shared = tmp_path / "native"
    shared.mkdir()
    shared.chmod(0o777)  # another user could plant a library here: c_library.py compiles and loads nothing
    got, _ = fresh_process(LOAD_CHILD, artifact, env=dict(os.environ, QUANTPREP_NATIVE_DIR=str(shared)))
    assert got["c"] == NO_C
    [warning] = got["warnings"]
    assert warning.startswith(f"{artifact}: none of this model's modules run quantprep's C kernels")
    assert f"{shared}: not a private directory" in warning and "\n" not in warning


def test_c_turned_off_by_quantprep_native_0_is_reported_without_a_warning(artifact):
    got, _ = fresh_process(LOAD_CHILD, artifact, env=dict(os.environ, QUANTPREP_NATIVE="0"))
    assert got == {"c": NO_C, "warnings": []}, json.dumps(got)
