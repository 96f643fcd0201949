"""Fusion of q/k/v and gate/up (issue 3): one prepacked matmul with one act-order gather vs
separate modules, on the Qwen2.5-1.5B shapes, per target kernel, side by side in one process.

    python benchmarks/fusion.py --target cpu [--out benchmarks/results/fusion-cpu.json]
    python benchmarks/fusion.py --target cpu --whole-model GPTQ_DIR   (fused vs unfused artifact of a real checkpoint)
    PYTHONPATH=. python3 benchmarks/fusion.py --target cuda   (on the GPU machine)
Medians of --reps timed calls (after warm-up); on CUDA each call is synchronized before and after.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from common import machine, median_time, save, timed

from quantprep.build.prepack import prepare_layer, prepare_layers
from quantprep.build.source import QuantConfig, _validate_layer
from quantprep.build.synthetic import random_gptq_tensors
from quantprep.targets import get_target

GROUPS = {"qkv": [("q_proj", 1536), ("k_proj", 256), ("v_proj", 256)],
          "gate_up": [("gate_proj", 8960), ("up_proj", 8960)]}
K = 1536


def layers_sharing_perm(parts, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, n in parts:
        raw = random_gptq_tensors(K, n, 4, 128, True, True, True, bias=False, generator=gen)
        if out:
            raw["g_idx"] = out[0].g_idx  # real checkpoints: q/k/v (gate/up) share g_idx; codes are random anyway
        out.append(_validate_layer(name, raw, QuantConfig(4, 128, True, True, "gptq")))
    return out


def module(target, layer, device, dtype):
    tensors, meta = target.pack(layer, dtype)
    m = target.make_module(meta, dtype)
    m.load_state_dict({k: v.to(device) for k, v in tensors.items()}, assign=True)
    return m.to(device)


def whole_model(gptq: Path, target_name: str, rounds: int = 3) -> dict:
    """Decode (32 tokens) and prefill (128 tokens) of the fused and the unfused artifact of one
    checkpoint, interleaved rounds in one process, medians."""
    import tempfile

    import quantprep
    from quantprep.build.pipeline import prepack

    res: dict = {"checkpoint": str(gptq)}
    with tempfile.TemporaryDirectory() as d:
        models = {}
        for fuse in (True, False):
            out = Path(d) / f"fuse-{fuse}"
            prepack(gptq, target_name, out, fuse=fuse)
            models["fused" if fuse else "unfused"] = quantprep.load(out)
        device = next(iter(models.values())).device
        ids = torch.randint(0, 1000, (1, 8), device=device)
        prompt = torch.randint(0, 1000, (1, 128), device=device)
        times = {n: {"decode_tok_s": [], "prefill128_ms": []} for n in models}
        with torch.inference_mode():
            for model in models.values():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False)
            for _ in range(rounds):
                for name, model in models.items():
                    decode = timed(lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                                          min_new_tokens=32, do_sample=False))
                    times[name]["decode_tok_s"].append(32 / decode)
                    times[name]["prefill128_ms"].append(timed(lambda: model(input_ids=prompt)) * 1e3)
    for name, t in times.items():
        res[name] = {k: round(statistics.median(v), 2) for k, v in t.items()} | {"runs": t}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--whole-model", type=Path, help="a GPTQ checkpoint dir: time fused vs unfused artifacts of it")
    args = ap.parse_args()
    if args.whole_model:
        res = whole_model(args.whole_model, args.target)
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"} if isinstance(v, dict) else v for k, v in res.items()}))
        save(res | machine(), args.out)
        return
    target = get_target(args.target)
    device, dtype = target.device, torch.bfloat16
    rows = []
    for group, parts in GROUPS.items():
        layers = layers_sharing_perm(parts, seed=len(rows))
        separate = [module(target, prepare_layer(x), device, dtype) for x in layers]
        fused = module(target, prepare_layers(group, layers), device, dtype)
        splits = [n for _, n in parts]
        for M in (1, 16, 128, 512):
            x = torch.randn(1, M, K, device=device, dtype=dtype)
            with torch.inference_mode():
                ref = torch.cat([m(x) for m in separate], -1)
                got = fused(x)
                assert torch.equal(ref, got) or ((ref - got).float().norm() / ref.float().norm()).item() < 1e-2
                t_sep = median_time(lambda: [m(x) for m in separate], args.reps, 3, device == "cuda") * 1e6
                t_fused = median_time(lambda: [o.contiguous() for o in fused(x).split(splits, -1)], args.reps, 3, device == "cuda") * 1e6
            rows.append({"group": group, "M": M, "separate_us": round(t_sep, 1), "fused_us": round(t_fused, 1),
                         "speedup": round(t_sep / t_fused, 2)})
            print(rows[-1], flush=True)
    result = machine() | {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                          "target": args.target, "rows": rows}
    save(result, args.out)


if __name__ == "__main__":
    main()
