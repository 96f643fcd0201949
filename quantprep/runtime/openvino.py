"""Stage 5 for the openvino target: an artifact's IR run by OpenVINO, through openvino.genai.

`quantprep.load` hands an openvino artifact here after the checks every artifact gets (manifest,
hashes, signature, compatibility key). What comes back is `OpenVINOModel`, a thin wrapper: its
`pipeline` is openvino_genai.LLMPipeline on the artifact directory (generate, chat, streaming);
`logits` runs the IR itself, token ids in, logits out (eval, tests). openvino is imported here
only, and only when an openvino artifact is loaded.

An artifact carries data, never a program (docs/security.md). Its graph runs only after it
compared equal, as text and bytes, to the IR quantprep writes from that IR's own weights, before
OpenVINO reads it, and then by OpenVINO's IR frontend alone (`checked_ir`). Its tokenizer and detokenizer IR never run here: text becomes ids and
ids text through `runtime/tokenizer.py` (the hashed tokenizer.json, the chat template rendered in
quantprep's sandbox), and openvino.genai is given ids, from a private directory that holds links to
the model's IR only (`pipeline`).

The model cache: `quantprep warm DIR --device CPU|GPU` runs the pipeline once with OpenVINO's
CACHE_DIR in a scratch directory and ships it in kcache/openvino/, keyed by the OpenVINO version
and the device (name, architecture, driver). Compiled blobs are code for the device, so the cache
is trusted and copied like every kcache (kcache.py); a cache for another device or version is
ignored with a warning, since OpenVINO would otherwise recompile silently.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from quantprep.errors import ArtifactError, ArtifactMismatch, QuantprepError
from quantprep.format.artifact import OPENVINO_FILES, OPENVINO_MODEL, OPENVINO_WEIGHTS
from quantprep.runtime.checked import check_compat
from quantprep.runtime.kcache import Kcache, untrusted_message

if TYPE_CHECKING:
    from quantprep.targets.base import Target

CACHE_SUBDIR = "openvino"  # kcache/openvino/: OpenVINO's CACHE_DIR
# The plugin computes what the IR says: f32 arithmetic, no dynamic int8 quantization of the
# activations, an f32 KV cache (its default u8 cache alone moved decode logits by 1e-3 relative).
# verify, eval and the tests use it; serving takes the plugin's defaults unless asked.
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0", "KV_CACHE_PRECISION": "f32"}
# openvino.genai's stateful pipeline, not its default PagedAttention one: quantprep serves one request
# at a time, and only the stateful pipeline's compile is served from the model cache (PagedAttention
# rebuilt its model at every start, cached or not: BENCHMARKS.md, "OpenVINO target").
PIPELINE = {"ATTENTION_BACKEND": "SDPA"}
DEVICES = ("CPU", "GPU")
# An IR's .xml is the graph only (the weights are in the .bin): quantprep writes ~80 KB per decoder
# layer; OpenVINO parses it whole, so a larger one is refused before it is read.
MAX_IR_XML = 64 << 20


def device_name(device: str | None, present: bool = True) -> str:
    """OpenVINO's device name: CPU (default), GPU, GPU.1, ...; `present`: OpenVINO must see it here."""
    name = (device or "CPU").upper()
    if name.split(".")[0] not in DEVICES:
        raise ArtifactMismatch(f"device {device!r}: an openvino artifact runs on OpenVINO's CPU or GPU (GPU.N) device")
    if present:
        import openvino as ov

        seen = ov.Core().available_devices
        if name not in seen and not (name == "GPU" and "GPU.0" in seen):
            raise ArtifactMismatch(f"device {name}: OpenVINO sees no such device here (it sees {', '.join(seen) or 'none'}); "
                                   "on an Arc, install Intel's GPU driver (docs/openvino.md)")
    return name


def cache_key(device: str) -> dict:
    """What OpenVINO's compiled blobs depend on (the GPU plugin keys them by driver and architecture too)."""
    import openvino as ov

    core = ov.Core()
    key = {"device": f"openvino:{device.split('.')[0]}", "openvino": ov.get_version()}
    for field, prop in (("name", "FULL_DEVICE_NAME"), ("architecture", "DEVICE_ARCHITECTURE"), ("driver", "GPU_DRIVER_VERSION")):
        try:
            key[field] = str(core.get_property(device, prop))
        except RuntimeError:  # a property this device does not report (the CPU has no driver)
            pass
    return key


