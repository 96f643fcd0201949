"""What full sha256 verification costs at load (decides `quantprep.load(verify=...)`'s default).

Fresh process per run, median of 3: `quantprep.load(path)` (sizes + manifest digest only) vs
`quantprep.load(path, verify=True)` (every file hashed), for the SmolLM2 artifact and the
Qwen2.5-1.5B-shaped one made by benchmarks/load.py. Files are in the OS page cache.

    python benchmarks/hash_cost.py
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = "import sys, time, quantprep; t = time.perf_counter(); quantprep.load(sys.argv[1], verify=sys.argv[2] == '1'); print(time.perf_counter() - t)"


def main() -> None:
    rows = {}
    for name, art in (("smollm2", REPO / "artifacts" / "smollm2-135m" / "cpu"),
                      ("qwen1.5b-shapes", REPO / "artifacts" / ".cache" / "bench" / "qwen2.5-1.5b-artifact")):
        if not (art / "manifest.json").is_file():
            print(f"skip {name}: {art} missing (make build / benchmarks/load.py make it)")
            continue
        size = sum(p.stat().st_size for p in art.iterdir()) / 2**20
        for verify in ("0", "1"):
            times = [float(subprocess.run([sys.executable, "-c", CHILD, str(art), verify], capture_output=True, text=True,
                                          check=True).stdout.strip().splitlines()[-1]) for _ in range(3)]
            rows[f"{name} verify={verify}"] = {"mib": size, "median_s": statistics.median(times), "runs": times}
            print(f"{name} ({size:.0f} MiB) verify={verify}: load {statistics.median(times):.2f} s {[round(t, 2) for t in times]}")
    (REPO / "benchmarks" / "results" / "hash-cost.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
