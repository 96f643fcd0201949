"""Stage 3, artifact: write a verified artifact directory atomically, and read/check one.

Layout and every manifest field are specified in docs/artifact-format.md; this module follows it.
Writing goes through staging.py (the one rule for replacing a directory): a staging sibling,
fsynced, swapped in whole; a killed build leaves only a marked `.<name>.partial-*` sibling, never
loadable, which the next writer removes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from quantprep._io.jsonfile import read_json_object
from quantprep._io.staging import MARKER, fsync_path, stage_reached, staging
from quantprep.errors import ArtifactError, QuantprepError
from quantprep.version import __version__

if TYPE_CHECKING:  # torch is imported where tensors are written: the readers here run without it (runtime/engine.py)
    import torch

FORMAT = "quantprep-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SIGNATURE = "model.sig"  # written by `quantprep sign` / `publish --sign-key` (signing.py); covers every other file
IDENTITY = "identity.json"  # the reference a signature is for (signing.py): its name and versions, signed with the files
SIGNED = {SIGNATURE: "signature", IDENTITY: "identity"}  # beside the manifest's files; an index names each by its sha256
SHARD_BYTES = 512 << 20  # in memory while building: one filling, and what is not yet written of the last (ShardWriter)
PROBES_FILE = "probes.safetensors"  # see verify.py
# Hugging Face's shard index format under a name plain transformers does not look for: without
# quantprep's quantizer (hf_quantizer.py), from_pretrained must fail, not random-initialize the
# Linears it cannot match; the quantizer points transformers at it (config.transformers_weights).
WEIGHTS_INDEX = "quantprep.safetensors.index.json"
# Files copied verbatim from the source into an artifact (when present): the only names besides
# the shards, the shard index and the probes that a manifest may list (read_manifest).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# The openvino target's files (build/openvino_ir.py): its IR in place of the shards, and
# openvino-tokenizers' IR of the tokenizer, where openvino.genai and OpenVINO Model Server look for them.
OPENVINO_MODEL = "openvino_model.xml"
OPENVINO_WEIGHTS = "openvino_model.bin"
OPENVINO_TOKENIZERS = ("openvino_tokenizer.xml", "openvino_tokenizer.bin", "openvino_detokenizer.xml", "openvino_detokenizer.bin")
OPENVINO_FILES = (OPENVINO_MODEL, OPENVINO_WEIGHTS, *OPENVINO_TOKENIZERS)
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
CODE_CONFIGS = ("config.json", "tokenizer_config.json")  # where transformers reads `auto_map` (code to import)
DEFAULT_SHAPES = [1, 16, 128, 512]  # prefill lengths warm runs (and warmup replays) unless the recipe says otherwise
TOP_KEYS = {"manifest_sha256", "format", "format_version", "quantprep_version", "created", "source", "quant", "target", "compat",
            "modules", "shards", "files"}
# serving: shapes to warm (from the recipe); kcache: written by `warm`; eval: results of `quantprep eval`
OPTIONAL_KEYS = {"serving", "kcache", "eval"}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_hashed(chunks: Iterable[bytes], out: BinaryIO, limit: int) -> tuple[str, int]:
    """Write `chunks` to `out` while another thread hashes them (hashlib releases the GIL on large
    buffers), so receiving, hashing and writing overlap. Stops at the chunk that passes `limit`
    bytes, unwritten. Returns (sha256 hex digest, bytes seen)."""
    h, n, hashing = hashlib.sha256(), 0, None
    with ThreadPoolExecutor(1) as hasher:
        for chunk in chunks:
            n += len(chunk)
            if n > limit:
                break
            if hashing is not None:
                hashing.result()  # one chunk in the hasher at a time: memory stays at two chunks
            hashing = hasher.submit(h.update, chunk)
            out.write(chunk)
        if hashing is not None:
            hashing.result()
    return h.hexdigest(), n


# The safetensors dtypes an artifact may hold: each one's name in torch and its numpy dtype
# (little-endian; BF16 as its bits), for the torch load path and safetensors_numpy alike
SAFETENSORS_DTYPES = {"F64": ("float64", "<f8"), "F32": ("float32", "<f4"), "F16": ("float16", "<f2"), "BF16": ("bfloat16", "<u2"),
                      "I64": ("int64", "<i8"), "I32": ("int32", "<i4"), "I16": ("int16", "<i2"), "I8": ("int8", "i1"),
                      "U8": ("uint8", "u1"), "BOOL": ("bool", "?")}


@functools.cache
def torch_dtypes() -> dict:
    """A safetensors header's dtype -> torch's dtype (built once: hf_quantizer asks per tensor)."""
    import torch

    return {name: getattr(torch, dtype) for name, (dtype, _) in SAFETENSORS_DTYPES.items()}


WRITE_CHUNK = 16 << 20


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str], release: bool = False) -> str:
    """Write a safetensors file (docs: huggingface.co/docs/safetensors) and return its sha256,
    computed from the bytes as they are written, in a second thread (write_hashed): no second
    read of the file. Tensors go largest element first, then by name, as safetensors orders them,
    so each one is aligned to its size. `release` drops each tensor from `tensors` once written,
    so its memory goes as the file grows."""
    import torch

    names = {dtype: name for name, dtype in torch_dtypes().items()}
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset = {"__metadata__": metadata}, 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 64)  # the data starts 64-byte aligned in the file (and in its mapped pages)

    def chunks() -> Iterator[memoryview | bytes]:
        yield len(raw).to_bytes(8, "little") + raw
        for k in order:
            t = tensors.pop(k) if release else tensors[k]
            # t: a tensor, or a source's StoredRows: converted and written a block at a time
            for block in t.blocks() if hasattr(t, "blocks") else (t,):
                data = memoryview(block.contiguous().reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(data), WRITE_CHUNK):  # so writing and hashing overlap within a tensor
                    yield data[i:i + WRITE_CHUNK]

    with open(path, "wb") as f:
        digest, _ = write_hashed(chunks(), f, 8 + len(raw) + offset)
    return digest


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    digest = write_safetensors(path, tensors, {"format": "pt"}, release=True)
    fsync_path(path)  # its writeback overlaps the packing too, instead of adding up in finish
    return digest


class ShardWriter:
    """Safetensors shards written as tensors arrive: the current shard is held until the next
    tensor would take it past `shard_bytes`, then written, hashed (write_safetensors) and fsynced
    in a thread while the next one fills (writes, hashing and fsync release the GIL); each tensor
    is freed once written. Memory: the filling shard plus what is not yet written of the previous
    one (or a tensor larger than a shard)."""

    def __init__(self, tmp: Path, shard_bytes: int):
        self.tmp, self.shard_bytes = tmp, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.done: list[tuple[Path, Future, list[str]]] = []  # (temporary path, -> sha256, tensor names)
        self.total = 0
        self.pool = ThreadPoolExecutor(1)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, t in tensors.items():
            n = t.numel() * t.element_size()
            if self.pending and self.size + n > self.shard_bytes:
                self.flush()
            self.pending[key] = t
            self.size += n
            self.total += n

    def flush(self) -> None:
        if self.pending:
            if self.done:
                self.done[-1][1].result()  # one shard in writing at a time
            path = self.tmp / f".shard-{len(self.done)}"
            keys = sorted(self.pending)  # before the writer, which empties the dict as it writes
            self.done.append((path, self.pool.submit(_write_shard, path, self.pending), keys))
            self.pending, self.size = {}, 0
            stage_reached("write")

    def close(self) -> None:
        """Wait for the shard in writing (before its directory is removed or published)."""
        self.pool.shutdown(wait=True)

    def finish(self) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """(shard names, sha256 per shard, tensor -> shard) with the Hugging Face names
        model-0000i-of-0000n.safetensors, known once the last shard is written."""
        self.flush()
        self.close()
        names, sha, weight_map = [], {}, {}
        for i, (path, digest, keys) in enumerate(self.done):
            name = f"model-{i + 1:05d}-of-{len(self.done):05d}.safetensors"
            path.rename(self.tmp / name)
            names.append(name)
            sha[name] = digest.result()
            weight_map.update(dict.fromkeys(keys, name))
        return names, sha, weight_map


def follow_umask(path: Path) -> None:
    """Give a file the mode a plain open() would: safetensors writes 0600, so an artifact built by
    CI or root could not be read by the serving user."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def is_artifact(path: Path) -> bool:
    """`path` is provably an artifact (its manifest parses and checks): staging may replace it."""
    try:
        read_manifest(path)
        return True
    except ArtifactError:
        return False


