"""What hashing every file before an artifact's first load here costs (quantprep/verified.py).

An artifact not built on this machine is hashed in full at its first load; later loads of the
same, unchanged files find the user's mark and check sizes only. Fresh process per run, median of
3, files in the OS page cache, for a Qwen2.5-1.5B-shaped artifact with random codes (written here
once) and SmolLM2 when `make build` made it:

- `verify=False`: the explicit opt-out, sizes only (what every load did before);
- first load: an empty marks directory each run, so every file is hashed;
- marked: a later load, the mark found.

    python benchmarks/hash_cost.py [--out benchmarks/results/hash-cost-first-load-cpu-avx512.json]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
CHILD = ("import sys, time, quantprep; t = time.perf_counter(); "
         "quantprep.load(sys.argv[1], verify=None if sys.argv[2] == 'default' else False); print(time.perf_counter() - t)")


def qwen_artifact(cache: Path) -> Path:
    from load import QWEN_1_5B

    from quantprep.build import prepack
    from quantprep.synthetic import write_random_checkpoint

    art = cache / "qwen2.5-1.5b-shapes-artifact"
    if not (art / "manifest.json").is_file():
        gptq = cache / "qwen2.5-1.5b-shapes-gptq"
        if not (gptq / "quantize_config.json").is_file():
            write_random_checkpoint(gptq, QWEN_1_5B, bits=4, group_size=128, desc_act=True, sym=True)
        prepack(gptq, "cpu", art)
    return art


def load_s(art: Path, mode: str, marks: Path) -> float:
    env = {**__import__("os").environ, "QUANTPREP_VERIFIED_DIR": str(marks)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(art), mode], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "hash-cost-first-load-cpu-avx512.json"))
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
    from calibration import cpu_name

    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": cpu_name(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
