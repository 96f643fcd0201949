"""cpu at large M: each quantized kernel vs dequantize + dense bf16 matmul (the modules pick by M).

int4 (CpuInt4Linear) and per-channel int8 (Int8PerChannelLinear), per module on Qwen2.5-1.5B and
SmolLM2 shapes, both paths of the same module across M, medians of 7; then a whole-model prefill of
the SmolLM2 artifact (artifacts/smollm2-135m/cpu, `make build`) with the switch at its default and
with the kernel forced, interleaved rounds, one process. `benchmarks/tables.py` turns the JSON into
BENCHMARKS.md's tables.

    python benchmarks/cpu_prefill.py [--out benchmarks/results/cpu-prefill.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from common import REPO, machine, median_time, save, timed

from quantprep.build.prepack import prepare_layer
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets import get_target
from quantprep.targets.cpu import CpuInt4Linear
from quantprep.targets.packed import Int8PerChannelLinear, dense_matmul

SHAPES = {"qwen gate/up": (1536, 8960), "qwen down": (8960, 1536), "qwen q/o": (1536, 1536),
          "smollm2 gate/up": (576, 1536), "smollm2 down": (1536, 576)}
ARTIFACT = REPO / "artifacts" / "smollm2-135m" / "cpu"


def median_ms(fn) -> float:
    return median_time(fn) * 1e3


def per_module() -> list[dict]:
    cpu, rows = get_target("cpu"), []
    for name, (K, N) in SHAPES.items():
        raw = random_gptq_tensors(K, N, 4, 128 if K % 128 == 0 else 64, True, True, True)
        layer = prepare_layer(_validate_layer(name, raw, QuantConfig(4, 128 if K % 128 == 0 else 64, True, True, "gptq")))
        tensors, meta = cpu.pack(layer, torch.bfloat16)
        m = cpu.make_module(meta, torch.bfloat16)
        m.load_state_dict(tensors, assign=True)
        for M in (16, 32, 64, 128, 256, 384, 512):
            x = torch.randn(M, K).bfloat16()
            with torch.inference_mode():
                kernel = median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, m.kernel_group_size, m.scales_and_zeros))
                dequant = median_ms(lambda: dense_matmul(x, m.dequantize()))
            rows.append({"shape": name, "K": K, "N": N, "M": M, "kernel_ms": round(kernel, 2), "dequant_ms": round(dequant, 2),
                         "kernel_over_dequant": round(kernel / dequant, 2)})
            print(rows[-1], flush=True)
    return rows


def int8_per_module() -> list[dict]:
    """Per-channel symmetric int8 (group -1, sym): `_weight_int8pack_mm` vs dequantize + dense bf16."""
    cpu, rows = get_target("cpu"), []
    for name, (K, N) in SHAPES.items():
        raw = random_gptq_tensors(K, N, 8, -1, True, False, True)
        layer = prepare_layer(_validate_layer(name, raw, QuantConfig(8, -1, True, False, "gptq")))
        tensors, meta = cpu.pack(layer, torch.bfloat16)
        m = cpu.make_module(meta, torch.bfloat16)
        m.load_state_dict(tensors, assign=True)
        assert isinstance(m, Int8PerChannelLinear)
        for M in (1, 4, 8, 16, 24, 32, 48, 64, 128):
            x = torch.randn(M, K).bfloat16()
            with torch.inference_mode():
                kernel = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, m.qweight, m.scales))
                dequant = median_ms(lambda: dense_matmul(x, (m.qweight.to(torch.bfloat16) * m.scales[:, None]).T))
            rows.append({"shape": name, "K": K, "N": N, "M": M, "kernel_ms": round(kernel, 3), "dequant_ms": round(dequant, 3),
                         "kernel_over_dequant": round(kernel / dequant, 2)})
            print(rows[-1], flush=True)
    return rows


def whole_model(rounds=3) -> dict:
    import quantprep

    model = quantprep.load(ARTIFACT)
    ids = torch.randint(0, 1000, (1, 512))
    times, default = {"switch_at_512": [], "kernel_only": []}, CpuInt4Linear.DEQUANT_MIN_M
    with torch.inference_mode():
        model(ids)
        for _ in range(rounds):
            for name, threshold in (("switch_at_512", 512), ("kernel_only", 1 << 30)):
                CpuInt4Linear.DEQUANT_MIN_M = threshold
                times[name].append(timed(lambda: model(ids)) * 1e3)
    CpuInt4Linear.DEQUANT_MIN_M = default
    return {k: {"median_ms": round(statistics.median(v), 1), "runs": [round(x, 1) for x in v]} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = machine() | {"cores": torch.get_num_threads(),  # the kernels' threads (tables.py prints them)
                       "modules": per_module(), "int8_modules": int8_per_module(),
                       "smollm2_prefill512": whole_model() if ARTIFACT.is_dir() else None}
    print(json.dumps(res["smollm2_prefill512"]))  # None without `make build`
    save(res, args.out)


if __name__ == "__main__":
    main()