class ArtifactWriter:
    """Write one artifact atomically while its tensors stream in:

        with ArtifactWriter(out, ...) as w:
            w.add(tensors)  # any number of times; written shard by shard (ShardWriter)
            w.finish(manifest, probes)  # side files, shard index, config.json, manifest; then published

    Holds `out`'s publish lock throughout; `out` must be missing, empty or an artifact unless
    `force` (check_out_dir). Everything goes to a temporary sibling, removed if the block raises."""

    def __init__(self, out: Path, side_files_from: Path | None, side_files: list[str], need_bytes: int, force: bool = False,
                 shard_bytes: int = SHARD_BYTES):
        self.out = Path(out).absolute()
        self.side_files_from, self.side_files, self.need, self.force = side_files_from, side_files, need_bytes, force
        self.shard_bytes = shard_bytes

    def __enter__(self) -> ArtifactWriter:
        self._staging = staging(self.out, is_artifact, "quantprep artifact", self.force, self.side_files_from)
        self.tmp = self._staging.__enter__()
        try:
            free = shutil.disk_usage(self.out.parent).free
            if free < self.need + (64 << 20):
                raise QuantprepError(f"{self.out.parent}: {free / 2**30:.2f} GiB free, the artifact needs about "
                                     f"{(self.need + (64 << 20)) / 2**30:.2f} GiB; free disk space or pass --out elsewhere")
        except BaseException:
            self._staging.__exit__(*sys.exc_info())
            raise
        self.shards = ShardWriter(self.tmp, self.shard_bytes)
        return self

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.shards.add(tensors)

    def finish(self, manifest: dict, probes: dict[str, torch.Tensor] | None = None, weights_index: bool = True) -> Path:
        """`manifest` lacks shards/files/created. weights_index: the shard index from_pretrained reads."""
        tmp = self.tmp
        names, digests, weight_map = self.shards.finish()
        if probes:
            from safetensors.torch import save_file

            save_file(probes, str(tmp / PROBES_FILE), metadata={"format": "pt"})
        for name in self.side_files:
            shutil.copyfile(self.side_files_from / name, tmp / name)
        if weights_index:
            write_json_durably(tmp / WEIGHTS_INDEX, {"metadata": {"total_size": self.shards.total}, "weight_map": dict(sorted(weight_map.items()))})
        if (tmp / "config.json").is_file():
            write_json_durably(tmp / "config.json", transformers_config(json.loads((tmp / "config.json").read_text()), manifest))
        files = {}
        for p in sorted(tmp.iterdir()):
            if p.name == MARKER:
                continue
            follow_umask(p)
            files[p.name] = {"sha256": digests.get(p.name) or sha256_file(p), "size": p.stat().st_size}
        manifest = dict(manifest, created=build_time().isoformat(timespec="seconds"), shards=names, files=files)
        manifest["manifest_sha256"] = manifest_digest(manifest)
        write_json_durably(tmp / MANIFEST, manifest)
        return self.out  # published when the `with` block ends

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.shards.close()
        self._staging.__exit__(kind, value, tb)


