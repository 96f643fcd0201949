"""Whether another expert subgraph, precision or thread count makes OpenVINO's CPU plugin run a MoE
decode token faster, beside quantprep's C on the same token (2026-11-29).

A graph of 4 MoE blocks at Qwen3-30B-A3B's shapes (128 experts of 768 x 2048, top 8; random
symmetric int4 codes, f16 scales per group of 128: 1.2 GB, more than the host's L3), each block in
one of two forms OpenVINO turns into GatherMatmul nodes:
  three   what runtime/openvino_graph.py's `tiled_experts` writes: gate, up and down MatMuls
          (ConvertTiledMoeBlockTo3GatherMatmuls);
  fused   one gate_up MatMul, GPT-OSS's form (ConvertTiledMoeBlockTo2GatherMatmuls: a bias Add,
          Slice -> Clamp -> Add and Slice -> Minimum -> Swish; the constants are not an identity,
          OpenVINO would fold them away, so this form times, it does not compute the model).
Beside them, in the same process and interleaved step by step, the cpu target's C on the 8 experts
of a random layer of moe_speed.py's 6-layer cpu artifact (int4_gemv_rows, silu_mul, int4_gemv_rows,
as CpuQuantizedExperts.decode). Each step draws 8 random experts per block; ms per block, medians.

    PYTHONPATH=.:benchmarks python benchmarks/experiments/openvino_moe_forms.py --work /tmp/moe/bench \
        --out benchmarks/experiments/results/openvino-moe-forms-avx512.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import subprocess
import sys
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import torch
from common import machine, save
from openvino._pyopenvino import NodeFactory

import quantprep
from quantprep.runtime.cpu_layers import CpuQuantizedExperts, gemv_rows, library, silu_mul
from quantprep.targets.cpu import gemv_library

E, H, INTER, K, GROUP, BLOCKS = 128, 2048, 768, 8, 128, 4


def i64(values):
    return ops.constant(np.array(values, dtype=np.int64))


def weight(rng, rows: int, cols: int):
    codes = ov.Tensor(ov.Type.i4, [E, rows, cols // GROUP, GROUP])
    codes.data[:] = rng.integers(-128, 128, codes.data.shape, dtype=np.int8)
    scales = ops.constant(rng.uniform(0.01, 0.02, (E, rows, cols // GROUP, 1)).astype(np.float16))
    w = ops.multiply(ops.convert(ops.constant(codes), ov.Type.f16), scales)
    return ops.convert(ops.reshape(w, i64([E, rows, cols]), False), ov.Type.f32)


def block(rng, x, index, routing, fused: bool):
    T = ops.gather(ops.shape_of(x, "i64"), i64([0]), i64(0))
    dense = ops.scatter_elements_update(ops.broadcast(ops.constant(np.float32(0)), ops.concat([T, i64([E])], 0)), index, routing, i64(1))
    route = ops.reshape(ops.transpose(dense, i64([1, 0])), i64([E, -1, 1]), False)
    xe = ops.reshape(ops.tile(x, i64([E, 1])), i64([E, -1, H]), False)
    if fused:
        gu = ops.add(ops.matmul(xe, weight(rng, 2 * INTER, H), False, True), ops.constant(np.full((E, 1, 2 * INTER), 0.5, np.float32)))
        up = ops.add(ops.clamp(ops.slice(gu, i64([1]), i64([2 * INTER]), i64([2]), i64([2])), -1e30, 1e30), ops.constant(np.float32(1)))
        gate = ops.minimum(ops.slice(gu, i64([0]), i64([2 * INTER]), i64([2]), i64([2])), ops.constant(np.float32(1e30)))
        h = ops.multiply(up, ops.swish(gate, ops.constant(np.float32(1.0))))
        down = ops.add(ops.matmul(h, weight(rng, H, INTER), False, True), ops.constant(np.full((E, 1, H), 0.5, np.float32)))
    else:
        gate, up = ops.matmul(xe, weight(rng, INTER, H), False, True), ops.matmul(xe, weight(rng, INTER, H), False, True)
        silu = NodeFactory("opset4").create("Swish", [gate.output(0)], {})
        down = ops.matmul(ops.multiply(silu, up), weight(rng, H, INTER), False, True)
    down = ops.reshape(down, i64([E, -1, H]), False)
    return ops.reduce_sum(ops.multiply(down, route), i64([0]), False)


def model(fused: bool) -> ov.Model:
    rng = np.random.default_rng(0)
    x3 = ops.parameter([1, -1, H], np.float32, name="x")
    index = ops.parameter([BLOCKS, -1, K], np.int64, name="index")
    routing = ops.parameter([-1, K], np.float32, name="routing")
    h = x3
    for b in range(BLOCKS):  # GPT-OSS's pattern wants a Reshape before the Tile: each block's [1, T, H] -> [T, H]
        y = block(rng, ops.reshape(h, i64([-1, H]), False), ops.gather(index, i64(b), i64(0)), routing, fused)
        h = ops.add(h, ops.reshape(y, i64([1, -1, H]), False))
    return ov.Model([h], [x3, index, routing])


VARIANTS = {"three, bf16, 2 threads": (False, {}), "three, bf16, 1 thread": (False, {"INFERENCE_NUM_THREADS": 1}),
            "three, f32, 2 threads": (False, {"INFERENCE_PRECISION_HINT": "f32"}), "fused, bf16, 2 threads": (True, {}),
            "quantprep C (int4_gemv_rows)": None}


def openvino_steps(variant: str, steps: int) -> tuple[list[float], list[str]]:
    fused, config = VARIANTS[variant]
    request = ov.Core().compile_model(model(fused), "CPU", {"PERF_COUNT": "YES", **config}).create_infer_request()
    rng = np.random.default_rng(1)
    times = []
    for _ in range(steps):
        index = np.stack([np.sort(rng.choice(E, K, replace=False))[None] for _ in range(BLOCKS)])
        feed = {"x": rng.standard_normal((1, 1, H)).astype(np.float32) * 0.01, "index": index, "routing": np.full((1, K), 1 / K, np.float32)}
        t = time.perf_counter()
        request.infer(feed)
        times.append((time.perf_counter() - t) / BLOCKS)
    return times, sorted({f"{i.node_type} ({i.exec_type})" for i in request.profiling_info if "Matmul" in i.node_type or "MatMul" in i.node_type})


def c_steps(work: str, steps: int) -> tuple[list[float], list[str]]:
    cpu = quantprep.load(f"{work}/layers-6/cpu")
    layers = [m for m in cpu.modules() if isinstance(m, CpuQuantizedExperts)]
    args = [[m.expert_args(e) for e in range(m.num_experts)] for m in layers]
    x, rng = torch.randn(1, H).bfloat16(), random.Random(1)

    def one() -> float:
        i = rng.randrange(len(layers))
        ps = [args[i][e] for e in rng.sample(range(E), K)]
        gate_up = (ctypes.c_void_p * K)(*(ctypes.addressof(p[0]) for p in ps))
        down = (ctypes.c_void_p * K)(*(ctypes.addressof(p[1]) for p in ps))
        gu, y = x.new_empty(K, 2 * INTER), x.new_empty(K, H)
        t = time.perf_counter()
        gemv_rows(gemv_library(), gate_up, x, 0, K, gu, 2 * INTER)
        act = silu_mul(library(), gu)
        gemv_rows(gemv_library(), down, act, INTER, K, y, H)
        return time.perf_counter() - t

    with torch.no_grad():
        for _ in range(len(layers) * E // K * 2):  # every expert read: the artifact is mmapped, its pages on disk
            one()
        return [one() for _ in range(steps)], ["csrc/gemv.c"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one process's part
    p.add_argument("--out")
    a = p.parse_args()
    if a.variant:
        times, kernels = c_steps(a.work, a.steps) if VARIANTS[a.variant] is None else openvino_steps(a.variant, a.steps)
        print(json.dumps({"ms": statistics.median(times[10:]) * 1e3, "kernels": kernels}))
        return
    # One fresh process per variant and round, the variants interleaved: OpenVINO's and OpenMP's threads
    # in one process on 2 cores slowed each other (C measured 8 ms a layer beside 4 compiled models).
    rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(a.rounds):
        for name in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--work", a.work, "--steps", str(a.steps), "--variant", name],
                                 check=True, capture_output=True, text=True).stdout
            rounds[name].append(json.loads(out.strip().splitlines()[-1]))
            print(r, name, rounds[name][-1], flush=True)
    rows = {name: {"ms_per_block": round(statistics.median(x["ms"] for x in runs), 3), "rounds_ms": [round(x["ms"], 3) for x in runs],
                   "kernels": runs[0]["kernels"]} for name, runs in rounds.items()}
    c = rows["quantprep C (int4_gemv_rows)"]["ms_per_block"]
    for name, row in rows.items():
        row["vs_c"] = round(row["ms_per_block"] / c, 2)
        print(f"{name:30s} {row['ms_per_block']:7.3f} ms  {row['vs_c']:5.2f}x C  {row['kernels']}")
    save({**machine(), "benchmark": "openvino-moe-forms", "blocks": BLOCKS, "experts": E, "top_k": K, "group_size": GROUP,
          "steps": a.steps, "rounds": a.rounds, "openvino": ov.get_version(), "results": rows}, a.out)


if __name__ == "__main__":
    main()
