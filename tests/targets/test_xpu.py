"""xpu target, run through the CPU emulator of the XPU kernel (the only XPU evidence here):
the packed layout checked exactly through the emulator's float path (`dequantize_nk`), and every
prepacked linear vs the dense float32 reference on fresh random inputs.

Tolerances (relative error of the output): float16 (the xpu default) 5e-3 and bfloat16 2e-2, from
rounding the activations to 11 / 8 significant bits (measured ~5e-4 / ~3e-3). The emulator
accumulates in float32; the device may round more (oneDNN f16/bf16 fpmath). float32 activations
are refused, as oneDNN refuses them (docs/xpu.md).
"""

import itertools

import pytest
import torch
from conftest import prepacked_module

import quantprep
from quantprep.build.source import QuantConfig
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.errors import ArtifactMismatch
from quantprep.format.gptq import pack_rows
from quantprep.targets import get_target
from quantprep.targets.xpu import pack_int4_nk
from quantprep.targets.xpu_emulator import dequantize_nk
from quantprep.targets.xpu_emulator import weight_int4pack_mm_with_scales_and_zeros as emulated_mm

TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
VARIANTS = list(itertools.product([4, 8], [-1, 32, 64, 128], [True, False], [True, False], [True, False]))
XPU = get_target("xpu")


def _module_for(raw, q, dtype):
    return prepacked_module("xpu", raw, q, dtype)


@pytest.mark.parametrize("group_size,sym,act_order,v1", [v[1:] for v in VARIANTS if v[0] == 4])
def test_int4_layout_is_exact(group_size, sym, act_order, v1):
    """The weight the kernel reads (emulator's float path, float16 scales as in the source) equals
    the GPTQ dequantized weight bit for bit, in the kernel's K order, padding excluded."""
    K, N = 576, 200
    gen = torch.Generator().manual_seed(hash((group_size, sym, act_order, v1)) % 2**31)
    raw = random_gptq_tensors(K, N, 4, group_size, sym, act_order, v1, generator=gen)
    layer, module, meta = _module_for(raw, QuantConfig(4, group_size, sym, act_order, "gptq" if v1 else "gptq_v2"), torch.float16)
    w = dequantize_nk(module.qweight, meta["kernel_group_size"], module.scales, module.qzeros)[:, :K].T
    ref = layer.dequantize()
    assert torch.equal(w, ref if module.perm is None else ref[module.perm.long()])


@pytest.mark.parametrize("bits,group_size,sym,act_order,v1", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
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
    assert (y.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("block", [1 << 24, 1, 3000])  # codes packed per slab: whole, one column, a few
def test_weight_is_gptq_qweight_transposed(block):
    """The docs' claim: with K in act-order, the xpu weight is exactly GPTQ's qweight.T."""
    codes = torch.randint(0, 16, (256, 48), dtype=torch.uint8)
    assert torch.equal(pack_int4_nk(codes, block), pack_rows(codes, 4).T.contiguous())


def test_emulator_refuses_what_the_kernel_refuses():
    x = torch.randn(2, 128, dtype=torch.float16)
    w = torch.zeros(16, 16, dtype=torch.int32)
    s = torch.ones(2, 16, dtype=torch.float16)
    z = torch.zeros(2, 16, dtype=torch.int8)
    assert emulated_mm(x, w, 64, s, z).shape == (2, 16)
    for args, needle in [((x, w, 64, s, z.to(torch.uint8)), "int8"), ((x, w, 48, s, z), "multiple of 32"),
                         ((x[:, :64].contiguous(), w, 64, s, z), "K=64"), ((x, w, 64, s[:1], z), "qScale"),
                         ((x.T.contiguous().T, w, 64, s, z), "contiguous"),
                         ((x.float(), w, 64, s.float(), z), "no int4 matmul for torch.float32"),  # as oneDNN asserts
                         ((x, w, 64, s.bfloat16(), z), "qScale must be in A's dtype")]:
        with pytest.raises(RuntimeError, match=needle):
            emulated_mm(*args)


def test_a_wrong_zero_is_caught():
    gen = torch.Generator().manual_seed(3)
    q = QuantConfig(4, 32, False, True, "gptq_v2")
    layer, module, _ = _module_for(random_gptq_tensors(256, 64, 4, 32, False, True, False, generator=gen), q, torch.float16)
    x = torch.randn(4, 256)
    ref = x @ layer.dequantize()
    assert ((module(x.half()).float() - ref).norm() / ref.norm()).item() < TOL[torch.float16]
    module.qzeros[0] += 1
    assert ((module(x.half()).float() - ref).norm() / ref.norm()).item() > 1e-2


def test_whole_model_through_emulator_and_refused_without_xpu(tmp_path):
    from conftest import dense_reference_model, rel_err, top1

    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint
    from quantprep.tools.verify import verify_artifact

    cfg = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    gptq = write_random_checkpoint(tmp_path / "gptq", cfg, bits=4, group_size=128, desc_act=True, sym=True)
    prepack(gptq, "xpu", tmp_path / "xpu")  # float16
    with pytest.raises(ArtifactMismatch, match="no XPU device"):
        quantprep.load(tmp_path / "xpu")
    with pytest.raises(ArtifactMismatch, match="runs float16 or bfloat16 activations only, not float32"):
        quantprep.load(tmp_path / "xpu", device="cpu", dtype=torch.float32)
    model = quantprep.load(tmp_path / "xpu", device="cpu")
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        got, ref = model(input_ids=ids).logits, dense_reference_model(gptq)(input_ids=ids).logits
    print(f"float16 whole model vs float32 dense: rel err {rel_err(got, ref):.2e}, top-1 {top1(got, ref):.3f}")
    assert rel_err(got, ref) < 5e-3 and top1(got, ref) >= 0.95
    report = verify_artifact(tmp_path / "xpu")
    assert report["emulated"] and report["numeric"] == "passed" and all(r["ok"] for r in report["probes"])
