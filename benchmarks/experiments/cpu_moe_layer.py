"""A MoE decode layer as one C call, before and after (2026-11-29).

Commits given on the command line, each checked out into a worktree; fresh processes of each load
moe_speed.py's cpu artifacts (Qwen3-30B-A3B's layer shapes, --layers 2 and 6, in --work) and time
the median of 33 decode steps after a 16-token prompt (cpu_moe_decode.py's DECODE child, mapped
shards); the commits interleaved, --rounds rounds. Per layer: the difference of 6 and 2 layers, / 4.
With --artifact, that one cpu artifact's decode step instead (a dense model's, for one).

    PYTHONPATH=.:benchmarks python benchmarks/experiments/cpu_moe_layer.py --work /tmp/moe/bench \
        --commits e4141a3 11d92ef --out benchmarks/experiments/results/cpu-moe-layer-before-after-avx512.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, child_env, machine, run_child, save
from cpu_moe_decode import DECODE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work")
    p.add_argument("--artifact", help="time this cpu artifact's decode step, not moe_speed.py's two depths")
    p.add_argument("--commits", nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    env = child_env(QUANTPREP_VERIFIED_DIR=f"{args.work or tempfile.mkdtemp()}/user/verified")
    runs: dict[str, list[dict]] = {c: [] for c in args.commits}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for c in args.commits:
            trees[c] = Path(tmp) / c
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(trees[c]), c], check=True, capture_output=True)
        try:
            for _ in range(args.rounds):
                for c in args.commits:
                    if args.artifact:
                        runs[c].append(run_child(DECODE, [args.artifact, "mapped"], env, cwd=trees[c])[1])
                        print(c, runs[c][-1], file=sys.stderr)
                        continue
                    ms = {n: run_child(DECODE, [f"{args.work}/layers-{n}/cpu", "mapped"], env, cwd=trees[c])[1]["decode_ms"] for n in (2, 6)}
                    runs[c].append({"decode_ms_2": ms[2], "decode_ms_6": ms[6], "per_layer_ms": round((ms[6] - ms[2]) / 4, 3)})
                    print(c, runs[c][-1], file=sys.stderr)
        finally:
            for c in args.commits:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees[c])], capture_output=True)
    save({**machine(), "benchmark": "cpu-moe-layer", "artifact": args.artifact, "commits": args.commits, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
