"""How far ahead, and into which cache, csrc/gemv.c prefetches a decode token's experts (2026-11-29).

On a cpu artifact moe_speed.py builds (Qwen3-30B-A3B's layer shapes, --layers 6, in --work): each
step takes the next layer and 8 random experts of it (their weights from memory: 6 layers of 128
experts are 1.9 GB), and runs what CpuQuantizedExperts.decode runs (int4_gemv_rows for the gate_up
projections, silu_mul, int4_gemv_rows for the down ones) with gemv.c built at each setting in turn,
the settings interleaved step by step in one process. Median ms per layer over 300 steps each.

    PYTHONPATH=.:benchmarks python benchmarks/experiments/cpu_moe_prefetch.py --work /tmp/moe/bench \
        --out benchmarks/experiments/results/cpu-moe-prefetch-avx512.json
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time

import torch
from common import machine, save

import quantprep
from quantprep.runtime.cpu_layers import CpuQuantizedExperts, library, silu_mul
from quantprep.targets import c_library

# (bytes ahead, __builtin_prefetch locality): 3 is L1 (prefetcht0), 2 L2 (prefetcht1)
SETTINGS = [(0, 3), (2048, 3), (4096, 3), (2048, 2), (4096, 2), (6144, 2), (8192, 2), (12288, 2), (6144, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out")
    a = ap.parse_args()
    model = quantprep.load(f"{a.work}/layers-6/cpu")
    libs = {s: c_library.library_with_torch_openmp("gemv", (f"-DGEMV_AHEAD={s[0]}", f"-DGEMV_LOCALITY={s[1]}")) for s in SETTINGS}
    layers = [m for m in model.modules() if isinstance(m, CpuQuantizedExperts)]
    args = [[m.expert_args(e) for e in range(m.num_experts)] for m in layers]
    H, inter, k = layers[0].hidden_dim, layers[0].intermediate_dim, 8
    x, rng = torch.randn(1, H).bfloat16(), random.Random(0)
    times: dict[tuple, list[float]] = {s: [] for s in SETTINGS}
    with torch.no_grad():
        for step in range(a.steps):
            for s in SETTINGS:
                i = (step * len(SETTINGS) + SETTINGS.index(s)) % len(layers)
                ps = [args[i][e] for e in rng.sample(range(layers[i].num_experts), k)]
                gate_up = (ctypes.c_void_p * k)(*(ctypes.addressof(p[0]) for p in ps))
                down = (ctypes.c_void_p * k)(*(ctypes.addressof(p[1]) for p in ps))
                gu, y = x.new_empty(k, 2 * inter), x.new_empty(k, H)
                t = time.perf_counter()
                libs[s].int4_gemv_rows(gate_up, x.data_ptr(), 0, k, gu.data_ptr(), 2 * inter, torch.get_num_threads())
                act = silu_mul(library(), gu)
                libs[s].int4_gemv_rows(down, act.data_ptr(), inter, k, y.data_ptr(), H, torch.get_num_threads())
                times[s].append(time.perf_counter() - t)
    rows = [{"ahead_bytes": s[0], "locality": s[1], "ms_per_layer": round(statistics.median(times[s][10:]) * 1e3, 3)}
            for s in SETTINGS]
    for r in rows:
        print(r)
    save({"machine": machine(), "experts_per_token": k, "steps": a.steps, "settings": rows}, a.out)


if __name__ == "__main__":
    main()