def cache_status(kcache: Kcache, device: str) -> dict:
    """The kcache's OpenVINO cache for this device, when intact, trusted and built for it; never
    raises for a bad cache (it warns, and OpenVINO compiles as if there were none)."""
    path, entry = kcache.path, kcache.entry
    if entry is None:
        return {"status": "absent"}
    if kcache.problem:
        return _ignored(f"{kcache.problem}; ignoring it (re-run `quantprep warm {path}`)")
    if not any(rel.startswith(f"{CACHE_SUBDIR}/") for rel in entry["files"]):
        return _ignored(f"{path}: kcache/ holds no OpenVINO cache; ignoring it (re-run `quantprep warm {path}`)")
    reason = kcache.trusted
    if reason is None:
        warnings.warn(untrusted_message(path), stacklevel=3)
        return {"status": "untrusted"}
    if mismatch := kcache.mismatch(cache_key(device)):
        return _ignored(f"{path}: {mismatch}; ignoring it (re-run `quantprep warm {path} --device {device}` on this machine)")
    try:
        root = kcache.runtime_copy()
    except (QuantprepError, OSError) as e:
        return _ignored(f"kernel cache not usable: {e}")
    return {"status": "used", "dir": str(root / CACHE_SUBDIR), "trusted": reason}


def _ignored(msg: str) -> dict:
    warnings.warn(msg, stacklevel=3)
    return {"status": "ignored", "reason": msg}


