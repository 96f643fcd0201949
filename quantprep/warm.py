"""Stage 4, warm: run the serving shapes once and ship every kernel cache inside the artifact.

`warm(dir)` runs the artifact in a fresh child process whose caches all point into an empty
scratch directory (Inductor/Triton, and on xpu the driver and SYCL caches), optionally compiles,
runs each recorded prefill length plus decode steps, saves torch.compile's mega-cache, and then
republishes the artifact with that directory as `kcache/` and a `kcache` manifest entry (cache
key, shapes, file hashes; docs/artifact-format.md). The swap is atomic and every other file is a
hard link, so a killed warm leaves the published artifact as it was.

At load, a kcache whose key matches this machine is copied once to a per-user directory (the
runtimes write into their caches; the artifact stays read-only and verifiable) and the runtime is
pointed at it. A foreign or corrupted kcache is ignored with a one-line warning: it only costs time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from .artifact import check_files, read_manifest, republish, sha256_file
from .errors import ArtifactError, QuantprepError

KCACHE = "kcache"
MEGACACHE = "torch-compile.bin"  # torch.compiler.save_cache_artifacts() output
DEFAULT_SHAPES = [1, 16, 128, 512]
DECODE_STEPS = 2
AOT_TIMEOUT_S = 1800  # per phase of warm that builds or checks compiled MLP packages
# Inductor's FX-graph and AOT entries come back from the mega-cache; locks are per process.
NOT_SHIPPED = {"inductor/fxgraph", "inductor/aotautograd", "inductor/locks"}


def cache_env(root: Path) -> dict[str, str]:
    """Environment that points every kernel cache of torch and the Intel runtime under `root`.
    NEO/SYCL are read when the device initialises, so they must be set before it starts."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        # Every Triton kernel, Inductor's and the eager ones (quantprep's cuda GEMM, JIT-compiled at
        # first call). Left to Inductor, the eager kernels that ran before its first compile went to
        # ~/.triton, outside the artifact.
        "TRITON_CACHE_DIR": str(root / "triton"),
        "NEO_CACHE_PERSISTENT": "1",
        "NEO_CACHE_DIR": str(root / "neo"),
        "SYCL_CACHE_PERSISTENT": "1",
        "SYCL_CACHE_DIR": str(root / "sycl"),
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(device_type: str) -> dict:
    """What a compiled kernel depends on: a cache built under another key is not used."""
    key = {"device": device_type, "torch": torch.__version__, "python": platform.python_version(),
           "triton": _version("triton") or _version("pytorch-triton-xpu")}
    if device_type == "cpu":
        key.update(cpu_capability=torch.backends.cpu.get_cpu_capability(), machine=platform.machine())
    elif device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        key.update(name=torch.cuda.get_device_name(), capability=f"sm_{major}{minor}", cuda=torch.version.cuda,
                   driver=_cuda_driver())
    elif device_type == "xpu":
        props = torch.xpu.get_device_properties()
        key.update(name=props.name, driver=getattr(props, "driver_version", None), arch_list=torch.xpu.get_arch_list())
    return key


def _cuda_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def igc_warning(env: dict[str, str]) -> str | None:
    igc = sorted(k for k in env if k.startswith("IGC_"))
    if igc:
        return f"{', '.join(igc)} set: any IGC_* variable disables the Intel driver's kernel cache; unset it to use kcache/neo"
    return None


# --- what runs the shapes (the warm child, and load(warmup=True)) ---------------------------------

def compile_regions(model) -> int:
    """torch.compile each decoder layer's MLP (regional compilation); returns how many.

    Not the whole layer: attention updates transformers' KV cache, whose per-layer state makes
    dynamo recompile for every layer (then, past its recompile limit, run eager silently). The MLPs
    are identical across layers, so one trace per shape class serves them all. Compiling the
    attention projections too was measured (SmolLM2, CPU): 3x the graphs, +1.3 s to the first
    token with a warm cache, and slower decode (21 vs 27 tok/s), so they stay eager."""
    from .aot import AotForward

    n = 0
    for mlp in decoder_mlps(model):
        if not isinstance(mlp.forward, AotForward):
            mlp.compile(dynamic=True)  # lazy: dynamo runs at the first call
            n += 1
    return n


def _decoder_layers(model) -> list:
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise QuantprepError(f"{type(model).__name__}: no decoder `layers` to compile; load with compile=False")
    return list(layers)


def decoder_mlps(model) -> list:
    """Each decoder layer's MLP: what compile_regions and the compiled MLP packages (aot.py) compile."""
    return [layer.mlp for layer in _decoder_layers(model) if getattr(layer, "mlp", None) is not None]


