"""cuda target on a GPU: the real kernels (tinygemm up to 16 rows, the Triton GEMM above, int8's
dequantize paths) against the dense float32 reference at every row
count around the switches; `pack_tinygemm` against the upstream `_convert_weight_to_int4pack`; and
selftest. Skipped without a CUDA device (CI has none); run on the GPU machine (the device tool).
Tolerance: bf16 activations, rel < 2e-2 (as verify's REL_TOL).
"""

import itertools

import pytest
import torch
from conftest import prepacked_module

from quantprep.build.source import QuantConfig
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets.cuda import pack_tinygemm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROWS = (1, 16, 17, 64, 512)  # tinygemm up to DECODE_MAX_M = 16, the Triton GEMM from 17


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
        with torch.no_grad():
            y = module(x.cuda().bfloat16()).float().cpu()
        rel = ((y - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, f"{rows} rows: rel err {rel:.2e}"


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