def transformers_config(config: dict, manifest: dict) -> dict:
    """The source's config.json with quantization_config naming quantprep, so that transformers
    routes from_pretrained to quantprep's quantizer (the GPTQ settings stay in the manifest), the
    dtype the float tensors are stored in (what from_pretrained's dtype="auto" picks), and the
    architecture when the source's config lacks it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    target = manifest["target"]
    config = {k: v for k, v in config.items() if k != "torch_dtype"}
    if not config.get("architectures") and config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]  # what servers pick the class by
    return dict(config, dtype=target["act_dtype"], quantization_config={
        "quant_method": "quantprep", "format_version": FORMAT_VERSION, "target": target["name"], "device": target["device"],
        "act_dtype": target["act_dtype"], "lm_head_quantized": "lm_head" in manifest["modules"],
        **{k: manifest["quant"][k] for k in ("bits", "group_size") if k in manifest["quant"]}})


def republish(out: Path, add_from: Path, add_as: str | None, add_files: list[str], manifest_update: dict) -> None:
    """Publish `out` again with `add_from/<file>` copied to `add_as/<file>` (replacing any previous
    `add_as/`) and `manifest_update` merged into the manifest. The other files are hard links (no
    copy; files are never modified in place), so the swap is as atomic as a first build's. The
    kcache stays unless it is what is replaced (add_as "kcache")."""
    from quantprep.format.verified import is_marked, mark  # it checks files with this module's check_files

    with staging(out, is_artifact, "quantprep artifact") as tmp:
        manifest = read_manifest(out)
        check_files(out, manifest, full_hash=False)
        hashed = is_marked(out, manifest)  # before the links below change the files' ctime
        keep = list(manifest["files"])
        if add_as != "kcache":
            keep += [f"kcache/{rel}" for rel in manifest.get("kcache", {}).get("files", {})]
        for name in keep:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(out / name, tmp / name)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(out / name, tmp / name)
        for rel in add_files:
            dest = tmp / add_as / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(add_from / rel, dest)
        manifest = {k: v for k, v in manifest.items() if k != "manifest_sha256"} | manifest_update
        manifest["manifest_sha256"] = manifest_digest(manifest)
        write_json_durably(tmp / MANIFEST, manifest)
        stage_reached("warm")
    if hashed:  # the kept files are the hashed ones; the new ones were written here
        mark(out, manifest)


def build_time() -> datetime:
    """SOURCE_DATE_EPOCH when set (reproducible builds: reproducible-builds.org/specs/source-date-epoch), else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not epoch:
        return datetime.now(UTC)
    try:
        return datetime.fromtimestamp(int(epoch), UTC)
    except (ValueError, OverflowError, OSError):
        raise QuantprepError(f"SOURCE_DATE_EPOCH={epoch!r}: expected a Unix timestamp (whole seconds)") from None


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without this field: any edited field is caught."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_json_durably(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: Path) -> dict:
    """Parse and structurally check `path/manifest.json`; raises ArtifactError with one line."""
    mpath = Path(path) / MANIFEST
    if not Path(path).is_dir():
        raise ArtifactError(f"{path}: not a directory; pass an artifact directory written by `quantprep build`")
    if not mpath.is_file():
        raise ArtifactError(f"{mpath}: missing; not a quantprep artifact (or an unfinished build): rebuild it")
    m = read_json_object(mpath, ArtifactError, "the artifact is corrupt: rebuild it")
    if m.get("format") != FORMAT:
        raise ArtifactError(f"{mpath}: 'format' is not {FORMAT!r}; not a quantprep artifact")
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{mpath}: format_version {m.get('format_version')!r} is not supported by quantprep {__version__} (reads {FORMAT_VERSION}); rebuild the artifact or upgrade quantprep")
    if m.get("manifest_sha256") != manifest_digest(m):
        raise ArtifactError(f"{mpath}: manifest_sha256 does not match its content; the manifest was edited or corrupted: rebuild the artifact")
    missing = TOP_KEYS - m.keys()
    if missing:
        raise ArtifactError(f"{mpath}: missing field(s) {', '.join(sorted(missing))}; the artifact is corrupt: rebuild it")
    for key, typ in (("modules", dict), ("files", dict), ("shards", list), ("target", dict), ("compat", dict),
                     ("quant", dict), ("source", dict)):
        if not isinstance(m[key], typ):
            raise ArtifactError(f"{mpath}: field {key!r} must be a JSON {typ.__name__}; the artifact is corrupt: rebuild it")
    for name, entry in m["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str)):
            raise ArtifactError(f"{mpath}: bad entry for file {name!r}; the artifact is corrupt: rebuild it")
        if not (SHARD_NAME.fullmatch(name) or name in SIDE_FILES or name in (WEIGHTS_INDEX, PROBES_FILE, *OPENVINO_FILES)):
            raise ArtifactError(f"{mpath}: lists file {name!r}, which is not a shard (model-NNNNN-of-NNNNN.safetensors) nor a "
                                "file quantprep writes (docs/artifact-format.md); refusing the artifact")
    t = m["target"]
    if not (isinstance(t.get("name"), str) and isinstance(t.get("act_dtype"), str) and isinstance(t.get("device"), str)):
        raise ArtifactError(f"{mpath}: field 'target' needs string 'name', 'device' and 'act_dtype'; the artifact is corrupt: rebuild it")
    for name, mod in m["modules"].items():
        ok = isinstance(mod, dict) and mod.get("bits") in (4, 8) and all(
            isinstance(mod.get(k), int) and not isinstance(mod.get(k), bool) and mod[k] > 0 for k in ("in_features", "out_features", "group_size")
        ) and all(isinstance(mod.get(k), bool) for k in ("act_order", "bias")) and ("fused" not in mod or _valid_fused(mod["fused"]))
        if not ok:
            raise ArtifactError(f"{mpath}: module {name!r} has malformed metadata; the artifact is corrupt: rebuild it")
    for shard in m["shards"]:
        if not isinstance(shard, str) or shard not in m["files"]:
            raise ArtifactError(f"{mpath}: shard {shard!r} has no entry in 'files'; the artifact is corrupt: rebuild it")
    unknown = m.keys() - TOP_KEYS - OPTIONAL_KEYS
    if unknown:
        raise ArtifactError(f"{mpath}: unknown field(s) {', '.join(sorted(unknown))}; written by a newer quantprep? upgrade or rebuild")
    if "serving" in m and not _valid_serving(m["serving"]):
        raise ArtifactError(f"{mpath}: field 'serving' is malformed; the artifact is corrupt: rebuild it")
    if "eval" in m and not (isinstance(m["eval"], dict) and all(isinstance(v, dict) for v in m["eval"].values())):
        raise ArtifactError(f"{mpath}: field 'eval' is malformed; the artifact is corrupt: rebuild it or re-run `quantprep eval`")
    if "kcache" in m and not _valid_kcache(m["kcache"]):
        raise ArtifactError(f"{mpath}: field 'kcache' is malformed; the artifact is corrupt: rebuild it or re-run `quantprep warm`")
    return m


def _valid_fused(fused) -> bool:
    """{"members": [names], "sizes": [positive ints]}, one size per member (load checks them against the model)."""
    if not (isinstance(fused, dict) and fused.keys() == {"members", "sizes"}):
        return False
    members, sizes = fused["members"], fused["sizes"]
    return isinstance(members, list) and isinstance(sizes, list) and 2 <= len(members) == len(sizes) and \
        all(isinstance(x, str) and x for x in members) and all(type(n) is int and n > 0 for n in sizes)


AOT_FORMATS = {"aoti": ".pt2", "inductor": ".bin"}  # kcache.aot entry format: file suffix, in the order warm tries them


def package_format(entry: dict) -> str:
    """A kcache `aot` entry's format; entries written before formats existed are AOTInductor packages."""
    return entry.get("format", "aoti")


def _is_shape_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in x)


