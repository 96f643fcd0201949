"""What prefill bucketing (quantprep/serving.py) costs: prefill time of a prompt padded up to its
bucket against the same prompt unpadded, side by side in one process, interleaved, medians.

Bucket sets: lengths 10% apart (serving.PREFILL_BUCKETS, 27 lengths), every 16 or 32 tokens up to
512, powers of two, and the default warm shapes (1, 16, 128, 512). Prompt lengths spread over 8-512 tokens; the
median prompt is the median of those lengths.

    python benchmarks/bucketing.py [--artifact artifacts/smollm2-135m/cpu] [--out benchmarks/results/bucketing-cpu.json]
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

import quantprep
from quantprep.serving import PREFILL_BUCKETS, bucket_for, prefill

BUCKET_SETS = {"10% apart": PREFILL_BUCKETS, "every 16": list(range(16, 513, 16)), "every 32": list(range(32, 513, 32)),
               "powers of 2": [2 ** i for i in range(3, 10)], "default warm shapes": [1, 16, 128, 512]}
LENGTHS = [24, 72, 140, 200, 270, 390, 470]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path, default=Path("artifacts/smollm2-135m/cpu"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sets", help="comma-separated names of BUCKET_SETS to run (default: all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sets = {k: v for k, v in BUCKET_SETS.items() if not args.sets or k in args.sets.split(",")}
    model = quantprep.load(args.artifact)
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in LENGTHS}
    for ids in prompts.values():  # warm every shape once
        prefill(model, ids, [ids.shape[1]])
        for buckets in sets.values():
            prefill(model, ids, buckets)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for n, ids in prompts.items():
            for name, buckets in [("unpadded", [n]), *sets.items()]:
                t = time.perf_counter()
                prefill(model, ids, buckets)
                times.setdefault((name, n), []).append(time.perf_counter() - t)
    rows = []
    for n in LENGTHS:
        base = statistics.median(times["unpadded", n])
        for name, buckets in sets.items():
            t = statistics.median(times[name, n])
            rows.append({"length": n, "buckets": name, "padded_to": bucket_for(n, buckets), "unpadded_ms": base * 1e3,
                         "padded_ms": t * 1e3, "overhead": t / base - 1})
        print(n, {r["buckets"]: round(r["overhead"], 3) for r in rows if r["length"] == n}, flush=True)
    median_prompt = statistics.median(LENGTHS)
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": torch.get_num_threads(), "torch": torch.__version__,
           "artifact": str(args.artifact), "act_dtype": str(next(model.parameters()).dtype), "rounds": args.rounds,
           "median_prompt": median_prompt, "bucket_sets": sets, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
