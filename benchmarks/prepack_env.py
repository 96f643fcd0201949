"""Prepack with an environment variable set one way and the other, side by side in one run.

    python benchmarks/prepack_env.py --var THP_MEM_ALLOC_ENABLE --values 0,1 [--out benchmarks/results/thp-prepack-cpu-avx512.json]
    python benchmarks/prepack_env.py --var QUANTPREP_PACK --values torch,native [--out benchmarks/results/pack-prepack-cpu-avx512.json]
    python benchmarks/prepack_env.py --var OMP_NUM_THREADS --values 2,unset [--out benchmarks/results/threads-prepack-cpu-avx512.json]

THP_MEM_ALLOC_ENABLE: the quantprep CLI sets it to 1 unless the environment sets it (cli.main), so
prepack's large temporaries sit on transparent huge pages instead of faulting in 4 KiB at a time.
QUANTPREP_PACK=torch: the cpu target packs with tensor ops instead of its compiled packer
(targets/cpu.py; any other value: the compiled packer). OMP_NUM_THREADS: a build runs torch on one
thread unless it is set (build.one_torch_thread).

`quantprep prepack --target cpu` of benchmarks/scale.py's random Qwen2.5-shaped checkpoints,
fresh processes, the page cache dropped before each run where allowed (root), the two values
alternating in order from round to round; wall time and peak RSS (VmHWM) per run, medians per value.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.scale import WORK, drop_page_cache, run_timed, write_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--var", default="THP_MEM_ALLOC_ENABLE")
    p.add_argument("--values", default="0,1", help="two values, comma-separated (unset: not in the environment); the ratio is first / second")
    p.add_argument("--sizes", default="7b,14b,32b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    import torch

    values = args.values.split(",")
    assert len(values) == 2, "--values takes two values"
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "thp_mode": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
              "var": args.var, "values": values, "sizes": {}}
    WORK.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):
        src, art = WORK / f"qwen2.5-{size}-gptq", WORK / "env-art"
        kept = (src / "config.json").is_file()
        if not kept:
            write_checkpoint(size, src)
        src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        runs: dict[str, list[dict]] = {v: [] for v in values}
        for r in range(args.rounds):
            for value in values if r % 2 == 0 else values[::-1]:
                shutil.rmtree(art, ignore_errors=True)
                cold = drop_page_cache()
                if value == "unset":
                    os.environ.pop(args.var, None)
                else:
                    os.environ[args.var] = value
                row = run_timed([sys.executable, "-m", "quantprep", "prepack", str(src), "--target", "cpu", "--out", str(art), "--force"])
                runs[value].append(row | {"page_cache_dropped": cold})
                print(size, f"{args.var}={value}", row, flush=True)
        shutil.rmtree(art, ignore_errors=True)
        if not kept and size not in ("0.5b", "1.5b"):
            shutil.rmtree(src, ignore_errors=True)
        med = {v: statistics.median(x["s"] for x in rows) for v, rows in runs.items()}
        result["sizes"][size] = {"source_bytes": src_bytes, "runs": runs, "median_s": med, "ratio": med[values[0]] / med[values[1]]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
