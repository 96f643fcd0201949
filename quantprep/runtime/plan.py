"""Kernel plans: which kernel path each quantized Linear runs at each row count M, timed once on
the serving machine.

A packed Linear may have several paths (targets/: the int4 kernel, or dequantizing its weight and
a dense matmul), and which one is faster depends on the CPU or GPU, its cores and M: on one 2-core
AVX512 CPU the int4 kernel beat the dense path at M = 512 on the 1.5B's gate/up layer, where the
fixed rule sent it to the dense one (benchmarks/experiments/results/cpu-prefill-avx512-epyc.json). `warm` times every path of
each distinct linear shape at the warmed prefill lengths (and M = 1, decode) and writes the winners
to `kcache/plan.json`; `load` applies them when the kcache is trusted and the plan's key is this
machine's. Otherwise, and above the longest length timed, every module keeps its fixed rule
(`default_path`): the plan knows nothing of longer prompts.

The search: a path's time is close to affine in M (a fixed cost, such as dequantizing the weight,
plus a cost per row), so one path winning at two lengths wins at every length between them, and
only an interval whose ends have different winners is bisected. About log2(lengths) timings per
shape instead of one per length.

plan.json: {"version": 1, "key": plan_key(device), "max_m": M, "shapes": {plan_shape: [[first_m, path], ...]},
"timings_ms": {plan_shape: {m: {path: ms}}}}; docs/artifact-format.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from quantprep._io.jsonfile import parse_json_object
from quantprep.errors import ArtifactError
from quantprep.runtime.kcache import PLAN, cache_key, key_mismatch
from quantprep.targets import device_target
from quantprep.targets.packed import PackedLinear

VERSION = 1
MAX_BYTES = 1 << 20  # a plan is a few kilobytes
MAX_SHAPES = 4096
MAX_RANGES = 64
REPS = 3  # timed calls per path and length, after an uncounted one
# On a CPU, a path whose first call takes LONG_CALL_S or more is timed by one more call, and one
# whose first call took CLEAR_LOSS times the fastest first call's time or more by none (it has
# lost): the 1.5B's lm_head at M = 512 (seconds a call on AVX2) made the plan the longest part of
# a warm. What a first call builds (a native library) prepare() builds.
LONG_CALL_S, CLEAR_LOSS = 0.25, 1.5
# Below a millisecond, three calls let one thread wake-up or cache miss pick the CPU's winner (two
# M = 1 paths of 0.13 and 0.28 ms timed 0.50 and 0.49); ten such calls cost nothing beside the rest.
SHORT_CALL_S, SHORT_REPS = 1e-3, 10


def plan_key(device_type: str) -> dict:
    """What the timings depend on: the kernel cache's key (versions, ISA or GPU), and what else the
    device says (a CPU: its model and the threads torch runs with)."""
    return cache_key(device_type) | device_target(device_type).plan_key_fields()


def planned_modules(model) -> dict[str, list[PackedLinear]]:
    """plan_shape -> the modules of that shape that have more than one path."""
    groups: dict[str, list[PackedLinear]] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear) and len(m.paths()) > 1:
            groups.setdefault(m.plan_shape(), []).append(m)
    return groups


def time_paths(module: PackedLinear, x: torch.Tensor, paths: tuple[str, ...]) -> dict[str, float]:
    """Milliseconds of the module's forward on x with each path forced (the act-order gather
    included where the path needs it): the fastest of REPS calls, the paths interleaved, so that
    another process's load (noise only ever adds time) biases none of them; on a CPU, SHORT_REPS
    calls where the first calls were short, and fewer where they were long (LONG_CALL_S). On a GPU each path's
    forward is captured once as a CUDA graph and its replays are timed: the GPU's own work. Timed
    from the host, a small layer's kernels (microseconds) hid behind Python's launches and the
    winner flipped from run to run (benchmarks/experiments/results/plan-prefill-cuda-h200-host-timed-plan.json)."""
    saved = {k: vars(module)[k] for k in ("plan", "plan_max_m") if k in vars(module)}

    def call(path: str) -> None:
        module.plan, module.plan_max_m = ((1, path),), x.shape[0]
        module(x)

    best, first = {}, {}
    try:
        for p in paths:  # counted for a clear loss only: first-call allocations, oneDNN primitives, Triton's compile
            t0 = time.perf_counter()
            call(p)
            first[p] = time.perf_counter() - t0
        cpu = x.device.type == "cpu"
        long = {p for p, t in first.items() if t >= LONG_CALL_S} if cpu else set()
        once = {p for p in long if first[p] >= CLEAR_LOSS * min(first.values())}
        best = {p: first[p] for p in once}
        replays = None
        if x.is_cuda:
            try:
                replays = {p: cuda_graph(lambda p=p: call(p)) for p in paths}
            except RuntimeError:  # a path that cannot be captured: every path timed from the host
                torch.cuda.synchronize()
        sync = device_target(x.device.type).synchronize  # kernels may run async
        for r in range(SHORT_REPS if cpu and min(first.values()) < SHORT_CALL_S else REPS):
            for p in paths:
                if p in once or (p in long and r > 0):
                    continue
                if replays:
                    t = gpu_seconds(replays[p])
                else:
                    sync()
                    t0 = time.perf_counter()
                    call(p)
                    sync()
                    t = time.perf_counter() - t0
                best[p] = min(best.get(p, float("inf")), t)
    finally:  # as it was: AOT export's signature reads the module's own attributes
        for k in ("plan", "plan_max_m"):
            vars(module).pop(k, None)
        vars(module).update(saved)
    return {p: round(t * 1e3, 4) for p, t in best.items()}


def cuda_graph(fn):
    """fn captured as a CUDA graph on a side stream (after a call there, as capture requires); its
    replay. The outer stream context restores the current stream even when the capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        fn()
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph.replay


