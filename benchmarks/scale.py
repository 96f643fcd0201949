"""Every model size on one machine (issue 18): prepack time and peak memory from 0.5B to 32B shapes.

For each Qwen2.5 shape, a GPTQ int4 g128 act-order checkpoint with random codes (written once with
flat memory, synthetic.write_random_checkpoint_sharded; kept under artifacts/.cache/bench/scale),
then, each in a fresh process where a process is timed:
  - copy: the source's bytes copied to a new file on the same disk and fsynced (the disk's own
    rate), before the prepack, after it and after verify: the median of the three
  - prepack: `quantprep prepack SRC --target cpu` (wall time; peak RSS: its own VmHWM)
  - verify: `quantprep verify ART` (every sha256 + the numeric probes; time and peak RSS)
  - load to first token: quantprep.load + 1 token, and the floor of benchmarks/load.py (python +
    torch + the artifact's bytes read + a dense forward), medians of --runs interleaved (warm page
    cache), and twice each after dropping the page cache (cold; root only)
A size whose source, copy and artifact do not fit the free disk is skipped and reported as such.
Goals: prepack time linear in bytes and <= 2x the copy; peak RSS flat; load <= 1.25x the floor.

    python benchmarks/scale.py [--sizes 0.5b,1.5b,7b,14b,32b] [--runs 3] [--keep]
        [--out benchmarks/results/scale-cpu-avx512.json] [--plot benchmarks/results/scale-cpu-avx512.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, child_env, machine, save

WORK = REPO / "artifacts" / ".cache" / "bench" / "scale"
COMMON = {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
SHAPES = {  # Qwen2.5 configs: hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "14b": (5120, 13824, 48, 40, 8, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
}


def config(size: str) -> dict:
    h, i, n, heads, kv, vocab, tied = SHAPES[size]
    return dict(COMMON, hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied)


def params(size: str) -> int:
    h, i, n, heads, kv, vocab, tied = SHAPES[size]
    kvd = kv * h // heads
    per_layer = h * (h + 2 * kvd) + h * h + 3 * h * i
    return n * per_layer + vocab * h * (1 if tied else 2)


def estimated_bytes(size: str) -> int:
    """int4 codes + fp16 scales per 128 + fp16 embeddings: the checkpoint's size, near enough to plan disk."""
    h, i, n, heads, kv, vocab, tied = SHAPES[size]
    linear = params(size) - vocab * h * (1 if tied else 2)
    return int(linear * (0.5 + 2 / 128 * 1.25)) + vocab * h * 2 * (1 if tied else 2)


def run_timed(argv: list[str]) -> dict:
    """Wall time and peak RSS of one fresh process. The peak is VmHWM of the process's own memory,
    polled every 20 ms until it exits: wait4's ru_maxrss would not do, Linux folds the RSS of the
    process that spawned it (this one, after writing a checkpoint: GBs) into the child's."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=child_env())
        peak_kib = 0
        while proc.poll() is None:
            peak_kib = max(peak_kib, vm_hwm_kib(proc.pid))
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(err.read().decode()[-3000:])
    return {"s": round(wall, 2), "peak_rss_gib": round(peak_kib / 2**20, 3)}


def vm_hwm_kib(pid: int) -> int:
    """A live process's peak resident memory so far (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def copy_time(src: Path, dest: Path) -> float:
    t0 = time.perf_counter()
    with open(dest, "wb") as out:
        for f in sorted(src.glob("*.safetensors")):
            with open(f, "rb") as inp:
                while chunk := inp.read(16 << 20):
                    out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    t = time.perf_counter() - t0
    dest.unlink()
    return t


# Load to first token and its floors, each a fresh process (benchmarks/load.py): quantprep.load + 1
# token; the floor (python, torch, the artifact's bytes read, a dense forward); the floor plus
# importing transformers' modeling code, which quantprep.load cannot skip while it returns a
# transformers model.
def load_children(art: Path) -> dict[str, tuple[str, list[str]]]:
    from load import CHILD_FLOOR, CHILD_QUANTPREP

    return {"floor": (CHILD_FLOOR, [str(art)]), "floor_with_transformers": (CHILD_FLOOR, [str(art), "transformers"]),
            "load_first_token": (CHILD_QUANTPREP, [str(art)])}


def load_runs(art: Path, runs: int) -> dict:
    """Warm: one pass of the floors and the load discarded, then `runs` rounds of them
    interleaved, so each sees the page cache the others see (run one after the other, the first
    load after verify and the copy read a 32B artifact from disk and the floors after it found it
    in memory). Cold: where the page cache can be dropped
    (root), the floor with transformers and the load twice each, alternating, each after
    dropping it: a first start after boot reads every byte from disk."""
    from load import fresh_process, medians

    children = load_children(art)
    for code, argv in children.values():
        fresh_process(code, argv)
    rows: dict[str, list[dict]] = {name: [] for name in children}
    for _ in range(runs):
        for name, (code, argv) in children.items():
            rows[name].append(fresh_process(code, argv))
    out = {name: medians(r) for name, r in rows.items()}
    out["load_over_floor"] = out["load_first_token"]["total_s"] / out["floor"]["total_s"]
    out["load_over_floor_with_transformers"] = out["load_first_token"]["total_s"] / out["floor_with_transformers"]["total_s"]
    if not drop_page_cache():
        out["cold"] = "not measured: dropping the page cache needs root (/proc/sys/vm/drop_caches)"
        return out
    cold: dict[str, list[dict]] = {"floor_with_transformers": [], "load_first_token": []}
    for _ in range(2):
        for name in cold:
            drop_page_cache()
            cold[name].append(fresh_process(*children[name]))
    out["cold"] = {name: medians(r) for name, r in cold.items()}
    out["cold"]["load_over_floor_with_transformers"] = out["cold"]["load_first_token"]["total_s"] / out["cold"]["floor_with_transformers"]["total_s"]
    return out


