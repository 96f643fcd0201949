"""Prepack with PyTorch's CPU allocator on transparent huge pages, and without (THP_MEM_ALLOC_ENABLE).

The quantprep CLI sets THP_MEM_ALLOC_ENABLE=1 unless the environment sets it (cli.main): prepack's
large temporaries (unpacked codes, packing slabs) are fresh allocations, each 4 KiB page of them a
page fault on first touch. This measures what that choice is worth: `quantprep prepack --target
cpu` of benchmarks/scale.py's random Qwen2.5-shaped checkpoints, fresh processes, the page cache
dropped before each run where allowed (root), with the variable 0 and 1 alternating in order
from round to round; wall time and peak RSS (VmHWM) per run, medians per setting.

    python benchmarks/thp.py [--sizes 7b,14b,32b] [--rounds 2] [--out benchmarks/results/thp-prepack-cpu-avx512.json]
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
    p.add_argument("--sizes", default="7b,14b,32b")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    import torch

    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "thp_mode": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(), "sizes": {}}
    WORK.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):
        src, art = WORK / f"qwen2.5-{size}-gptq", WORK / "thp-art"
        kept = (src / "config.json").is_file()
        if not kept:
            write_checkpoint(size, src)
        src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        runs: dict[str, list[dict]] = {"0": [], "1": []}
        for r in range(args.rounds):
            for setting in ("0", "1") if r % 2 == 0 else ("1", "0"):
                shutil.rmtree(art, ignore_errors=True)
                cold = drop_page_cache()
                os.environ["THP_MEM_ALLOC_ENABLE"] = setting
                row = run_timed([sys.executable, "-m", "quantprep", "prepack", str(src), "--target", "cpu", "--out", str(art), "--force"])
                runs[setting].append(row | {"page_cache_dropped": cold})
                print(size, setting, row, flush=True)
        shutil.rmtree(art, ignore_errors=True)
        if not kept and size not in ("0.5b", "1.5b"):
            shutil.rmtree(src, ignore_errors=True)
        med = {s: statistics.median(x["s"] for x in rows) for s, rows in runs.items()}
        result["sizes"][size] = {"source_bytes": src_bytes, "runs": runs, "median_s": med, "off_over_on": med["0"] / med["1"]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
