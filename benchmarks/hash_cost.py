"""What hashing every file before an artifact's first load here costs (quantprep/format/verified.py).

An artifact not built on this machine is hashed in full at its first load; later loads of the
same, unchanged files find the user's mark and check sizes only. Fresh process per run, median of
3, files in the OS page cache, for a Qwen2.5-1.5B-shaped artifact with random codes (written here
once) and SmolLM2 when `make build` made it:

- `verify="sizes"` (`verify=False` when this ran): the explicit opt-out, sizes only (what every load did before);
- first load: an empty marks directory each run, so every file is hashed;
- marked: a later load, the mark found.

    python benchmarks/hash_cost.py [--out benchmarks/results/hash-cost-first-load-cpu-avx512.json]
"""

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from common import QWEN_1_5B, REPO, RESULTS, machine, run_child, save

CHILD = ("import sys, time, quantprep; t = time.perf_counter(); "
         "quantprep.load(sys.argv[1], verify='once' if sys.argv[2] == 'default' else 'sizes'); print(time.perf_counter() - t)")


def qwen_artifact(cache: Path) -> Path:
    from quantprep.build.pipeline import prepack
    from quantprep.build.synthetic import write_random_checkpoint

    art = cache / "qwen2.5-1.5b-shapes-artifact"
    if not (art / "manifest.json").is_file():
        gptq = cache / "qwen2.5-1.5b-shapes-gptq"
        if not (gptq / "quantize_config.json").is_file():
            write_random_checkpoint(gptq, QWEN_1_5B, bits=4, group_size=128, desc_act=True, sym=True)
        prepack(gptq, "cpu", art)
    return art


def load_s(art: Path, mode: str, marks: Path) -> float:
    return run_child(CHILD, [str(art), mode], dict(os.environ, QUANTPREP_VERIFIED_DIR=str(marks)))[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(RESULTS / "hash-cost-first-load-cpu-avx512.json"))
    args = p.parse_args()
    cache = REPO / "artifacts" / ".cache" / "bench"
    arts = {"qwen2.5-1.5b-shapes": qwen_artifact(cache)}
    if (REPO / "artifacts" / "smollm2-135m" / "cpu" / "manifest.json").is_file():
        arts["smollm2-135m"] = REPO / "artifacts" / "smollm2-135m" / "cpu"
    rows = []
    for name, art in arts.items():
        mib = sum(p.stat().st_size for p in art.iterdir() if p.is_file()) / 2**20
        times = {"sizes only (verify=False)": [], "first load (hashes every file)": [], "marked (later loads)": []}
        for _ in range(3):  # interleaved, so drift hits each mode alike
            marks = Path(tempfile.mkdtemp(prefix="quantprep-marks-"))
            times["sizes only (verify=False)"].append(load_s(art, "sizes", marks))
            times["first load (hashes every file)"].append(load_s(art, "default", marks))
            times["marked (later loads)"].append(load_s(art, "default", marks))
            shutil.rmtree(marks)
        row = {"artifact": name, "mib": round(mib, 1), "modes": {k: {"median_s": statistics.median(v), "runs": v} for k, v in times.items()}}
        rows.append(row)
        print(name, {k: round(v["median_s"], 2) for k, v in row["modes"].items()})
    # machine: the CPU's name; cores: torch's threads, which hash and load here
    info = machine()
    save(info | {"machine": info["cpu"], "cores": torch.get_num_threads(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