def drop_page_cache() -> bool:
    """Write back dirty pages, then drop clean ones from the page cache; False where not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def write_checkpoint(size: str, src: Path) -> None:
    """A random GPTQ checkpoint of this Qwen2.5 shape at `src`, written beside it and renamed into
    place: an interrupted write leaves no checkpoint that looks whole."""
    from quantprep.build.synthetic import write_random_checkpoint_sharded

    tmp = src.with_name(src.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_random_checkpoint_sharded(tmp, config(size))
    tmp.rename(src)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="0.5b,1.5b,7b,14b,32b")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep each size's checkpoint and artifact (default: removed after)")
    p.add_argument("--out")
    p.add_argument("--plot")
    p.add_argument("results", nargs="*", help="with --plot and no --sizes run: draw these result files")
    args = p.parse_args()
    if args.plot and args.results:
        return plot(json.loads(Path(args.results[0]).read_text()), args.plot)
    result = machine() | {"memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "sizes": {}, "skipped": {}}
    WORK.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):
        src, art = WORK / f"qwen2.5-{size}-gptq", WORK / f"qwen2.5-{size}-cpu"
        have = dir_bytes(src) if (src / "config.json").is_file() else 0
        need = 3 * estimated_bytes(size) - have  # the source (unless kept), the artifact and a copy of the source
        free = shutil.disk_usage(WORK).free + (dir_bytes(art) if art.exists() else 0)
        if free < need + (2 << 30):
            result["skipped"][size] = f"needs ~{need / 2**30:.1f} GiB of disk (the source, the artifact and a copy of the source), {free / 2**30:.1f} GiB free"
            print(f"{size}: skipped, {result['skipped'][size]}", flush=True)
            continue
        if not have:
            print(f"{size}: writing a random GPTQ checkpoint...", flush=True)
            write_checkpoint(size, src)
        src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        # the copy before the prepack, after it and after verify, and their median: this VM's disk
        # rate swings several-fold within minutes (writes land in the host's cache at times)
        copies = [copy_time(src, WORK / "copy.tmp")]
        row = {"params": params(size), "source_bytes": src_bytes}
        row["prepack"] = run_timed([sys.executable, "-m", "quantprep", "prepack", str(src), "--target", "cpu", "--out", str(art), "--force"])
        copies.append(copy_time(src, WORK / "copy.tmp"))
        row["artifact_bytes"] = dir_bytes(art)
        row["verify"] = run_timed([sys.executable, "-m", "quantprep", "verify", str(art)])
        copies.append(copy_time(src, WORK / "copy.tmp"))
        row["copy_runs_s"] = [round(c, 2) for c in copies]
        row["copy_s"] = round(statistics.median(copies), 2)
        row |= load_runs(art, args.runs)
        row["prepack_over_copy"] = row["prepack"]["s"] / row["copy_s"]
        row["write_mb_s"] = round(row["artifact_bytes"] / row["prepack"]["s"] / 1e6, 1)
        row["copy_mb_s"] = round(src_bytes / row["copy_s"] / 1e6, 1)
        result["sizes"][size] = row
        print(json.dumps({size: row}), flush=True)
        if not args.keep:
            shutil.rmtree(art, ignore_errors=True)
            if size not in ("0.5b", "1.5b"):
                shutil.rmtree(src, ignore_errors=True)
    print(save(result, args.out))
    if args.plot:
        plot(result, args.plot)


def plot(r: dict, out: str) -> None:
    """Log-log: prepack, copy, verify and load time (warm and cold), and peak RSS, against parameters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(r["sizes"])
    x = [r["sizes"][s]["params"] / 1e9 for s in sizes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    series = [("prepack", lambda v: v["prepack"]["s"], "-"), ("copy of the source", lambda v: v["copy_s"], "-"),
              ("verify", lambda v: v["verify"]["s"], "-"), ("load to first token", lambda v: v["load_first_token"]["total_s"], "-"),
              ("its floor (with transformers' imports)", lambda v: v["floor_with_transformers"]["total_s"], "-")]
    if all(isinstance(r["sizes"][s].get("cold"), dict) for s in sizes):
        series += [("load, cold page cache", lambda v: v["cold"]["load_first_token"]["total_s"], "--"),
                   ("its floor, cold", lambda v: v["cold"]["floor_with_transformers"]["total_s"], "--")]
    for label, key, style in series:
        a.plot(x, [key(r["sizes"][s]) for s in sizes], marker="o", linestyle=style, label=label)
    a.set(xscale="log", yscale="log", xlabel="parameters (billions)", ylabel="seconds", title="time")
    for label, key in (("prepack", "prepack"), ("verify", "verify")):
        b.plot(x, [r["sizes"][s][key]["peak_rss_gib"] for s in sizes], marker="o", label=f"{label} peak RSS")
    b.plot(x, [r["sizes"][s]["artifact_bytes"] / 2**30 for s in sizes], marker="x", linestyle="--", label="artifact size")
    b.set(xscale="log", yscale="log", xlabel="parameters (billions)", ylabel="GiB", title="memory")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax, ticks in ((a, [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500]), (b, [0.25, 0.5, 1, 2, 4, 8, 16, 32])):
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
        ax.set_xticks(x, [s for s in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        lo, hi = ax.get_ylim()
        ax.set_yticks([t for t in ticks if lo <= t <= hi])
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    skipped = f"; skipped: {', '.join(r['skipped'])}" if r["skipped"] else ""
    fig.suptitle(f"Qwen2.5 shapes, int4 g128, cpu target ({r['machine']}, {r['memory_gib']} GiB, {r['date'][:10]}{skipped})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
