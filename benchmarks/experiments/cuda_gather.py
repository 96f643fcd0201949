"""The act-order gather in front of an int4 GEMM on the GPU: torch's `index_select` (+ `F.pad` for
K padding), as `base.gather_and_pad` runs it, against the cuda target's one Triton pass
(`cuda.gather_pad`) at several tile shapes, and a pass written here with one program per row
(`rows_<warps>`). Every output is compared with torch's, bit for bit.
Timed as CUDA graph replays (`runtime.plan.gpu_seconds`), medians of 5; TB/s of x read + out written.

    PYTHONPATH=.:benchmarks python3 benchmarks/cuda_gather.py --out benchmarks/results/cuda-gather-h100.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from common import machine, save

from quantprep.runtime.plan import cuda_graph, gpu_seconds
from quantprep.targets import cuda
from quantprep.targets.packed import gather_and_pad

SHAPES = {"1.5b qkv/gate_up": 1536, "1.5b down": 8960, "7b qkv/o/gate_up": 3584, "7b down": 18944}
BLOCKS = [(1, 1024), (2, 1024), (4, 512), (8, 256)]


@triton.jit(do_not_specialize=["M"])
def _gather_rows(x_ptr, perm_ptr, out_ptr, M, K, KP, BLOCK_K: tl.constexpr):
    """One program per row, the whole row at once: its random reads meet in one SM's L1."""
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    src = tl.load(perm_ptr + offs_k, mask=k_ok, other=0).to(tl.int64)
    vals = tl.load(x_ptr + row * K + src, mask=k_ok, other=0.0)
    tl.store(out_ptr + row * KP + offs_k, vals, mask=offs_k < KP)


def gather_rows(x, perm, kp, warps):
    M, K = x.shape
    out = torch.empty(M, kp, dtype=x.dtype, device=x.device)
    _gather_rows[(M,)](x, perm, out, M, K, kp, BLOCK_K=triton.next_power_of_2(kp), num_warps=warps)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    res = machine() | {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name, K in SHAPES.items():
        perm = torch.randperm(K, generator=torch.Generator().manual_seed(K)).to(torch.int32).cuda()
        for M in (1, 16, 512, 2048):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = gather_and_pad(x, perm, K)
            row = {"shape": name, "K": K, "M": M, "us": {}, "equal": {}}
            variants = {"index_select": lambda: gather_and_pad(x, perm, K), "shipped": lambda: cuda.gather_pad(x, perm, K)}
            for bm, bk in BLOCKS:
                def run(bm=bm, bk=bk):
                    out = torch.empty_like(x)
                    cuda._gather_pad[(triton.cdiv(M, bm), triton.cdiv(K, bk))](x, perm, out, M, K, K, BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
                    return out
                variants[f"triton_{bm}_{bk}"] = run
            for w in (4, 8, 16, 32):
                variants[f"rows_{w}"] = lambda w=w: gather_rows(x, perm, K, w)
            for v, fn in variants.items():
                row["equal"][v] = bool(torch.equal(fn(), ref))
                replay = cuda_graph(fn)
                row["us"][v] = statistics.median(gpu_seconds(replay, calls=20) for _ in range(5)) * 1e6
            row["tb_s"] = {v: 2 * x.numel() * 2 / (us * 1e-6) / 1e12 for v, us in row["us"].items()}
            res["rows"].append(row)
            print(name, M, {v: round(us, 1) for v, us in row["us"].items()}, flush=True)
    print(save(res, args.out))


if __name__ == "__main__":
    main()
