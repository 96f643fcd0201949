"""Does the cuda dequantize path gain from column tiles, as the CPU's did? Per fused linear of the
Qwen2.5-1.5B and 7B shapes (group 128, act-order) at M rows: dense bf16 (`F.linear`), the shipped
path (the whole bf16 weight dequantized in one Triton pass, then one cuBLAS GEMM), and the same in
column tiles of T output columns: each tile's weight dequantized into one reused buffer (it may
stay in L2), then its GEMM written into the output's columns. Timed as CUDA graph replays
(`do_bench` medians), so launches cost what they cost inside a graph; outputs compared with the
shipped path's (relative error).

    cd benchmarks && PYTHONPATH=.. python3 cuda_dequant_tiles.py --out results/cuda-dequant-tiles-h200.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import machine, save
from cuda_dequant import GS, SHAPES, random_weight
from triton.testing import do_bench

from quantprep.runtime.plan import cuda_graph
from quantprep.targets.cuda import dequantize_kn

TILE_N = (1024, 2048, 4096, 8192)


@triton.jit
def _dequant_cols(w_ptr, sz_ptr, perm_ptr, out_ptr, N, ld, K_IN, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The shipped pass over N columns of words whose rows are `ld` apart; out [K_IN, N] contiguous."""
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + rows[:, None] * ld + offs_n[None, :], mask=n_ok[None, :], other=0)
    g = pid_k * BLOCK_K // GROUP
    s = tl.load(sz_ptr + (g * ld + offs_n) * 2, mask=n_ok, other=0.0)
    z = tl.load(sz_ptr + (g * ld + offs_n) * 2 + 1, mask=n_ok, other=0.0)
    for j in tl.static_range(8):
        q = (words >> (4 * j)) & 0xF
        k = rows * 8 + j
        k_ok = k < K_IN
        dest = tl.load(perm_ptr + k, mask=k_ok, other=0).to(tl.int64)
        tl.store(out_ptr + dest[:, None] * N + offs_n[None, :], (q.to(tl.bfloat16) - 8.0) * s[None, :] + z[None, :],
                 mask=k_ok[:, None] & n_ok[None, :])


def tiled(x, qkn, sz, perm, tile_n, buf, out):
    K, N = qkn.shape[0] * 8, qkn.shape[1]
    for n0 in range(0, N, tile_n):
        t = min(tile_n, N - n0)
        w = buf[: K * t].view(K, t)
        _dequant_cols[(K // GS, triton.cdiv(t, 128))](qkn[:, n0:], sz[:, n0:], perm, w, t, N, K, GROUP=GS, BLOCK_K=GS,
                                                      BLOCK_N=128, num_warps=4)
        torch.mm(x, w, out=out[:, n0:n0 + t])
    return out


def graph_ms(fn) -> float:
    return do_bench(cuda_graph(fn), warmup=25, rep=100, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="128,512,2048")
    p.add_argument("--out")
    args = p.parse_args()
    res = machine() | {"device": torch.cuda.get_device_name(), "rows": []}
    for model, shapes in SHAPES.items():
        for name, (K, N) in shapes.items():
            qkn, sz, perm = random_weight(K, N)
            w_dense = dequantize_kn(qkn, sz, GS, perm, K).T.contiguous()  # [N, K], as a dense model holds it
            buf = torch.empty(K * max(TILE_N), dtype=torch.bfloat16, device="cuda")
            for M in map(int, args.rows.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                ref = x @ dequantize_kn(qkn, sz, GS, perm, K)
                variants = {"dense": lambda: F.linear(x, w_dense), "shipped": lambda: x @ dequantize_kn(qkn, sz, GS, perm, K)}
                for t in TILE_N:
                    if t < N:
                        variants[f"tiles_{t}"] = lambda t=t: tiled(x, qkn, sz, perm, t, buf, out)
                ms = {}
                for v, fn in variants.items():
                    y = fn().float()
                    rel = ((y - ref.float()).norm() / ref.float().norm()).item()
                    ms[v] = graph_ms(fn)
                    res["rows"].append({"model": model, "linear": name, "K": K, "N": N, "M": M, "variant": v, "ms": ms[v], "rel_err": rel})
                print(model, name, M, {v: f"{t / ms['dense']:.2f}x" for v, t in ms.items()}, flush=True)
    print(save(res, args.out))


if __name__ == "__main__":
    main()
