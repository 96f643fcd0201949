"""What every benchmark here shares: timing, fresh child processes, the machine, the results file.

Scripts run as `python benchmarks/NAME.py`, so this directory is on sys.path and they import
`from common import ...` (the frozen ones in benchmarks/experiments/ find it through
`PYTHONPATH=.:benchmarks`: that folder's README). Only the standard library at import time: torch is imported where a
function needs it, so a script's --help and its child processes stay fast.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
# Qwen2.5-1.5B's shapes: the model size most kernel and load measurements here use.
QWEN_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
             "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}


def timed(fn: Callable[[], Any], cuda: bool = False) -> float:
    """Seconds one call of fn takes (perf_counter). cuda: synchronize before and after, so the
    time is the GPU's work and not only its launch."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def median_time(fn: Callable[[], Any], reps: int = 7, warmup: int = 1, cuda: bool = False) -> float:
    """Median seconds of `reps` calls, after `warmup` untimed ones (first-call costs: allocation, compiling)."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, cuda) for _ in range(reps))


def per_call_us(fn, calls: int, reps: int) -> float:
    """Microseconds per call: the median of `reps` timings of `calls` calls each, after one untimed round."""
    return median_time(lambda: [fn() for _ in range(calls)], reps) / calls * 1e6


def median_and_runs(values: list[float]) -> dict:
    return {"median": statistics.median(values), "runs": values}


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child, offline and without tokenizers' thread pool warnings."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)


def run_child(code: str, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = REPO) -> tuple[float, Any]:
    """`python -c code args` in a fresh process (load times include the interpreter's start and
    every import). Returns time.time() at the spawn, for the child to subtract from its own
    clock, and the JSON value its last line of stdout holds. A failed child raises RuntimeError
    with the end of its stderr."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"child exited with {proc.returncode}: {proc.stderr[-3000:]}")
    return start, json.loads(proc.stdout.strip().splitlines()[-1])


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def cpu_name() -> str:
    """The CPU's model name as Linux reports it (platform.processor() is often just the architecture)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def host() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"


def machine() -> dict:
    """The fields a results file opens with: when, where (host, CPU model, cores, torch's CPU ISA:
    AVX2 machines have no fast bf16 GEMM, which changes most CPU figures) and which torch."""
    import torch

    return {"date": now(), "machine": host(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def save(result: dict, path: str | Path | None) -> str:
    """The result as indented JSON, written to path when one is given (benchmarks/tables.py reads it)."""
    text = json.dumps(result, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    return text


RTN_RECORD = "rtn.json"  # beside a checkpoint benchmarks/rtn_gptq.py rounded to nearest


def rtn_record(gptq_dir: Path | None) -> dict:
    """What rtn_gptq.py wrote beside a checkpoint it made ({} for any other): its GGUF and `codes`."""
    record = gptq_dir / RTN_RECORD if gptq_dir else None
    return json.loads(record.read_text()) if record and record.is_file() else {}


def artifact_codes(artifact: Path) -> dict:
    """Which codes an artifact's speed run ran: the checkpoint it was built from (found in the build
    cache by content, else None) and `codes`: rtn_gptq.py's rounding, or the checkpoint's own."""
    from quantprep.build.pipeline import cached_checkpoint

    return checkpoint_codes(cached_checkpoint(json.loads((Path(artifact) / "manifest.json").read_text())["source"]["sha256"]))


def checkpoint_codes(gptq: Path | None) -> dict:
    """artifact_codes for a checkpoint already found (no second search of the build cache)."""
    return {"gptq_checkpoint": gptq and gptq.name, "codes": rtn_record(gptq).get("codes", "the checkpoint's own (GPTQ)")}


def is_gptqmodel_backend(name: str) -> bool:
    """`name` is a gptqmodel.BACKEND member (AUTO: GPTQModel.load's own pick on this machine)."""
    from gptqmodel import BACKEND

    return name in BACKEND.__members__


def gptqmodel_kernels(model) -> list[str]:
    """The quantized-linear classes GPTQModel loaded a model with (its BACKEND picks them): the modules with a qweight."""
    return sorted({type(m).__name__ for m in model.modules() if hasattr(m, "qweight")})


def greedy_decode(model, ids, new: int, **generate_kwargs) -> tuple[float, list[int]]:
    """transformers' greedy `generate` of `new` tokens after `ids` [1, n] -> (tokens/s over the new - 1
    after the first, which the prompt's forward gives; the new tokens), timed by a streamer's
    timestamps as generate samples each token."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    s = Stamps()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, streamer=s,
                         **generate_kwargs)
    assert len(s.t) == new + 1, f"{len(s.t)} streamer calls for {new} tokens"
    return (new - 1) / (s.t[-1] - s.t[1]), out[0, ids.shape[1]:].tolist()
