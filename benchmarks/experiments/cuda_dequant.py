"""The cuda target's one-pass int4 dequantizer (targets/cuda.py, `dequantize_kn`) against variants
of it, per fused linear of the Qwen2.5-1.5B and 7B shapes (group 128, act-order): the dequantize
path's whole cost over dense bf16 is this pass (BENCHMARKS.md, "Kernel plans"), so how near it
runs to the GPU's memory bandwidth decides the prefill's ratio to dense.

Variants, all writing bf16 [K, N] rows where the activations have them (row perm[k]):
- `shipped`: the target's kernel as it is: each of a word's 8 nibbles stored as its own
  [BLOCK_K/8, BLOCK_N] slab, BLOCK_N 128, 4 warps
- `shipped_<BLOCK_N>_<warps>`: the same kernel, other tiles
- `reshape`: the kernel before (the codes reshaped to [BLOCK_K, BLOCK_N] in registers, then one store)
`floor_copy`, about the bytes moved: a copy of the int4 words' size plus a fill of the bf16 weight.
Every variant's output is compared with `shipped`'s (must be equal). `do_bench` medians.

    cd benchmarks && PYTHONPATH=.. python3 cuda_dequant.py --out results/cuda-dequant-h200.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from common import machine, save
from triton.testing import do_bench

from quantprep.targets.cuda import _dequant_kn, dequantize_kn

GS = 128
SHAPES = {"1.5b": {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)},
          "7b": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}}
TILES = [(256, 8), (512, 8)]


@triton.jit
def _dequant_reshape(w_ptr, sz_ptr, perm_ptr, out_ptr, N, K_IN, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0)
    q = tl.reshape((words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
    g = pid_k * BLOCK_K // GROUP
    s = tl.load(sz_ptr + (g * N + offs_n) * 2, mask=n_ok, other=0.0)
    z = tl.load(sz_ptr + (g * N + offs_n) * 2 + 1, mask=n_ok, other=0.0)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K_IN
    dest = tl.load(perm_ptr + k, mask=k_ok, other=0).to(tl.int64)
    tl.store(out_ptr + dest[:, None] * N + offs_n[None, :], (q.to(tl.bfloat16) - 8.0) * s[None, :] + z[None, :],
             mask=k_ok[:, None] & n_ok[None, :])


def launch(kernel, qkn, sz, perm, k_in, block_n, warps, **extra):
    Kp, N = qkn.shape[0] * 8, qkn.shape[1]
    out = torch.empty(k_in, N, dtype=torch.bfloat16, device=qkn.device)
    kernel[(Kp // GS, triton.cdiv(N, block_n))](qkn, sz, perm, out, N, k_in, GROUP=GS, BLOCK_K=GS, BLOCK_N=block_n,
                                                 num_warps=warps, **extra)
    return out


def random_weight(K: int, N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int4 words [K/8, N], (scale, folded zero) pairs [K/GS, N, 2] and an act-order perm, on the GPU."""
    qkn = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device="cuda")
    sz = (torch.rand(K // GS, N, 2, device="cuda") * 0.01).bfloat16()
    return qkn, sz, torch.randperm(K, device="cuda").to(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    res = machine() | {"device": torch.cuda.get_device_name(), "rows": []}
    for model, shapes in SHAPES.items():
        for name, (K, N) in shapes.items():
            qkn, sz, perm = random_weight(K, N)
            src, dst = torch.empty(K * N // 4, dtype=torch.bfloat16, device="cuda"), torch.empty(K * N, dtype=torch.bfloat16, device="cuda")
            moved = K * N // 2 + K * N * 2  # bytes: int4 words read, bf16 weight written
            ref = dequantize_kn(qkn, sz, GS, perm, K)
            variants = {"shipped": lambda: dequantize_kn(qkn, sz, GS, perm, K),
                        "floor_copy": lambda: (dst[: src.numel()].copy_(src), dst.fill_(0))}
            for bn, w in TILES:
                variants[f"shipped_{bn}_{w}"] = lambda bn=bn, w=w: launch(_dequant_kn, qkn, sz, perm, K, bn, w, HAS_PERM=True)
            variants["reshape"] = lambda: launch(_dequant_reshape, qkn, sz, perm, K, 128, 4)
            for v, fn in variants.items():
                equal = None if v == "floor_copy" else bool(torch.equal(fn(), ref))
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                res["rows"].append({"model": model, "linear": name, "K": K, "N": N, "variant": v, "ms": ms,
                                    "tb_per_s": moved / ms / 1e9, "equal_to_shipped": equal})
                print(model, name, v, f"{ms * 1e3:.1f} us", f"{moved / ms / 1e9:.2f} TB/s", equal, flush=True)
    print(save(res, args.out))


if __name__ == "__main__":
    main()