def _valid_serving(s) -> bool:
    return (isinstance(s, dict) and _is_shape_list(s.get("shapes")) and isinstance(s.get("compile"), bool)
            and isinstance(s.get("aot", True), bool))


def _valid_aot(entries, files: dict) -> bool:
    """kcache.aot: [{file (listed in kcache.files), signature, tokens [lo, hi], format}] (warm.py, aot.py)."""
    return isinstance(entries, list) and all(
        isinstance(e, dict) and e.get("file") in files and isinstance(e.get("signature"), str)
        and package_format(e) in AOT_FORMATS
        and _is_shape_list(e.get("tokens")) and len(e["tokens"]) == 2 and e["tokens"][0] <= e["tokens"][1]
        for e in entries)


def _valid_kcache(k) -> bool:
    if not (isinstance(k, dict) and isinstance(k.get("key"), dict) and _is_shape_list(k.get("shapes"))
            and isinstance(k.get("compile"), bool) and isinstance(k.get("files"), dict)
            and isinstance(k.get("triton_native_code", False), bool)):
        return False
    return all(isinstance(rel, str) and rel and not rel.startswith("/") and ".." not in rel.split("/")
               and isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("sha256"), str)
               for rel, f in k["files"].items()) and _valid_aot(k.get("aot", []), k["files"])