def gpu_seconds(replay, calls: int = 5) -> float:
    """Seconds of GPU time per replay, over `calls` replays back to back between two events, queued
    behind a short sleep on the GPU so that the host's launches leave no gaps between them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1 << 20)  # about a millisecond: longer than queueing the replays takes
    start.record()
    for _ in range(calls):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def decide_shape(module: PackedLinear, lengths: list[int], measure=time_paths, int8_activations: bool = False) -> tuple[list[list], dict]:
    """[[first_m, path], ...] for one module over `lengths` (ascending), and the timings taken
    (measure(module, x, paths) -> {path: ms}). Paths that round the activations to int8
    (module.INT8_ACTIVATION_PATHS) only with int8_activations: they change the numbers beyond the
    activation dtype (SmolLM2-135M: logits 5.8% off the dense model's, top-1 87.5%, with the cpu
    int4_a8 path, against 2.2% and 94% with the int4 kernel; tests/test_smollm2.py), so a plan never picks one for its speed alone."""
    for p in module.paths():
        module.prepare(p)  # a path whose build fails its own check drops out of paths()
    paths = tuple(p for p in module.paths() if int8_activations or p not in module.INT8_ACTIVATION_PATHS)
    timings, winner = {}, {}
    device = module.qweight.device
    gen = torch.Generator(device=device).manual_seed(0)

    def win(i: int) -> str:
        if i not in winner:
            m = lengths[i]
            x = torch.randn(m, module.in_features, generator=gen, device=device).to(module.act_dtype)
            timings[m] = measure(module, x, paths)
            winner[i] = min(paths, key=timings[m].get)
        return winner[i]

    def bisect(i: int, j: int) -> None:
        if win(i) != win(j) and j - i > 1:
            k = (i + j) // 2
            bisect(i, k)
            bisect(k, j)

    with torch.inference_mode():
        bisect(0, len(lengths) - 1)
    ranges: list[list] = []
    for i in range(len(lengths)):  # an unmeasured length takes the winner of the measured one below it
        path = winner.get(i, ranges[-1][1] if ranges else None)
        if not ranges or ranges[-1][1] != path:
            ranges.append([lengths[i] if ranges else 1, path])
    return ranges, timings


def decide(model, lengths: list[int], int8_activations: bool = False) -> dict:
    """Time each distinct shape's paths at M = 1 and the prefill `lengths`; the plan."""
    ms = sorted({1, *lengths})
    t0 = time.perf_counter()
    shapes, timings = {}, {}
    for shape, modules in planned_modules(model).items():
        shapes[shape], timings[shape] = decide_shape(modules[0], ms, int8_activations=int8_activations)
    device = next(model.parameters()).device.type
    return {"version": VERSION, "key": plan_key(device), "max_m": ms[-1], "shapes": shapes, "timings_ms": timings,
            "s": round(time.perf_counter() - t0, 3)}