def usable_shapes(model, shapes: list[int]) -> list[int]:
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    return [s for s in shapes if s + DECODE_STEPS <= limit]


def run_shapes(model, shapes: list[int]) -> list[dict]:
    """Prefill each length with batch 1, then DECODE_STEPS decode steps (M=1). Token ids are
    random: only the shapes matter for kernels."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    timings = []
    for length in shapes:
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen).to(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS,
                           min_new_tokens=DECODE_STEPS, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings.append({"prefill": length, "decode_steps": DECODE_STEPS, "s": round(time.perf_counter() - t0, 3)})
    return timings


def _child_main() -> None:
    """Runs in the fresh process that `warm` starts, with cache_env() already in its environment."""
    args = json.loads(sys.argv[1])
    from .load import load

    t0 = time.perf_counter()
    model = load(args["path"], device=args["device"], kcache=False)
    if args["phase"] == "aot":
        # A process of its own: export leaves global state behind that changes torch.compile's
        # cache keys (the mega-cache then missed at load). Same Inductor dir as the compile phase:
        # its CPU ISA probes (compiled once per dir, 12 s on 2 cores) are needed at load too.
        # AOTInductor's build directories (a wrapper.cpp in each) are not shipped: the packages
        # hold what they built.
        from .aot import build_packages

        entries = build_packages(model, Path(args["scratch"]), next(model.parameters()).dtype, args["format"])
        for d in (Path(args["scratch"]) / "inductor").iterdir():
            if d.is_dir() and any(d.glob("*.wrapper.cpp")):
                shutil.rmtree(d)
        print(json.dumps({"aot": entries, "s": round(time.perf_counter() - t0, 3)}))
        return
    if args["phase"] == "aot_check":  # yet another process: what load will do, before shipping
        from .aot import check_packages

        bad = check_packages(model, Path(args["scratch"]), args["entries"], next(model.parameters()).dtype)
        print(json.dumps({"bad": bad}))
        return
    regions = compile_regions(model) if args["compile"] else 0
    shapes = usable_shapes(model, args["shapes"])
    timings = run_shapes(model, shapes)
    report = {"shapes": shapes, "timings": timings, "compiled_regions": regions, "s": round(time.perf_counter() - t0, 3)}
    if args["compile"]:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise QuantprepError("torch.compile produced no cache artifacts to save")
        blob, info = saved
        (Path(args["scratch"]) / MEGACACHE).write_bytes(blob)
        report["megacache"] = {kind: len(items) for kind, items in info.artifacts.items()}
    print(json.dumps(report))


# --- warm: build kcache/ and republish the artifact ----------------------------------------------

def _collect(scratch: Path) -> dict[str, dict]:
    files = {}
    for p in sorted(scratch.rglob("*")):
        rel = p.relative_to(scratch).as_posix()
        if any(rel == d or rel.startswith(d + "/") for d in NOT_SHIPPED):
            continue
        if p.is_file() and not p.is_symlink() and not p.name.endswith(".lock"):
            files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return files


def warm(path: str | os.PathLike, device: str | None = None, shapes: list[int] | None = None,
         compile: bool | None = None, aot: bool | None = None, progress: bool = True) -> dict:
    """Run the serving shapes in a fresh process and publish the artifact again with kcache/.
    With compile, also build compiled packages of the MLPs (aot.py: AOTInductor, else Inductor artifacts) unless `aot` is False.
    Defaults come from the manifest's `serving` entry (written from the recipe at build)."""
    path = Path(path).absolute()
    manifest = read_manifest(path)
    check_files(path, manifest, full_hash=False)
    serving = manifest.get("serving", {})
    device = device or manifest["target"]["device"]
    shapes = list(shapes or serving.get("shapes", DEFAULT_SHAPES))
    compile = serving.get("compile", False) if compile is None else compile
    aot = serving.get("aot", True) if aot is None else aot
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shapes):
        raise QuantprepError(f"--shapes must be positive prefill lengths, got {shapes}")
    if device == "xpu" and (msg := igc_warning(dict(os.environ))):
        print(f"quantprep: warning: {msg}", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="quantprep-warm-") as tmp:
        scratch = Path(tmp)
        env = dict(os.environ, **cache_env(scratch))
        if progress:
            print(f"warm {path} on {device}: prefill {shapes} + {DECODE_STEPS} decode steps"
                  f"{', torch.compile' if compile else ''}{' + compiled MLP packages' if compile and aot else ''} (fresh processes)",
                  file=sys.stderr, flush=True)
        aot_report = {"aot": [], "s": 0.0}
        if compile and aot:
            aot_report = _aot_phases(path, device, env, scratch, shapes=shapes, compile=compile)
        report = _run_child(path, device, "compile", env, shapes=shapes, compile=compile, scratch=str(scratch))
        report.update(aot=aot_report["aot"], s=report["s"] + aot_report["s"])
        key = cache_key(device)  # this process may touch the device: the child had its own caches
        files = _collect(scratch)
        entry = {"key": key, "shapes": report["shapes"], "compile": compile, "files": files,
                 "megacache": report.get("megacache", {}), "aot": report["aot"]}
        republish(path, scratch, KCACHE, [*files], {"kcache": entry})
    return dict(report, path=str(path), files=len(files), bytes=sum(f["size"] for f in files.values()), key=key)


