"""cuda target on a GPU: the real kernels (tinygemm up to 16 rows, the Triton GEMM above, int8's
dequantize paths) against the dense float32 reference at every row
count around the switches; `pack_tinygemm` against the upstream `_convert_weight_to_int4pack`; and
selftest. Skipped without a CUDA device (CI has none); run on the GPU machine (the device tool).
Tolerance: bf16 activations, rel < 2e-2 (as verify's REL_TOL).
"""

import itertools

import pytest
import torch
from conftest import prepacked_module, rel_err

from quantprep.build.source import QuantConfig
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets.cuda import pack_tinygemm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROWS = (1, 16, 17, 64, 512)  # tinygemm up to DECODE_MAX_M = 16, then the fixed rule's prefill path


def _module(bits, group_size, sym, act_order, K=576, N=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    raw = random_gptq_tensors(K, N, bits, group_size, sym, act_order, True, bias=True, generator=gen)
    layer, module, _ = prepacked_module("cuda", raw, QuantConfig(bits, group_size, sym, act_order, "gptq"), torch.bfloat16)
    return layer, module.cuda()


@pytest.mark.parametrize("bits,group_size,sym,act_order", list(itertools.product([4, 8], [-1, 32, 128], [True, False], [True, False])))
def test_cuda_kernels_match_dense_at_every_path(bits, group_size, sym, act_order):
    layer, module = _module(bits, group_size, sym, act_order)
    ref_w = layer.dequantize()
    for rows in ROWS:
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
        ref = x @ ref_w + layer.bias.float()
        for path in (None, *module.paths()):  # the fixed rule, then every path a kernel plan may pick
            module.plan, module.plan_max_m = ((), 0) if path is None else (((1, path),), 1 << 20)
            with torch.no_grad():
                y = module(x.cuda().bfloat16()).float().cpu()
            rel = ((y - ref).norm() / ref.norm()).item()
            assert rel < 2e-2, f"{rows} rows, path {path}: rel err {rel:.2e}"


@pytest.mark.parametrize("group_size,act_order", list(itertools.product([-1, 32], [True, False])))
def test_dequantize_path_writes_rows_in_the_activations_order(group_size, act_order):
    """K = 200 pads to 224 for the kernel: the Triton dequantizer drops the padded rows and writes
    packed row k at row perm[k], so x goes in ungathered and unpadded."""
    layer, module = _module(4, group_size, False, act_order, K=200, N=136)
    assert module.padded_in == 224 and module.input_order("dequant")
    w = module.dequantized_weight().float().cpu()  # [N, K]
    assert w.shape == (136, 200)
    ref = layer.dequantize().T
    rel = ((w - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("act_order", [True, False])
def test_fused_parts_are_one_gemm_each_on_the_dequantize_path(act_order):
    """A fused projection's parts (q/k/v, gate/up) at prefill: one GEMM per part on column slices of
    the weight, each part contiguous and equal to its columns of the reference, bias included."""
    layer, module = _module(4, 128, False, act_order)
    ref_w, sizes = layer.dequantize(), [136, 24, 40]
    for rows in (16, 17, 512):  # tinygemm (one GEMM, then copies), then the split
        x = torch.randn(1, rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
        ref = x @ ref_w + layer.bias.float()
        with torch.no_grad():
            parts = module.forward_split(x.cuda().bfloat16(), sizes)
        assert [tuple(p.shape) for p in parts] == [(1, rows, n) for n in sizes]
        for i, (part, r) in enumerate(zip(parts, ref.split(sizes, -1), strict=True)):
            assert part.is_contiguous()
            rel = rel_err(part.cpu(), r)
            assert rel < 2e-2, f"{rows} rows, part {i}: rel err {rel:.2e}"


def test_plan_timing_is_the_gpus_work():
    """At 512 rows of a 1536x1536 layer tinygemm takes about 6x the dequantize path's GPU time
    (benchmarks/experiments/results/cuda-prefill-h100.json); timed from the host, behind Python's launches, a plan once
    picked tinygemm there. time_paths times CUDA graph replays."""
    from quantprep.runtime.plan import time_paths

    _, module = _module(4, 128, True, True, K=1536, N=1536)
    x = torch.randn(512, 1536, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ms = time_paths(module, x, ("tinygemm", "dequant"))
    assert ms["dequant"] * 2 < ms["tinygemm"], ms
    assert not vars(module).get("plan"), "time_paths leaves the module's plan as it was"


def test_a_kernel_plan_is_timed_on_the_gpu_and_applied(tmp_path):
    import json

    from conftest import TINY_LLAMA

    import quantprep
    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint
    from quantprep.runtime.warm import warm
    from quantprep.targets.packed import PackedLinear

    gptq = write_random_checkpoint(tmp_path / "gptq", dict(TINY_LLAMA, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                           num_attention_heads=4, num_key_value_heads=2), group_size=64)
    prepack(gptq, "cuda", tmp_path / "art")
    report = warm(tmp_path / "art", shapes=[1, 16, 64, 256], progress=False)
    plan = json.loads((tmp_path / "art" / "kcache" / "plan.json").read_text())
    assert plan["shapes"] == report["plan"]["shapes"] and plan["key"]["name"] == torch.cuda.get_device_name()
    model = quantprep.load(tmp_path / "art")
    planned = [m for m in model.modules() if isinstance(m, PackedLinear) and m.plan]
    assert model.quantprep_kcache["plan"] == len(planned) > 0
    assert {p for m in planned for _, p in m.plan} <= {"tinygemm", "triton", "dequant"}
    ids = torch.arange(64, device="cuda").view(1, 64) % model.config.vocab_size
    with torch.inference_mode():
        planned_logits = model(ids).logits.float()
        for m in planned:
            m.plan, m.plan_max_m = (), 0
        fixed = model(ids).logits.float()
    assert ((planned_logits - fixed).norm() / fixed.norm()).item() < 2e-2


@pytest.mark.parametrize("ikt", [2, 4, 8])
def test_pack_tinygemm_equals_the_upstream_op(ikt):
    codes = torch.randint(0, 16, (1024, 256), dtype=torch.uint8)  # [K, N]
    upstream = torch.ops.aten._convert_weight_to_int4pack(((codes.T[:, 0::2] << 4) | codes.T[:, 1::2]).contiguous().cuda(), ikt)
    assert torch.equal(pack_tinygemm(codes, ikt).cuda(), upstream)


def test_triton_gemm_runs_past_int32_offsets():
    """M*N >= 2**31 elements in the output: the GEMM's offsets must be int64 (issue 13, item 13)."""
    from quantprep.targets import cuda

    if cuda.triton is None:
        pytest.skip("no Triton")
    free, _ = torch.cuda.mem_get_info()
    K, N, M = 64, 65536, 32784  # M*N = 2**31 + 2**20
    if free < 3 * M * N * 2 + (8 << 30):
        pytest.skip("not enough GPU memory for a 2**31-element output")
    layer, module = _module(4, 32, True, False, K=K, N=N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = module(x)
        tail = (x[-16:].float() @ layer.dequantize().cuda() + layer.bias.float().cuda())
    rel = ((y[-16:].float() - tail).norm() / tail.norm()).item()
    assert rel < 2e-2, rel


def test_selftest_cuda_passes(capsys):
    from quantprep.cli import main

    assert main(["selftest", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.count("PASS") == 24


@pytest.mark.parametrize("K,rows", [(200, 1), (200, 17), (3584, 512), (18944, 64), (40000, 8), (40000, 20)])  # tiles, rows, torch
def test_gather_pad_is_index_select_then_pad(K, rows):
    """The act-order gather and K padding in one Triton pass, against torch's ops: equal bit for bit."""
    from quantprep.targets.cuda import gather_pad
    from quantprep.targets.packed import gather_and_pad, round_up

    gen = torch.Generator().manual_seed(K + rows)
    x = torch.randn(rows, K, generator=gen).bfloat16().cuda()
    perm = torch.randperm(K, generator=gen).to(torch.int32).cuda()
    kp = round_up(K, 128)
    assert torch.equal(gather_pad(x, perm, kp), gather_and_pad(x, perm, kp))
    # strided views, as a batch's last positions reach a layer, and a broadcast row
    last = torch.randn(rows, 3, K, generator=gen).bfloat16().cuda()[:, -1]
    wide = x[:1].expand(rows, K)
    for v in (last, wide):
        assert torch.equal(gather_pad(v, perm, kp), gather_and_pad(v, perm, kp))


mslk_only = pytest.mark.skipif(not __import__("quantprep.targets.cuda", fromlist=["x"]).mslk_available(),
                               reason="needs the optional mslk-cuda package (CUTLASS mixed-input GEMMs)")


@mslk_only
@pytest.mark.parametrize("sym,act_order", list(itertools.product([True, False], [True, False])))
def test_mslk_path_matches_dense(sym, act_order):
    """mslk's layout built at prepare from qweight_kn: the whole output, and a fused module's parts
    (one mslk GEMM each, contiguous, bias included), against the dense float32 reference."""
    layer, module = _module(4, 128, sym, act_order, K=1024, N=384)
    assert "mslk" in module.paths() and module.mslk_weights is None
    ref_w = layer.dequantize()
    module.prepare("mslk")
    assert module.mslk_failed is None and len(module.mslk_weights) == 1
    module.plan, module.plan_max_m = ((1, "mslk"),), 1 << 20
    for rows in (1, 16, 64, 512):
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
        ref = x @ ref_w + layer.bias.float()
        with torch.no_grad():
            y = module(x.cuda().bfloat16())
        assert rel_err(y.cpu(), ref) < 2e-2, rows
    sizes = [256, 64, 64]
    _, fused = _module(4, 128, sym, act_order, K=1024, N=384)
    fused.parts = tuple(sizes)
    fused.plan, fused.plan_max_m = ((1, "mslk"),), 1 << 20
    fused.prepare("mslk")
    assert len(fused.mslk_weights) == 3
    x = torch.randn(1, 512, layer.in_features, generator=torch.Generator().manual_seed(1))
    ref = x @ ref_w + layer.bias.float()
    with torch.no_grad():
        parts = fused.forward_split(x.cuda().bfloat16(), sizes)
        whole = fused(x.cuda().bfloat16())
    for part, r in zip(parts, ref.split(sizes, -1), strict=True):
        assert part.is_contiguous() and rel_err(part.cpu(), r) < 2e-2
    assert rel_err(whole.cpu(), ref) < 2e-2


@mslk_only
def test_a_wrong_mslk_layout_is_caught_and_the_path_dropped(monkeypatch):
    """prepare checks mslk's output against the dequantize path: a layout without the XOR 8 (codes
    read unsigned) is refused with a warning, the path leaves paths(), and a plan naming it falls
    back to the fixed rule."""
    from quantprep.targets import cuda

    real = cuda.mslk_codes
    monkeypatch.setattr(cuda, "mslk_codes", lambda w: real(w) ^ torch.tensor(-120, dtype=torch.int8))  # undo the XOR 0x88
    _, module = _module(4, 128, False, True, K=1024, N=384)
    module.plan, module.plan_max_m = ((1, "mslk"),), 1 << 20
    with pytest.warns(UserWarning, match="mslk's output differs"):
        module.prepare("mslk")
    assert module.mslk_failed and "mslk" not in module.paths() and module.plan == ()
