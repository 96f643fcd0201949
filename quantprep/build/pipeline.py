"""The pipeline, end to end: source -> prepack -> artifact, for one or more targets."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quantprep import settings
from quantprep._io.jsonfile import read_json_object
from quantprep._io.staging import check_replaceable
from quantprep.build.lm_head import CHOICES
from quantprep.build.prepack import prepack_stream
from quantprep.build.recipes import Recipe
from quantprep.build.source import (
    GPTQCheckpoint,
    _sha256_files,
    _tensor_files,
    check_against_model,
    import_model_code,
    is_gptq_dir,
    read_checkpoint,
    resolve_hub_model,
)
from quantprep.errors import RecipeError, SourceError
from quantprep.format.artifact import (
    DEFAULT_SHAPES,
    FORMAT,
    FORMAT_VERSION,
    SHARD_BYTES,
    ArtifactWriter,
    build_time,
    is_artifact,
    read_manifest,
    sha256_file,
)
from quantprep.format.verified import mark
from quantprep.runtime.warm import warm
from quantprep.targets import Target, act_dtype_problem, get_target
from quantprep.version import __version__

DEFAULT_OUT = Path("artifacts")


def cache_dir() -> Path:
    return Path(os.environ.get(settings.CACHE, DEFAULT_OUT / ".cache")).absolute()


def cached_checkpoint(sha256: str) -> Path | None:
    """The GPTQ checkpoint in this machine's build cache whose tensor files have this content hash
    (an artifact's source.sha256: manifests record no build-machine paths)."""
    from quantprep.build.source import is_gptq_dir

    for path in sorted((cache_dir() / "gptq").glob("*")):
        if is_gptq_dir(path) and _sha256_files(path, _tensor_files(path)) == sha256:
            return path
    return None


def sha256_of(path: Path) -> str:
    """Content hash of a float source: a file (GGUF), or a model directory's config.json and
    safetensors files (what gptqmodel reads)."""
    if path.is_file():
        return sha256_file(path)
    return _sha256_files(path, sorted(p.name for p in path.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"))


def quant_key(recipe: Recipe, source_sha256: str, texts: list[str]) -> str:
    """Names a cached GPTQ checkpoint by everything that makes it: the source's content, the
    calibration texts, gptqmodel's version and every quantize setting."""
    spec = {"source_sha256": source_sha256, "calibration_sha256": hashlib.sha256("\0".join(texts).encode()).hexdigest(),
            "gptqmodel": importlib.metadata.version("gptqmodel") if importlib.util.find_spec("gptqmodel") else None,
            "bits": recipe.bits, "group_size": recipe.group_size, "desc_act": recipe.desc_act, "sym": recipe.sym,
            "calibration": recipe.calibration, "samples": recipe.samples, "seed": recipe.seed,
            **({"seq_len": recipe.seq_len} if recipe.seq_len is not None else {})}  # older keys unchanged
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _quantize(recipe: Recipe, float_dir: Path, source_id: str, source_sha256: str, device: str = "auto",
              verbose: bool = False, progress: bool = True) -> tuple[Path, dict]:
    """(GPTQ checkpoint, identity fields: quantized_by, and quantized_on = the device gptqmodel ran on)."""
    out = _quantize_cached(recipe, float_dir, source_id, source_sha256, device, verbose, progress)
    from quantprep.build.quantize import QUANTIZED_ON

    try:
        on = json.loads((out / QUANTIZED_ON).read_text()).get("device")
    except (OSError, ValueError):
        on = None  # a checkpoint cached by an older quantprep
    return out, {"quantized_by": "gptqmodel", **({"quantized_on": on} if on else {})}


def _quantize_cached(recipe: Recipe, float_dir: Path, source_id: str, source_sha256: str, device: str, verbose: bool,
                     progress: bool) -> Path:
    from quantprep.build.quantize import calibration_texts, captured_output, quantize_device, quantize_gptq

    texts = calibration_texts(recipe.calibration, recipe.samples, recipe.seq_len, float_dir)
    out = cache_dir() / "gptq" / f"{recipe.name}-{quant_key(recipe, source_sha256, texts)}"
    if (out / "quantize_config.json").is_file():
        print(f"using cached GPTQ checkpoint {out}", file=sys.stderr)
        return out
    device = quantize_device(device)
    print(f"quantize {source_id} -> {out} (gptqmodel on {device}, {recipe.bits}-bit, group {recipe.group_size}, "
          f"desc_act={recipe.desc_act}, sym={recipe.sym}, {recipe.samples} samples of {Path(recipe.calibration).name}"
          f"{f' x {recipe.seq_len} tokens' if recipe.seq_len else ''}, seed {recipe.seed})", file=sys.stderr, flush=True)
    layers = read_json_object(float_dir / "config.json", SourceError, "pass a float model directory").get("num_hidden_layers")
    with captured_output(out.with_name(out.name + ".log"), verbose, layers=layers if progress and isinstance(layers, int) and layers > 0 else None):
        return quantize_gptq(float_dir, out, recipe.bits, recipe.group_size, recipe.desc_act, recipe.sym, texts, recipe.seed,
                             device=device)


def resolve_source(recipe: Recipe, source: str | None, quantize_device: str = "auto", verbose: bool = False,
                   progress: bool = True) -> tuple[Path, dict]:
    """Returns (GPTQ checkpoint dir, source identity for the manifest). Quantizes when needed, with
    gptqmodel on `quantize_device` (auto: the fastest present)."""
    dev = quantize_device
    if source is not None:
        p = Path(source)
        if p.exists():
            return _from_dir(recipe, p, {"path": str(p.absolute())}, dev, verbose, progress)
        if source.count("/") == 1 and not source.startswith((".", "/")):
            try:
                snapshot = resolve_hub_model(source)
            except SourceError as e:
                raise SourceError(f"{source}: no such directory ({p.absolute()}), and as a hub id: {e}") from None
            return _from_dir(recipe, snapshot, {"id": source}, dev, verbose, progress)
        raise SourceError(f"{source}: no such directory (and not a hub id like org/name)")
    src = recipe.source
    if "path" in src:
        p = Path(src["path"]).expanduser()
        if not p.exists():
            raise SourceError(f"{recipe.path}: source.path {p} does not exist")
        return _from_dir(recipe, p, {"path": str(p.absolute())}, dev, verbose, progress)
    if "hub" in src:
        return _from_dir(recipe, resolve_hub_model(src["hub"], src.get("revision")),
                         {"id": src["hub"], "revision": src.get("revision")}, dev, verbose, progress)
    from quantprep.build.quantize import assemble_gguf, captured_output, export_gguf, find_gguf

    if "gguf_parts" in src:
        parts = src["gguf_parts"]
        gguf = assemble_gguf(parts, src["gguf_sha256"], cache_dir() / "gguf")
        source_id, gguf_sha256 = f"{parts[0]}..{parts[-1]}", src["gguf_sha256"]
    else:
        gguf = find_gguf(src["gguf_package"], src.get("gguf_file"))
        source_id, gguf_sha256 = f"{src['gguf_package']}:{gguf.name}", sha256_of(gguf)
    float_dir = cache_dir() / "float" / f"gguf-{gguf_sha256[:16]}"  # one per GGUF, whatever the recipe
    if not (float_dir / "config.json").is_file():
        print(f"export {source_id} -> {float_dir} (transformers' GGUF reader, dequantized)", file=sys.stderr, flush=True)
        with captured_output(float_dir.with_name(float_dir.name + ".log"), verbose, "transformers"):
            export_gguf(gguf, float_dir)
    gptq, how = _quantize(recipe, float_dir, source_id, gguf_sha256, dev, verbose, progress)
    return gptq, {"id": source_id, "gguf_sha256": gguf_sha256, **how}


def _from_dir(recipe: Recipe, path: Path, identity: dict, device: str, verbose: bool = False, progress: bool = True) -> tuple[Path, dict]:
    if not path.is_dir():
        raise SourceError(f"{path}: not a directory; pass a GPTQ checkpoint or float model directory")
    if is_gptq_dir(path):
        return path, identity
    if not (path / "config.json").is_file():
        raise SourceError(f"{path}: no config.json; not a Hugging Face model directory")
    source_id = identity.get("id") or identity["path"]
    gptq, how = _quantize(recipe, path, source_id, sha256_of(path), device, verbose, progress)
    return gptq, dict(identity, **how)


def build_manifest(ckpt: GPTQCheckpoint, target, act_dtype: torch.dtype, modules: dict, identity: dict,
                   serving: dict | None = None) -> dict:
    bits = sorted({m["bits"] for m in modules.values()})
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "quantprep_version": __version__,
        # No build-machine paths: the same checkpoint gives the same manifest anywhere (reproducible builds)
        "source": dict({k: v for k, v in identity.items() if k != "path"}, sha256=ckpt.sha256, files=ckpt.tensor_files),
        "quant": ckpt.quant.to_json(),
        "target": {"name": target.name, "device": target.device, "kernels": {str(b): target.kernel(b) for b in bits},
                   "layout_version": target.layout_version, "act_dtype": str(act_dtype).removeprefix("torch.")},
        "compat": target.compat_key(),
        "modules": modules,
        "serving": serving or {"shapes": DEFAULT_SHAPES, "compile": False},
    }


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread for a build, unless OMP_NUM_THREADS says otherwise. Its OpenMP workers
    spin between ops (libgomp's default wait policy), taking CPU time from the threads that import,
    read, hash and write, while prepack's own torch ops are small
    (benchmarks/experiments/results/threads-prepack-cpu-avx512.json)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def writer(target: Target, ckpt: GPTQCheckpoint, out: Path, force: bool, shard_bytes: int) -> ArtifactWriter:
    """Shards for the torch targets; an OpenVINO IR for a graph one (build/openvino_ir.py)."""
    if target.kind == "graph":
        from quantprep.build.openvino_ir import OpenVINOWriter

        return OpenVINOWriter(out, ckpt, force)
    return ArtifactWriter(out, ckpt.path, ckpt.side_files, ckpt.nbytes, force, shard_bytes)


@one_torch_thread()
def build_artifacts(gptq_dir: Path, identity: dict, targets: list[str], out_for, act_dtype: str | None = None,
                    progress: bool = True, serving: dict | None = None, warm_here: bool = False,
                    fuse: bool = True, force: bool = False, shard_bytes: int = SHARD_BYTES, lm_head: str = "float") -> list[dict]:
    """Prepack every target in one pass over the checkpoint, layer by layer, each artifact written
    shard by shard as it streams (memory: one layer + about one shard per target, ShardWriter). `out_for(target)` -> dir.
    serving: the shapes (and compile flag) `warm` will run; warm_here: warm each artifact whose
    device is present on this machine; fuse: prepack q/k/v and gate/up as one matmul where exact;
    force: replace an output directory that is not an artifact (never the source); lm_head: "float"
    as the checkpoint has it, "int8" or "int4" (build/lm_head.py: quantprep's rounding, opted into)."""
    if lm_head not in CHOICES:
        raise RecipeError(f"lm_head {lm_head!r} (--lm-head or a recipe's build.lm_head): expected one of {', '.join(CHOICES)}")
    resolved = [get_target(t) for t in targets]  # unknown target names fail before any work
    for target in resolved:
        if lm_head != "float" and not target.quantized_lm_head:
            raise RecipeError(f"--lm-head {lm_head}: the {target.name} target keeps the checkpoint's lm_head; build it without --lm-head")
    build_time()  # a malformed SOURCE_DATE_EPOCH fails before any work
    for target in resolved:  # as do activation dtypes a target's kernels cannot run
        if problem := act_dtype_problem(target, getattr(torch, act_dtype) if act_dtype else target.default_act_dtype):
            raise RecipeError(f"act dtype {act_dtype}: {problem}; pass --act-dtype {str(target.default_act_dtype).removeprefix('torch.')} "
                              f"(or build the {target.name} target separately)")
    for target in resolved:  # and so do output directories that must not be replaced
        check_replaceable(out_for(target.name), is_artifact, "quantprep artifact", force, gptq_dir)
    # The check against the model's own modules needs transformers' modeling code, seconds of
    # imports: a thread does them while the source is validated. The check itself builds the model,
    # which sets torch's process-wide default dtype: never in a thread beside other torch work.
    with ThreadPoolExecutor(1) as pool:
        imports = pool.submit(import_model_code, Path(gptq_dir))
        ckpt = read_checkpoint(gptq_dir)
        imports.result()
    check_against_model(ckpt)
    for target in (t for t in resolved if t.kind == "graph"):  # its IR is traced and converted here (build/openvino_ir.py)
        from quantprep.build.openvino_ir import check_floats, check_tokenizer, read_config
        from quantprep.runtime.openvino_graph import traced_problem

        if problem := target.runtime_problem():
            raise RecipeError(f"target {target.name}: {problem}")
        if problem := traced_problem(read_config(ckpt.path)):
            raise SourceError(f"{ckpt.path / 'config.json'}: {problem}; build the cpu target for this model")
        check_floats(ckpt)
        check_tokenizer(ckpt.path)
    dtypes = [getattr(torch, act_dtype) if act_dtype else t.default_act_dtype for t in resolved]
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:  # every target in one pass over the source, each written as it streams
        writers = [stack.enter_context(writer(t, ckpt, out_for(t.name), force, shard_bytes)) for t in resolved]
        modules, probes = prepack_stream(ckpt, list(zip(resolved, dtypes, strict=True)), lambda i, t: writers[i].add(t),
                                         progress=progress, fuse=fuse, lm_head=lm_head)
        t1 = time.perf_counter()
        outs = [w.finish(build_manifest(ckpt, t, dt, m, identity, serving), probes)
                for w, t, dt, m in zip(writers, resolved, dtypes, modules, strict=True)]
    for out in outs:  # written and hashed here: no need to hash them again at the first load (verified.py)
        mark(out, read_manifest(out))
    t2 = time.perf_counter()
    results = []
    for target, out, mods in zip(resolved, outs, modules, strict=True):
        result = {"target": target.name, "path": str(out), "layers": len(mods),
                  "prepack_s": round(t1 - t0, 3), "write_s": round(t2 - t1, 3)}  # prepack_s includes writing the full shards
        if warm_here and target.runtime_problem() is None and target.warm_at_build:
            report = warm(out, progress=progress)
            result["warm"] = {k: report[k] for k in ("shapes", "files", "bytes", "s")}
        result["bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        results.append(result)
    return results


def prepack(src: str | os.PathLike, target: str, out: str | os.PathLike, act_dtype: str | None = None, fuse: bool = True,
            force: bool = False, progress: bool = False, shard_bytes: int = SHARD_BYTES, lm_head: str = "float") -> dict:
    """An existing GPTQ checkpoint directory -> one artifact for `target` at `out` (what `quantprep
    prepack` does; build_artifacts writes several targets in one pass). Returns its summary."""
    src = Path(src)
    [result] = build_artifacts(src, {"path": str(src.absolute())}, [target], lambda t: Path(out), act_dtype, progress=progress,
                               fuse=fuse, force=force, shard_bytes=shard_bytes, lm_head=lm_head)
    return result