class OpenVINOModel:
    """An openvino artifact, loaded: `pipeline` (openvino_genai.LLMPipeline, created at first use),
    `generate(prompt)`, `generate_ids(ids)` and `logits(input_ids)`. `ir` is its checked graph;
    `config` holds the OpenVINO properties both use (EXACT, or the plugin's defaults);
    `quantprep_kcache` says whether the model cache was used."""

    def __init__(self, path: Path, manifest: dict, ir, device: str, config: dict, kcache: dict):
        self.quantprep_path, self.manifest, self.ir, self.device, self.config = path, manifest, ir, device, dict(config)
        self.quantprep_kcache = kcache
        if kcache.get("status") == "used":
            self.config["CACHE_DIR"] = kcache["dir"]

    @cached_property
    def tokenizer(self):
        """The artifact's tokenizer.json and chat template (runtime/tokenizer.py), read as checked; a
        template that cannot be used fails each chat prompt in one line, not plain text."""
        from quantprep.runtime.tokenizer import ArtifactTokenizer

        return ArtifactTokenizer(self.quantprep_path, self.manifest["files"], defer_template_error=True)

    @cached_property
    def pipeline(self):
        """openvino.genai's pipeline over the model's IR alone: it runs from a private directory of
        links to openvino_model.xml/.bin, so it neither reads nor runs the artifact's tokenizer IR or
        JSON files, and takes and gives token ids."""
        import openvino_genai

        links = Path(tempfile.mkdtemp(prefix="quantprep-openvino-"))  # 0700: nobody else can swap a link
        try:
            for name in (OPENVINO_MODEL, OPENVINO_WEIGHTS):
                (links / name).symlink_to((self.quantprep_path / name).absolute())
            with openvino_errors(self.quantprep_path):
                return openvino_genai.LLMPipeline(str(links), self.device, **{**PIPELINE, **self.config})
        finally:
            shutil.rmtree(links, ignore_errors=True)  # the pipeline holds what it read

    def generation_config(self, max_new_tokens: int):
        """Greedy decoding to `max_new_tokens`, stopping at the artifact's end-of-sequence ids and with
        its repetition penalty, as `quantprep generate` on the other targets (transformers' generate)."""
        import openvino_genai

        tok = self.tokenizer if "tokenizer.json" in self.manifest["files"] else None
        eos, penalty = (tok.eos, tok.repetition_penalty) if tok else (set(), 1.0)
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.do_sample, config.repetition_penalty = max_new_tokens, False, penalty
        if eos:
            config.eos_token_id, config.stop_token_ids = min(eos), set(eos)
        else:  # genai's own default (-1) is refused by its checks; nothing stops generation but the length
            config.eos_token_id, config.stop_token_ids, config.ignore_eos = 0, {0}, True
        return config

    def generate_ids(self, ids: list[int], config, streamer=None) -> list[int]:
        """The new token ids after `ids`, by `config` (generation_config); `streamer`: an
        openvino_genai.StreamerBase, told each token."""
        import openvino as ov

        vocab = self.vocab_size()
        if not ids or not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise QuantprepError(f"{self.quantprep_path}: token ids must be 0..{vocab - 1}, and at least one")
        tensor = ov.Tensor(np.asarray([ids], dtype=np.int64))
        return [int(t) for t in self.pipeline.generate(tensor, config, streamer).tokens[0]]

    def generate(self, prompt: str, max_new_tokens: int = 64, chat: bool = True, streamer=None) -> str:
        """Greedy completion of `prompt`, through the model's chat template where it has one (rendered
        in quantprep's sandbox, runtime/tokenizer.py)."""
        tok = self.tokenizer
        ids = tok.prompt_ids(prompt) if chat else tok.text_ids(prompt)
        return tok.decode(self.generate_ids(ids, self.generation_config(max_new_tokens), streamer))

    @cached_property
    def compiled(self):
        import openvino as ov

        with openvino_errors(self.quantprep_path):
            return ov.Core().compile_model(self.ir, self.device, self.config)

    def _config(self) -> dict:
        from quantprep._io.jsonfile import read_json_object

        if not (self.quantprep_path / "config.json").is_file():
            return {}
        return read_json_object(self.quantprep_path / "config.json", ArtifactError, "rebuild the artifact")

    def max_position_embeddings(self) -> int | None:
        """The context the source's config.json gives (serve bounds prompts by it), None without one."""
        value = self._config().get("max_position_embeddings")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def vocab_size(self) -> int:
        """The rows of the IR's logits (ids past them would read outside the embedding)."""
        return int(self.ir.output("logits").get_partial_shape()[2].get_length())

    def __call__(self, input_ids, **_):
        """model(input_ids=[[...]]).logits, as a transformers model answers (eval): one sequence, from an empty KV cache."""
        import torch

        ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids).reshape(-1)
        return _Output(torch.from_numpy(self.logits(ids))[None])

    def logits(self, input_ids) -> np.ndarray:
        """Logits [tokens, vocab] (float32) of one sequence of token ids, from an empty KV cache."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(1, -1)
        request = self.compiled.create_infer_request()
        request.reset_state()
        out = request.infer({"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None],
                             "beam_idx": np.zeros(1, dtype=np.int32)})
        return np.array(out["logits"][0], dtype=np.float32)


class openvino_errors:
    """OpenVINO's errors reading or compiling an artifact's IR as one ArtifactError line (a hand-made
    or damaged IR is the artifact's fault, not a crash of quantprep)."""

    def __init__(self, path: Path, name: str = OPENVINO_MODEL):
        self.path, self.name = path, name

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None and issubclass(kind, RuntimeError):
            lines = [line for line in str(value).splitlines() if line.strip()]
            first = lines[-1].strip()[:300] if lines else kind.__name__  # OpenVINO's last line says what failed
            raise ArtifactError(f"{self.path / self.name}: OpenVINO cannot read or compile it ({first}); rebuild the artifact") from None
        return False


def check_files(path: Path, manifest: dict) -> None:
    """The IR the manifest must list, and .xml files of a bounded size (they are parsed whole)."""
    files = manifest["files"]
    for name in (OPENVINO_MODEL, OPENVINO_WEIGHTS):
        if name not in files:
            raise ArtifactError(f"{path}: an openvino artifact without {name} in manifest.json; rebuild it")
    for name in OPENVINO_FILES:
        if name.endswith(".xml") and name in files and files[name]["size"] > MAX_IR_XML:
            raise ArtifactError(f"{path / name}: {files[name]['size']} bytes, more than the {MAX_IR_XML >> 20} MiB an IR graph may have; "
                                "refusing it")


def read_ir(path: Path, name: str = OPENVINO_MODEL, extension: str | None = None):
    """An IR read by OpenVINO's IR frontend only (never another frontend, whatever the content);
    `extension`: a library of operations it may name (openvino-tokenizers', installed here). For an
    IR quantprep wrote, or one `checked_ir` compared: reading runs part of a graph (shape inference)."""
    from openvino.frontend import FrontEndManager

    frontend = FrontEndManager().load_by_framework("ir")
    if extension:
        frontend.add_extension(extension)
    with openvino_errors(path, name):
        return frontend.convert(frontend.load(str(path / name)))


def checked_ir(path: Path, manifest: dict, marked: bool = True):
    """The artifact's model IR, read by OpenVINO only once it equals, as text and bytes, the IR
    quantprep writes from that IR's own weight constants and the artifact's config.json
    (runtime/openvino_graph.py); else one line. Checked once per user for the same manifest,
    quantprep and OpenVINO (a mark beside the hash marks, format/verified.py); `marked=False`: every time (verify)."""
    import hashlib
    import json

    import openvino as ov

    from quantprep._io.jsonfile import read_json_object
    from quantprep._io.userdirs import private_dir
    from quantprep.format.verified import marks_dir
    from quantprep.targets.openvino import ir_tree
    from quantprep.version import __version__

    files = manifest["files"]
    if "config.json" not in files:
        raise ArtifactError(f"{path}: an openvino artifact without config.json in manifest.json; rebuild it")
    key = hashlib.sha256(json.dumps(["openvino-ir", manifest["manifest_sha256"], __version__, ov.get_version()]).encode()).hexdigest()
    try:
        mark = private_dir(marks_dir()) / f"ir-{key}"
    except (OSError, ArtifactError):  # no usable cache: compare every time
        mark = None
    if not marked or mark is None or not mark.is_file():
        from quantprep.runtime.openvino_graph import rebuilt_difference  # torch and transformers: the trace it compares with

        config = read_json_object(path / "config.json", ArtifactError, "rebuild the artifact")
        try:
            root = ir_tree((path / OPENVINO_MODEL).read_bytes())
        except ValueError as e:
            raise ArtifactError(f"{path / OPENVINO_MODEL}: not OpenVINO IR ({e}); rebuild the artifact") from None
        with tempfile.TemporaryDirectory(prefix="quantprep-ir-") as scratch:
            difference = rebuilt_difference(config, manifest["modules"], root, path / OPENVINO_WEIGHTS, files[OPENVINO_WEIGHTS]["sha256"],
                                            Path(scratch))
        if difference:
            raise ArtifactError(f"{path / OPENVINO_MODEL}: not the IR quantprep writes from its weights and config.json "
                                f"({difference}); rebuild the artifact with `quantprep prepack`")
        if mark is not None:
            mark.touch()
    return read_ir(path)


class _Output:
    def __init__(self, logits):
        self.logits = logits


def load(path: Path, checked: tuple[dict, Target], device: str | None, exact: bool, kcache: Kcache | None) -> OpenVINOModel:
    """A checked openvino artifact (`checked`: checked.checked_artifact's result) -> OpenVINOModel, once
    it fits this machine (check_compat; its graph checked, nothing compiled yet); `kcache`: the
    artifact's, as load opened it (None: not to be used)."""
    manifest, target = checked
    check_compat(path, manifest, target)
    device = device_name(device)
    check_files(path, manifest)
    ir = checked_ir(path, manifest)
    status = cache_status(kcache, device) if kcache is not None else {"status": "off"}
    return OpenVINOModel(path, manifest, ir, device, EXACT if exact else {}, status)


def warm(path: Path, manifest: dict, device: str | None, scratch: Path) -> dict:
    """Compile the pipeline with OpenVINO's cache in scratch/openvino and generate one token: what
    `quantprep warm` ships for an openvino artifact. Returns the report's fields; `reused`: whether
    OpenVINO compiling it again read that cache, and did not write it anew. (OpenVINO 2026.4.1's CPU
    plugin cannot import its own compiled model of tiled experts, GatherMatmulCompressed: it
    compiles again and rewrites the blob, which then costs its export at every start.)"""
    device = device_name(device)
    cache = scratch / CACHE_SUBDIR
    cache.mkdir(parents=True, exist_ok=True)
    ir = checked_ir(path, manifest)
    model = OpenVINOModel(path, manifest, ir, device, {}, {"status": "used", "dir": str(cache)})
    t0 = time.perf_counter()
    model.generate_ids([0], model.generation_config(1))
    s = round(time.perf_counter() - t0, 3)
    del model

    def listing() -> dict:
        return {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in cache.iterdir()}

    written = listing()
    again = OpenVINOModel(path, manifest, ir, device, {}, {"status": "used", "dir": str(cache)}).pipeline  # compiled again
    del again
    reused = written == listing()
    return {"key": cache_key(device), "s": s, "shapes": [1], "compiled_regions": 0, "aot": [], "reused": reused}
