"""MoE decode on the CPU: where a token's time per layer went, and what huge pages did (2026-11-29).

On the cpu artifacts moe_speed.py builds (Qwen3-30B-A3B's layer shapes, --layers 2 and 6, in --work):
  1. per projection shape, one row, every module of that shape in turn (the weights come from
     memory, as in decode): torch's _weight_int4pack_mm_for_cpu against csrc/gemv.c's int4_gemv_cpu,
     median us of 3 passes over all of them after one untimed pass;
  2. fresh processes, each runtime setting: load time, and the median decode step of 33 after a
     16-token prompt, at 2 and 6 layers (their difference: the time per layer), with the shards
     mapped (4 KiB pages) and read into huge pages (runtime/torch_model.read_on_huge_pages).

    PYTHONPATH=.:benchmarks python benchmarks/experiments/cpu_moe_decode.py --work /tmp/moe/bench \
        --out benchmarks/experiments/results/cpu-moe-decode-avx512.json
"""

from __future__ import annotations

import argparse
import json
import sys

from common import child_env, machine, run_child, save

KERNELS = """
import json, sys, time, torch
import quantprep
from quantprep.targets.cpu import CpuInt4Linear
model = quantprep.load(sys.argv[1])
shapes = {}
for name, m in model.named_modules():
    if type(m) is CpuInt4Linear:
        shapes.setdefault(f"{m.in_features}x{m.padded_out}", []).append(m)
out = {}
def each(mods, kernel):
    x = torch.randn(1, mods[0].padded_in).bfloat16()
    t = time.perf_counter()
    for m in mods:
        kernel(m, x)
    return (time.perf_counter() - t) / len(mods) * 1e6
torch_int4 = lambda m, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.qweight, m.kernel_group_size, m.scales_and_zeros)
gemv = lambda m, x: m.c_matmul(x, "int4")
with torch.no_grad():
    for shape, mods in shapes.items():
        row = {"modules": len(mods), "mb": round(mods[0].qweight.numel() / 1e6, 3)}
        for name, kernel in (("torch_int4", torch_int4), ("int4_gemv", gemv)):
            each(mods, kernel)
            runs = sorted(each(mods, kernel) for _ in range(3))
            row[name + "_us"] = round(runs[1], 1)
        out[shape] = row
print(json.dumps(out))
"""

DECODE = """
import json, os, sys, time
t0 = time.time()
import torch, quantprep
from pathlib import Path
from quantprep.runtime import torch_model
if sys.argv[2] == "mapped":
    torch_model.THP_MODE = Path("/nonexistent")  # read_on_huge_pages declines: safetensors maps the shards
t1 = time.time()
model = quantprep.load(sys.argv[1])
t2 = time.time()
ids = torch.tensor([list(range(1000, 1016))])
with torch.no_grad():
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    out = model(ids, use_cache=True)
    past, nxt, times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
    for _ in range(33):
        t = time.perf_counter()
        out = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t)
print(json.dumps({"load_s": round(t2 - t1, 3), "decode_ms": round(sorted(times)[16] * 1e3, 3)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="moe_speed.py's --work: layers-2/cpu and layers-6/cpu")
    p.add_argument("--out")
    args = p.parse_args()
    env = child_env(QUANTPREP_VERIFIED_DIR=f"{args.work}/user/verified")
    result = {**machine(), "benchmark": "cpu-moe-decode", "kernels_one_row_us": run_child(KERNELS, [f"{args.work}/layers-2/cpu"], env)[1]}
    decode = {}
    for pages in ("mapped", "huge"):
        for layers in (2, 6):
            decode[f"{pages}-{layers}"] = run_child(DECODE, [f"{args.work}/layers-{layers}/cpu", pages], env)[1]
            print(pages, layers, decode[f"{pages}-{layers}"], file=sys.stderr)
        decode[f"{pages}_per_layer_ms"] = round((decode[f"{pages}-6"]["decode_ms"] - decode[f"{pages}-2"]["decode_ms"]) / 4, 3)
    result["decode"] = decode
    print(json.dumps(result, indent=1))
    save(result, args.out)


if __name__ == "__main__":
    main()