def refuse_code(path: Path, error: type[Exception]) -> None:
    """A model directory whose config.json or tokenizer_config.json names `auto_map` asks
    transformers to import Python shipped beside it (remote code): quantprep never loads one,
    as a source or as an artifact. One line naming the file."""
    for name in CODE_CONFIGS:
        if (path / name).is_file() and "auto_map" in read_json_object(path / name, error, "fix or remove the file"):
            raise error(f"{path / name}: has 'auto_map', which makes transformers import Python code shipped with the model; "
                        "quantprep loads only architectures transformers ships: remove 'auto_map' or use another model")


def check_files(path: Path, manifest: dict, full_hash: bool, staged: bool = False) -> None:
    """Sizes always (cheap, catches truncation); sha256 of every file when `full_hash`. staged: `path`
    is a staging directory (a pull checks its copy before swapping it in), which holds staging.MARKER."""
    path = Path(path)
    listed = set(manifest["files"]) | {MANIFEST, *SIGNED} | ({"kcache"} if "kcache" in manifest else set())  # kcache/: warm.py
    if staged:
        listed.add(MARKER)
    for p in path.iterdir():
        if p.name not in listed:
            raise ArtifactError(f"{p}: unknown file in the artifact (not in manifest.json); remove it or rebuild")
    for name, entry in manifest["files"].items():
        p = path / name
        if not p.is_file():
            raise ArtifactError(f"{p}: missing (listed in manifest.json); the artifact is incomplete: rebuild it")
        size = p.stat().st_size
        if size != entry["size"]:
            raise ArtifactError(f"{p}: size {size} bytes, manifest says {entry['size']}; the file is truncated or altered: rebuild")
        if full_hash and sha256_file(p) != entry["sha256"]:
            raise ArtifactError(f"{p}: sha256 does not match manifest.json; the file is corrupted: rebuild the artifact")


def read_checked(path: Path, full_hash: bool = False, manifest: dict | None = None, staged: bool = False) -> dict:
    """read_manifest + check_files, for readers racing a writer: when `warm` (adding kcache/) or a
    build republishes between the two, the files no longer match the manifest read first. Then the
    new manifest is read and checked once more, so a reader sees the old or the new artifact and no
    spurious error. `manifest`: one the caller read earlier."""
    manifest = manifest or read_manifest(path)
    try:
        check_files(path, manifest, full_hash, staged)
    except ArtifactError:
        fresh = read_manifest(path)
        if fresh["manifest_sha256"] == manifest["manifest_sha256"]:
            raise
        check_files(path, fresh, full_hash, staged)
        manifest = fresh
    return manifest