def _aot_phases(path: Path, device: str, env: dict, scratch: Path, **args) -> dict:
    """Build the compiled MLPs in each of aot.FORMATS in turn, loading and checking them in
    another fresh process, until one format passes whole: a package that fails to load (AOTInductor
    crashed on every package under the GPU machine's torch 2.11) or disagrees with eager is not
    shipped. If none passes, the last format's good packages ship, and load(compile=True)
    torch.compiles what they do not cover. Never fails the warm."""
    from .aot import FORMATS

    t0 = time.perf_counter()
    entries: list[dict] = []
    for fmt in FORMATS:
        shutil.rmtree(scratch / "aot", ignore_errors=True)
        try:
            # Timeouts: a package load hung on the H200; generous for building on 2 cores.
            entries = _run_child(path, device, "aot", env, timeout=AOT_TIMEOUT_S, scratch=str(scratch), format=fmt, **args)["aot"]
            bad = _run_child(path, device, "aot_check", env, timeout=AOT_TIMEOUT_S, scratch=str(scratch), entries=entries, **args)["bad"]
        except QuantprepError as e:
            entries, bad = [], {"*": str(e)}
        for file, problem in bad.items():
            print(f"quantprep: warning: {fmt} package {file} not shipped: {problem}", file=sys.stderr)
        if not bad:
            break
        entries = [e for e in entries if e["file"] not in bad]
    for rel in bad:
        (scratch / rel).unlink(missing_ok=True)  # "*" (the phase failed) names no file
    if not entries:
        print("quantprep: warning: no compiled MLP packages; load(compile=True) will torch.compile", file=sys.stderr)
    return {"aot": entries, "s": round(time.perf_counter() - t0, 3)}


