"""Fusion of q/k/v and gate/up (issue 3): one prepacked matmul with one act-order gather vs
separate modules, on the Qwen2.5-1.5B shapes, per target kernel, side by side in one process.

    python benchmarks/fusion.py --target cpu [--out benchmarks/results/fusion-cpu.json]
    PYTHONPATH=. python3 benchmarks/fusion.py --target cuda   (on the GPU machine)
Medians of --reps timed calls (after warm-up); CUDA times are events around the same calls.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from quantprep.prepack import fuse_layers, unpack_layer
from quantprep.source import QuantConfig, _validate_layer
from quantprep.synthetic import random_gptq_tensors
from quantprep.targets import get_target

GROUPS = {"qkv": [("q_proj", 1536), ("k_proj", 256), ("v_proj", 256)],
          "gate_up": [("gate_proj", 8960), ("up_proj", 8960)]}
K = 1536


def layers_sharing_perm(parts, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, n in parts:
        raw = random_gptq_tensors(K, n, 4, 128, True, True, True, bias=False, generator=gen)
        out.append(unpack_layer(_validate_layer(name, raw, QuantConfig(4, 128, True, True, "gptq"))))
    for x in out[1:]:
        x.perm = out[0].perm  # real checkpoints: q/k/v (gate/up) share g_idx; codes are random anyway
    return out


def module(target, layer, device, dtype):
    tensors, meta = target.pack(layer, dtype)
    m = target.make_module(meta, dtype)
    m.load_state_dict({k: v.to(device) for k, v in tensors.items()}, assign=True)
    return m.to(device)


def timeit(fn, device, reps):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    target = get_target(args.target)
    device, dtype = target.device, torch.bfloat16
    rows = []
    for group, parts in GROUPS.items():
        layers = layers_sharing_perm(parts, seed=len(rows))
        separate = [module(target, x, device, dtype) for x in layers]
        fused = module(target, fuse_layers(group, layers), device, dtype)
        splits = [n for _, n in parts]
        for M in (1, 16, 128, 512):
            x = torch.randn(1, M, K, device=device, dtype=dtype)
            with torch.inference_mode():
                ref = torch.cat([m(x) for m in separate], -1)
                got = fused(x)
                assert torch.equal(ref, got) or ((ref - got).float().norm() / ref.float().norm()).item() < 1e-2
                t_sep = timeit(lambda: [m(x) for m in separate], device, args.reps)
                t_fused = timeit(lambda: [o.contiguous() for o in fused(x).split(splits, -1)], device, args.reps)
            rows.append({"group": group, "M": M, "separate_us": round(t_sep, 1), "fused_us": round(t_fused, 1),
                         "speedup": round(t_sep / t_fused, 2)})
            print(rows[-1], flush=True)
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
              "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "target": args.target, "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
