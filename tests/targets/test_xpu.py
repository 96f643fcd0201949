"""xpu target, run through the CPU emulator of the XPU kernel (the only XPU evidence here):
every prepacked linear vs the dense float32 reference on fresh random inputs.

Tolerances (relative error of the output): float32 1e-5; float16 (the xpu default) 5e-3 and
bfloat16 2e-2, from rounding the activations to 11 / 8 significant bits (measured ~5e-4 / ~3e-3).
The emulator accumulates in float32; the device may round more (oneDNN f16/bf16 fpmath).
"""

import itertools

import pytest
import torch
from conftest import prepacked_module

import quantprep
from quantprep.errors import ArtifactMismatch
from quantprep.gptq_format import pack_rows
from quantprep.source import QuantConfig
from quantprep.synthetic import random_gptq_tensors
from quantprep.targets import get_target
from quantprep.targets.xpu import pack_int4_nk
from quantprep.targets.xpu_emulator import weight_int4pack_mm_with_scales_and_zeros as emulated_mm

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
XPU = get_target("xpu")


def _module_for(raw, q, dtype):
    return prepacked_module("xpu", raw, q, dtype)


@pytest.mark.parametrize("bits,group_size,sym,act_order,v1", list(itertools.product([4, 8], [-1, 32, 64, 128], [True, False], [True, False], [True, False])))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prepacked_linear_matches_dense(bits, group_size, sym, act_order, v1, dtype):
    K, N = 576, 200  # partial last group at 128; N needs no alignment on xpu
    gen = torch.Generator().manual_seed(hash((bits, group_size, sym, act_order, v1)) % 2**31)
    raw = random_gptq_tensors(K, N, bits, group_size, sym, act_order, v1, bias=True, generator=gen)
    q = QuantConfig(bits, group_size, sym, act_order, "gptq" if v1 else "gptq_v2")
    layer, module, _ = _module_for(raw, q, dtype)
    x = torch.randn(4, 64, K)
    ref = x @ layer.dequantize() + layer.bias.float()
    with torch.no_grad():
        y = module(x.to(dtype)).float()
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < TOL[dtype], f"rel err {rel:.2e}"
    assert (y.argmax(-1) == ref.argmax(-1)).float().mean().item() >= (0.99 if dtype == torch.float32 else 0.9)


def test_weight_is_gptq_qweight_transposed():
    """The docs' claim: with K in act-order, the xpu weight is exactly GPTQ's qweight.T."""
    codes = torch.randint(0, 16, (256, 48), dtype=torch.uint8)
    assert torch.equal(pack_int4_nk(codes), pack_rows(codes, 4).T.contiguous())


def test_emulator_refuses_what_the_kernel_refuses():
    x = torch.randn(2, 128, dtype=torch.float16)
    w = torch.zeros(16, 16, dtype=torch.int32)
    s = torch.ones(2, 16, dtype=torch.float16)
    z = torch.zeros(2, 16, dtype=torch.int8)
    assert emulated_mm(x, w, 64, s, z).shape == (2, 16)
    for args, needle in [((x, w, 64, s, z.to(torch.uint8)), "int8"), ((x, w, 48, s, z), "multiple of 32"),
                         ((x[:, :64].contiguous(), w, 64, s, z), "K=64"), ((x, w, 64, s[:1], z), "qScale"),
                         ((x.T.contiguous().T, w, 64, s, z), "contiguous")]:
        with pytest.raises(RuntimeError, match=needle):
            emulated_mm(*args)


def test_a_wrong_zero_is_caught():
    gen = torch.Generator().manual_seed(3)
    q = QuantConfig(4, 32, False, True, "gptq_v2")
    layer, module, _ = _module_for(random_gptq_tensors(256, 64, 4, 32, False, True, False, generator=gen), q, torch.float32)
    module.qzeros[0] += 1
    x = torch.randn(4, 256)
    ref = x @ layer.dequantize()
    assert ((module(x) - ref).norm() / ref.norm()).item() > 1e-2


def test_whole_model_through_emulator_and_refused_without_xpu(tmp_path):
    from conftest import dense_reference_model, rel_err, top1

    from quantprep.build import build_artifacts
    from quantprep.synthetic import write_random_checkpoint
    from quantprep.verify import verify_artifact

    cfg = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    gptq = write_random_checkpoint(tmp_path / "gptq", cfg, bits=4, group_size=128, desc_act=True, sym=True)
    build_artifacts(gptq, {"path": str(gptq)}, ["xpu"], lambda t: tmp_path / "xpu", "float32", progress=False)
    with pytest.raises(ArtifactMismatch, match="no XPU device"):
        quantprep.load(tmp_path / "xpu")
    model = quantprep.load(tmp_path / "xpu", device="cpu")
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        got, ref = model(input_ids=ids).logits, dense_reference_model(gptq)(input_ids=ids).logits
    assert rel_err(got, ref) < 1e-5 and top1(got, ref) >= 0.99
    report = verify_artifact(tmp_path / "xpu")
    assert report["emulated"] and report["numeric"] == "passed" and all(r["ok"] for r in report["probes"])


def test_load_warns_when_torch_has_no_aot_kernels_for_the_card():
    from quantprep.targets.xpu import arch_warning

    a770, b580 = "Intel(R) Arc(TM) A770 Graphics", "Intel(R) Arc(TM) B580 Graphics"
    assert "no AOT build for the A770" in arch_warning(a770, ["bmg", "pvc"])
    assert arch_warning(a770, ["dg2-g10", "bmg"]) is None
    assert "no AOT build for the B580" in arch_warning(b580, ["dg2"])
    assert arch_warning("Intel(R) Data Center GPU Max 1100", []) is None  # not a card we know the arch names of