def _run_child(path: Path, device: str, phase: str, env: dict, timeout: float | None = None, **args) -> dict:
    arg = json.dumps(dict(args, path=str(path), device=device, phase=phase))
    try:
        proc = subprocess.run([sys.executable, "-c", "from quantprep.warm import _child_main; _child_main()", arg],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise QuantprepError(f"{path}: warm-up run ({phase}) on {device} did not finish in {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise QuantprepError(f"{path}: warm-up run ({phase}) failed on {device}: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- load side ------------------------------------------------------------------------------------

def kcache_problem(path: Path, manifest: dict) -> str | None:
    """Why the shipped kcache/ cannot be trusted (missing, extra, truncated or altered file), else None."""
    entry = manifest["kcache"]
    root = path / KCACHE
    listed = set(entry["files"])
    if root.is_dir():
        for p in root.rglob("*"):
            if p.is_file() and p.relative_to(root).as_posix() not in listed:
                return f"{p}: unknown file in kcache/ (not in manifest.json)"
    for rel, f in entry["files"].items():
        p = root / rel
        if not p.is_file():
            return f"{p}: missing (listed in manifest.json kcache)"
        if p.stat().st_size != f["size"] or sha256_file(p) != f["sha256"]:
            return f"{p}: sha256 does not match manifest.json; the kernel cache is corrupted"
    return None


def key_mismatch(built: dict, here: dict) -> str | None:
    diff = [k for k in sorted(set(built) | set(here)) if built.get(k) != here.get(k)]
    if diff:
        k = diff[0]
        return f"kernel cache built for {k}={built.get(k)!r}, this machine has {k}={here.get(k)!r}"
    return None


def runtime_dir(manifest: dict) -> Path:
    """Per-user writable copy of kcache/, one per kcache content (its digest names the directory)."""
    base = os.environ.get("QUANTPREP_KCACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "quantprep", "kcache")
    digest = hashlib.sha256(json.dumps(manifest["kcache"], sort_keys=True).encode()).hexdigest()[:16]
    return Path(base) / digest


def materialize(path: Path, manifest: dict) -> Path:
    """Copy kcache/ to its runtime directory once (copy to a temp sibling, then rename)."""
    dest = runtime_dir(manifest)
    if (dest / ".complete").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    for rel in manifest["kcache"]["files"]:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path / KCACHE / rel, tmp / rel)
    repoint_triton_groups(tmp, dest)
    (tmp / ".complete").touch()
    try:
        os.rename(tmp, dest)
    except OSError:  # another process won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def repoint_triton_groups(root: Path, final: Path) -> None:
    """Triton's `__grp__<kernel>.json` names the kernel's files by absolute path, and a group whose
    paths are gone is a cache miss: without this, every Triton kernel that warm compiled outside
    Inductor's own cache (the cuda prefill GEMM, eager and inside compiled MLPs) was compiled
    again at load (3 kernels, ~1 s on an H100). Point each group at its files in `final`."""
    for grp in root.glob("triton/*/__grp__*.json"):
        try:
            data = json.loads(grp.read_text())
            here = final / grp.parent.relative_to(root)
            data["child_paths"] = {name: str(here / Path(p).name) for name, p in data["child_paths"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):  # another Triton's format: leave it
            continue
        grp.write_text(json.dumps(data))


def activate(path: Path, manifest: dict, device_type: str, compile: bool) -> dict:
    """Point this process's kernel caches at the artifact's kcache when it is trustworthy and
    built for this machine. Returns a status dict; never raises for a bad cache (it warns)."""
    if "kcache" not in manifest:
        return {"status": "absent"}
    if not compile and device_type == "cpu":
        return {"status": "unused (no compile: the cpu target's eager kernels are not compiled at run time)"}
    problem = kcache_problem(path, manifest)
    if problem:
        return _ignored(f"{problem}; ignoring it (re-run `quantprep warm {path}`)")
    entry = manifest["kcache"]
    if entry["key"].get("device") != device_type:
        return _ignored(f"{path}: kernel cache was warmed on {entry['key'].get('device')}, loading on {device_type}; ignoring it")
    if device_type == "xpu":
        # Must precede any device query, and the key check needs one. Safe even for a foreign
        # cache: the driver validates its own entries.
        if torch.xpu.is_initialized():
            warnings.warn(f"{path}: the XPU was initialised before quantprep.load, so the driver/SYCL caches in kcache/ "
                          f"are not used; start serving with `quantprep exec {path} -- CMD` instead", stacklevel=3)
        else:
            env = cache_env(materialize(path, manifest))
            os.environ.update({k: v for k, v in env.items() if not k.startswith("TORCHINDUCTOR")})
    mismatch = key_mismatch(entry["key"], cache_key(device_type))
    if mismatch:
        return _ignored(f"{path}: {mismatch}; ignoring it (re-run `quantprep warm {path}` on this machine)")
    root = materialize(path, manifest)
    env = cache_env(root)
    os.environ["TRITON_CACHE_DIR"] = env["TRITON_CACHE_DIR"]  # also eager: the cuda prefill GEMM is a Triton kernel
    if compile:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"]
    return {"status": "used", "dir": str(root)}


def compile_model(model, manifest: dict, status: dict, dtype: torch.dtype) -> None:
    """load(compile=True): the kcache's compiled MLP packages where they fit (aot.py; no dynamo),
    torch.compile for the rest, with the mega-cache restored first. Updates `status`."""
    from .aot import install

    root = Path(status["dir"]) if status.get("status") == "used" else None
    status["aot"] = install(model, root, manifest["kcache"].get("aot", []), dtype) if root else 0
    status["compiled_regions"] = compile_regions(model)
    if root and status["compiled_regions"] and (root / MEGACACHE).is_file():  # before their first call
        info = torch.compiler.load_cache_artifacts((root / MEGACACHE).read_bytes())
        status["loaded"] = {kind: len(items) for kind, items in info.artifacts.items()} if info else {}


def _ignored(msg: str) -> dict:
    warnings.warn(msg, stacklevel=3)
    return {"status": "ignored", "reason": msg}


def exec_env(path: str | os.PathLike) -> dict[str, str]:
    """Environment for `quantprep exec`: this process's, plus the artifact's caches when usable."""
    path = Path(path).absolute()
    manifest = read_manifest(path)
    if "kcache" not in manifest:
        raise ArtifactError(f"{path}: has no kcache/; run `quantprep warm {path}` first")
    problem = kcache_problem(path, manifest)
    if problem:
        raise ArtifactError(f"{problem}; re-run `quantprep warm {path}`")
    device = manifest["kcache"]["key"].get("device")
    mismatch = key_mismatch(manifest["kcache"]["key"], cache_key(device))  # exec replaces this process: device state here is dropped
    if mismatch:
        raise ArtifactError(f"{path}: {mismatch}; re-run `quantprep warm {path}` on this machine")
    if device == "xpu" and (msg := igc_warning(dict(os.environ))):
        print(f"quantprep: warning: {msg}", file=sys.stderr)
    return dict(os.environ, **cache_env(materialize(path, manifest)))