def write(plan: dict, out_dir: Path) -> None:
    (out_dir / PLAN).write_text(json.dumps(plan, indent=1))


def read(root: Path, entry: dict) -> dict:
    """`root/plan.json`, checked against the kcache entry's sha256 and size, bounded and validated.
    ArtifactError naming the problem."""
    listed = entry["files"].get(PLAN)
    where = root / PLAN
    fix = "re-run `quantprep warm` on this machine"
    if not isinstance(listed, dict) or not isinstance(listed.get("size"), int) or listed["size"] > MAX_BYTES:
        raise ArtifactError(f"{where}: not listed in manifest.json's kcache, or larger than {MAX_BYTES} bytes; {fix}")
    try:
        with open(where, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ArtifactError(f"{where}: cannot be read ({e.strerror or e}); {fix}") from None
    if len(raw) != listed["size"] or hashlib.sha256(raw).hexdigest() != listed.get("sha256"):
        raise ArtifactError(f"{where}: does not match its sha256 and size in manifest.json; {fix}")
    plan = parse_json_object(raw, str(where), ArtifactError, fix, MAX_BYTES)
    check(plan, where)
    return plan


def check(plan: dict, where: Path | str) -> None:
    """The plan's schema: a version this quantprep reads, a key, the largest M timed, and for each
    shape ascending ranges [[1, path], [first_m, path], ...] up to it, of ints and path names."""
    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"{where}: {what}; re-run `quantprep warm` on this machine")

    if plan.get("version") != VERSION:
        raise bad(f"plan version {plan.get('version')!r}, this quantprep reads {VERSION}")
    if not isinstance(plan.get("key"), dict) or not isinstance(plan.get("shapes"), dict) or len(plan["shapes"]) > MAX_SHAPES:
        raise bad(f"expected a key and at most {MAX_SHAPES} shapes")
    if type(plan.get("max_m")) is not int or plan["max_m"] < 1:
        raise bad(f"max_m {plan.get('max_m')!r} is not a positive integer")
    for shape, ranges in plan["shapes"].items():
        ok = isinstance(ranges, list) and 0 < len(ranges) <= MAX_RANGES and all(
            isinstance(r, list) and len(r) == 2 and type(r[0]) is int and isinstance(r[1], str) for r in ranges)
        firsts = [r[0] for r in ranges] if ok else []
        if not ok or firsts[0] != 1 or firsts != sorted(set(firsts)) or firsts[-1] > plan["max_m"]:
            raise bad(f"shape {shape!r}: ranges must be [[1, path], [first_m, path], ...] with first_m ascending")


def apply(model, plan: dict, device_type: str) -> int:
    """Set each planned module's ranges; returns how many modules got one. ArtifactError (and no
    module changed) when the key is another machine's or a path is not one the module has."""
    if mismatch := key_mismatch(plan["key"], plan_key(device_type)):
        raise ArtifactError(f"{mismatch}; re-run `quantprep warm` here")
    chosen = []
    for shape, modules in planned_modules(model).items():
        ranges = plan["shapes"].get(shape)
        if ranges is None:
            continue
        if unknown := {p for _, p in ranges} - set.intersection(*(set(m.paths()) for m in modules)):
            raise ArtifactError(f"kernel plan for {shape} names path {sorted(unknown)[0]!r}, which {shape.split(':')[0]} "
                                f"does not have here ({', '.join(modules[0].paths())})")
        chosen += [(m, tuple((first, path) for first, path in ranges)) for m in modules]
    for m, ranges in chosen:
        m.plan, m.plan_max_m = ranges, plan["max_m"]
        for _, path in ranges:
            m.prepare(path)
    return len(chosen)
