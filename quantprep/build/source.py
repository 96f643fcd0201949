"""Stage 1, source: find or make a GPTQ checkpoint and read it into validated tensors.

Either ingest an existing GPTQ directory (HF layout) or quantize a float model with gptqmodel
(imported lazily: only building needs it, never loading). A checkpoint is read layer by layer
when a layer is asked for, never held whole, so memory stays flat whatever the model's size.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from quantprep._io.background import in_thread
from quantprep._io.jsonfile import read_json_object
from quantprep.errors import SourceError
from quantprep.format.artifact import SIDE_FILES, refuse_code, torch_dtypes
from quantprep.format.expert_names import PROJECTIONS as EXPERT_PROJECTIONS
from quantprep.format.expert_names import current_name
from quantprep.format.gptq import SUPPORTED_BITS

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
@dataclass(frozen=True)
class QuantConfig:
    bits: int
    group_size: int  # -1 = one group over all of K
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" (v1: qzeros store zero-1) or "gptq_v2" (store zero)

    def to_json(self) -> dict:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": self.desc_act,
            "checkpoint_format": self.checkpoint_format,
        }


@dataclass
class GPTQLayer:
    """One quantized Linear as stored on disk (packed), validated."""

    name: str
    bits: int
    group_size: int  # resolved: never -1 (K when the checkpoint says -1)
    in_features: int  # K
    out_features: int  # N
    qweight: torch.Tensor  # int32 [K * bits/32, N]
    qzeros: torch.Tensor  # int32 [G, N * bits/32], v2 values (zero, not zero-1)
    scales: torch.Tensor  # [G, N]
    g_idx: torch.Tensor  # int64 [K]
    bias: torch.Tensor | None


@dataclass
class GPTQCheckpoint:
    path: Path
    quant: QuantConfig
    model_config: dict
    layers: Mapping[str, GPTQLayer]  # read from disk and validated at each access (LazyLayers)
    other_tensors: LazyTensors  # embeddings, norms, float lm_head, ... (read at each access)
    tensor_files: list[str]
    sha256_job: Future  # -> the sha256 over the source's tensor files, in name order (hashed in a thread)
    side_files: list[str] = field(default_factory=list)
    layer_sizes: dict[str, tuple[int, int, bool]] = field(default_factory=dict)  # name -> (K, N, has a bias)
    nbytes: int = 0  # the tensor files' size

    @property
    def sha256(self) -> str:
        return self.sha256_job.result()


FLOAT_DTYPES = {name: dt for name, dt in torch_dtypes().items() if dt.is_floating_point}


@dataclass(frozen=True)
class StoredRows:
    """A large float tensor of the source (an embedding: 1.1 GB for a 7B model) to be written as
    `dtype`: the artifact writer calls blocks() and writes each block as it comes, so neither the
    stored tensor nor its conversion is ever whole in memory. The file is reopened per block so its
    mapped pages are let go as it goes."""

    path: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    block_bytes: int

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def blocks(self) -> Iterator[torch.Tensor]:
        rows = max(1, self.block_bytes // (self.numel() // self.shape[0] * self.element_size()))
        for start in range(0, self.shape[0], rows):
            try:
                with safe_open(self.path, framework="pt") as f:
                    block = f.get_slice(self.key)[start:start + rows]
            except Exception as e:  # safetensors raises its own error types for bad data
                raise SourceError(f"{self.path}: cannot read tensor {self.key} ({e}); re-download or re-export it") from None
            yield block.to(self.dtype).contiguous()


class LazyTensors(Mapping):
    """name -> tensor, read from its safetensors file at each access and not kept."""

    def __init__(self, path: Path, where: dict[str, str], names: list[str], stored: dict[str, str] | None = None):
        """where: name -> its file; stored: name -> the key it is stored under, where that differs
        (a legacy name, format/expert_names.current_name)."""
        self.path, self.where, self.names, self.stored = path, where, names, stored or {}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.read([key])[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape, from the file's header (nothing else read)."""
        try:
            with safe_open(self.path / self.where[key], framework="pt") as f:
                return tuple(f.get_slice(self.stored.get(key, key)).get_shape())
        except Exception as e:  # safetensors raises its own error types for bad data
            raise SourceError(f"{self.path / self.where[key]}: cannot read tensor {key} ({e}); re-download or re-export it") from None

    def read(self, keys: list[str], header_only: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Several tensors, each file opened once (an open parses the whole header). Keys in
        `header_only` come back as meta tensors of the stored shape when stored as int32 (nothing read)."""
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.where[key], []).append(key)
        out = {}
        for fname, names in by_file.items():
            try:
                with safe_open(self.path / fname, framework="pt") as f:
                    for key in names:
                        view = f.get_slice(self.stored.get(key, key)) if key in header_only else None
                        if view is not None and view.get_dtype() == "I32":
                            out[key] = torch.empty(view.get_shape(), dtype=torch.int32, device="meta")
                        else:
                            out[key] = f.get_tensor(self.stored.get(key, key))
            except Exception as e:  # safetensors raises its own error types for bad data
                raise SourceError(f"{self.path / fname}: cannot read tensor(s) {', '.join(names)} ({e}); re-download or "
                                  "re-export it") from None
        return out

    def read_converted(self, key: str, dtypes: list[torch.dtype], block_bytes: int = 32 << 20) -> list:
        """The tensor `key` for each of `dtypes`: floating point ones converted, others as stored. One
        larger than `block_bytes` comes back as StoredRows, read and converted while it is written."""
        path = self.path / self.where[key]
        try:
            with safe_open(path, framework="pt") as f:  # one open (it parses the whole header) for both cases
                view = f.get_slice(self.stored.get(key, key))
                shape, stored = tuple(view.get_shape()), FLOAT_DTYPES.get(view.get_dtype())
                if stored is not None and len(shape) >= 2 and math.prod(shape) * stored.itemsize > block_bytes:
                    return [StoredRows(path, self.stored.get(key, key), shape, d, block_bytes) for d in dtypes]
                t = f.get_tensor(self.stored.get(key, key))
        except Exception as e:  # safetensors raises its own error types for bad data
            raise SourceError(f"{path}: cannot read tensor {key} ({e}); re-download or re-export it") from None
        return [(t.to(d) if t.is_floating_point() else t).contiguous() for d in dtypes]

    def __contains__(self, key: object) -> bool:
        return key in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class LazyLayers(Mapping):
    """layer name -> GPTQLayer, its tensors read and validated at each access."""

    def __init__(self, tensors: LazyTensors, parts: dict[str, list[str]], quant: QuantConfig):
        self.tensors, self.parts, self.quant = tensors, parts, quant

    def __getitem__(self, name: str) -> GPTQLayer:
        """The layer, read; shapes and dtypes checked (its values were checked by `check`)."""
        return _validate_layer(name, self._read(name), self.quant, values=False)

    def check(self, name: str) -> GPTQLayer:
        """Every check, values included, without reading qweight (only its header): read_checkpoint's
        pass that makes bad input fail before any work. The layer's qweight is a meta tensor."""
        return _validate_layer(name, self._read(name, header_only=(f"{name}.qweight",)), self.quant, values=True)

    def _read(self, name: str, header_only: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        t = self.tensors.read([f"{name}.{p}" for p in self.parts[name]], header_only)
        return {key.rpartition(".")[2]: v for key, v in t.items()}

    def __contains__(self, key: object) -> bool:
        return key in self.parts

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


def _read_json(path: Path) -> dict:
    return read_json_object(path, SourceError, "fix or re-export the file")


def read_quant_config(path: Path) -> QuantConfig:
    """Read `quantize_config.json`, else `config.json["quantization_config"]`."""
    qc_file = path / "quantize_config.json"
    if qc_file.is_file():
        raw, where = _read_json(qc_file), qc_file
    else:
        cfg_file = path / "config.json"
        raw = _read_json(cfg_file).get("quantization_config") if cfg_file.is_file() else None
        where = f"{cfg_file}[quantization_config]"
        if not raw:
            raise SourceError(f"{path}: no quantize_config.json and no quantization_config in config.json; is this a GPTQ checkpoint?")
    method = raw.get("quant_method", "gptq")
    if method != "gptq":
        raise SourceError(f"{where}: quant_method is {method!r}; quantprep reads GPTQ checkpoints only")
    if raw.get("dynamic"):
        raise SourceError(f"{where}: per-layer 'dynamic' quantization overrides are not supported; re-quantize with one config for all layers")
    try:
        bits, group_size = int(raw["bits"]), int(raw.get("group_size", -1))
    except (KeyError, TypeError, ValueError):
        raise SourceError(f"{where}: 'bits' and 'group_size' must be integers") from None
    if bits not in SUPPORTED_BITS:
        raise SourceError(f"{where}: bits={bits} is not supported (only {SUPPORTED_BITS}); re-quantize to 4 or 8 bits")
    if group_size != -1 and group_size <= 0:
        raise SourceError(f"{where}: group_size={group_size} must be -1 or positive")
    fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise SourceError(f"{where}: checkpoint_format {fmt!r} is not supported (expected 'gptq' or 'gptq_v2')")
    return QuantConfig(bits, group_size, bool(raw.get("sym", True)), bool(raw.get("desc_act", False)), fmt)


def inside_source(path: Path, name: str) -> bool:
    """`path/name` is, after every link, a file of the source directory itself, or (in a Hugging Face
    cache snapshot, whose files are links) a blob of that repository's cache: a link elsewhere
    (`merges.txt -> ~/.ssh/id_ed25519`) would copy a user's file into the artifact."""
    real = (path / name).resolve()
    if path.resolve() in real.parents:
        return True
    snapshot = path.absolute()
    repo = snapshot.parent.parent
    blobs = repo / "blobs"  # huggingface_hub's own: a real directory of the repository's cache, never a link
    return (snapshot.parent.name == "snapshots" and repo.name.startswith("models--") and not blobs.is_symlink()
            and blobs.is_dir() and real.parent == repo.resolve() / "blobs")


def _source_file(path: Path, name: str, what: str) -> bool:
    """Whether `path/name` is a file to read; refuses (one line) one that leads outside the source."""
    if not (path / name).is_file():
        return False
    if not inside_source(path, name):
        raise SourceError(f"{path / name}: {what} is a link to {(path / name).resolve()}, outside the checkpoint; refusing it: "
                          "copy the file into the checkpoint if it belongs to the model")
    return True


def _tensor_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise SourceError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (isinstance(f, str) and f.endswith(".safetensors") and "/" not in f and "\\" not in f and not f.startswith(".")):
                raise SourceError(f"{index}: weight_map names {f!r}, not a plain *.safetensors file name in the checkpoint; "
                                  "fix the index")
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{path}: no *.safetensors files (quantprep never reads pickle .bin files); convert the checkpoint to safetensors")
    for f in files:
        if not _source_file(path, f, "a weights file"):
            raise SourceError(f"{path / f}: listed in the index but missing")
    return files


def _sha256_files(path: Path, files: list[str]) -> str:
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0")
        with open(path / name, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def _check(cond: bool, tensor: str, problem: str) -> None:
    if not cond:
        raise SourceError(f"tensor {tensor}: {problem}; re-export or re-quantize the checkpoint")


def _validate_layer(name: str, t: dict[str, torch.Tensor], q: QuantConfig, values: bool = True) -> GPTQLayer:
    for part in ("qweight", "qzeros", "scales"):
        if part not in t:
            raise SourceError(f"tensor {name}.{part}: missing (found {name}.qweight); the checkpoint is incomplete")
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    per = 32 // q.bits
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2, f"{name}.qweight", f"expected int32 2-D, got {qweight.dtype} {tuple(qweight.shape)}")
    K, N = qweight.shape[0] * per, qweight.shape[1]
    gs = K if q.group_size == -1 else q.group_size
    G = math.ceil(K / gs)
    _check(N % per == 0, f"{name}.qweight", f"out_features {N} is not a multiple of {per} (cannot pack qzeros at {q.bits} bits)")
    _check(qzeros.dtype == torch.int32 and tuple(qzeros.shape) == (G, N // per),
           f"{name}.qzeros", f"expected int32 {(G, N // per)} for K={K}, N={N}, group_size={q.group_size}, bits={q.bits}; got {qzeros.dtype} {tuple(qzeros.shape)}")
    _check(scales.dtype in SCALE_DTYPES and tuple(scales.shape) == (G, N),
           f"{name}.scales", f"expected float16/bfloat16/float32 {(G, N)} (G = ceil(K / group_size)); got {scales.dtype} {tuple(scales.shape)}")
    # float(): isfinite on float16 has no vectorized CPU path (2.5x slower than converting first)
    _check(not values or bool(torch.isfinite(scales.float()).all()), f"{name}.scales", "contains NaN or Inf")
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(K) // gs
    else:
        _check(g_idx.dtype in (torch.int32, torch.int64) and tuple(g_idx.shape) == (K,),
               f"{name}.g_idx", f"expected int32 ({K},), got {g_idx.dtype} {tuple(g_idx.shape)}")
        g_idx = g_idx.to(torch.int64)
        if values:
            _check(bool(((g_idx >= 0) & (g_idx < G)).all()), f"{name}.g_idx", f"values out of range [0, {G})")
            # A valid grouping: every group holds group_size inputs, the last one the remainder.
            counts = torch.bincount(g_idx, minlength=G)
            expected = torch.full((G,), gs)
            expected[-1] = K - gs * (G - 1)
            _check(bool((counts == expected).all()), f"{name}.g_idx", f"is not a valid grouping (each group must hold {gs} inputs)")
    bias = t.get("bias")
    if bias is not None:
        _check(bias.dim() == 1 and bias.shape[0] == N and bias.is_floating_point(), f"{name}.bias", f"expected float ({N},), got {bias.dtype} {tuple(bias.shape)}")
    if q.checkpoint_format == "gptq":
        from quantprep.format.gptq import v1_to_v2_qzeros

        qzeros = v1_to_v2_qzeros(qzeros, q.bits)
    return GPTQLayer(name, q.bits, gs, K, N, qweight, qzeros, scales, g_idx, bias)


def read_checkpoint(path: str | os.PathLike) -> GPTQCheckpoint:
    """Read and validate a GPTQ checkpoint directory (single or sharded safetensors)."""
    path = Path(path)
    if not path.is_dir():
        raise SourceError(f"{path}: not a directory; pass a GPTQ checkpoint directory")
    quant = read_quant_config(path)
    refuse_code(path, SourceError)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise SourceError(f"{cfg_file}: missing; a GPTQ checkpoint needs the model's config.json")
    model_config = _read_json(cfg_file)
    files = _tensor_files(path)
    # the hash is only needed for the manifest, at the end: reading and hashing release the GIL,
    # so it overlaps the checks and the packing instead of adding a pass over the source before them
    sha256_job = in_thread(_sha256_files, path, files)
    where: dict[str, str] = {}
    stored: dict[str, str] = {}  # current name -> a legacy name it is stored under
    model_type = model_config.get("model_type") if isinstance(model_config.get("model_type"), str) else None
    for fname in files:
        try:
            with safe_open(path / fname, framework="pt") as f:  # the header only; tensors are read per layer
                keys = list(f.keys())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise SourceError(f"{path / fname}: cannot read safetensors file ({e}); re-download or re-export it") from None
        for key in keys:
            name = current_name(key, model_type)
            if name in where:
                raise SourceError(f"{path / fname}: tensor {key} is {name}, which the checkpoint also holds; re-export it")
            where[name] = fname
            if name != key:
                stored[name] = key

    parts_by_layer: dict[str, list[str]] = {}
    for key in where:
        if key.endswith(".qweight"):
            parts_by_layer[key[: -len(".qweight")]] = []
    other: list[str] = []
    for key in where:
        prefix, _, part = key.rpartition(".")
        if prefix in parts_by_layer and part in ("qweight", "qzeros", "scales", "g_idx", "bias"):
            parts_by_layer[prefix].append(part)
        elif part in ("qzeros", "scales", "g_idx"):
            raise SourceError(f"tensor {key}: has no matching {prefix}.qweight; the checkpoint is incomplete")
        else:
            other.append(key)
    if not parts_by_layer:
        raise SourceError(f"{path}: no '*.qweight' tensors found; is this a GPTQ checkpoint?")
    tensors = LazyTensors(path, where, sorted(other), stored)
    layers = LazyLayers(tensors, dict(sorted(parts_by_layer.items())), quant)
    sizes = {}
    for name in layers:  # validate every layer now, one at a time: bad input fails before any work
        layer = layers.check(name)
        sizes[name] = (layer.in_features, layer.out_features, layer.bias is not None)
    side = [f for f in SIDE_FILES if _source_file(path, f, "a side file")]
    return GPTQCheckpoint(path, quant, model_config, layers, tensors, files, sha256_job, side, sizes,
                          sum((path / f).stat().st_size for f in files))


def import_model_code(path: Path) -> None:
    """Import what check_against_model will need (transformers' config and modeling modules for
    this model type), so that a thread can do it ahead; errors are left for the check to report."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(path, trust_remote_code=False))]
    except Exception:
        pass


def check_against_model(ckpt: GPTQCheckpoint) -> None:
    """Every quantized layer must be a Linear of the model its config.json describes, with the same
    sizes and a bias exactly where the model's module has one: a checkpoint that lost a tensor (a
    Qwen2 without its q/k/v biases) would otherwise build and load into a silently wrong model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(ckpt.path, trust_remote_code=False)
    except Exception as e:
        raise SourceError(f"{ckpt.path / 'config.json'}: transformers cannot read it ({type(e).__name__}: {str(e)[:200]})") from None
    config.__dict__.pop("quantization_config", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    fused_members = check_fused_in_model(ckpt, model, config.model_type)
    expert_layers = check_experts_in_model(ckpt, model, config.model_type)
    for name, (in_features, out_features, has_layer_bias) in ckpt.layer_sizes.items():
        if name in fused_members:
            continue
        if name in expert_layers:
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise SourceError(f"tensor {name}.qweight: the {config.model_type} model has no module {name}; the checkpoint "
                              "does not match its config.json") from None
        sizes = (getattr(module, "in_features", None), getattr(module, "out_features", None))
        if sizes != (in_features, out_features):
            raise SourceError(f"tensor {name}.qweight: {in_features}x{out_features}, the {config.model_type} model's "
                              f"{name} is {sizes[0]}x{sizes[1]}; the checkpoint does not match its config.json")
        has_bias = getattr(module, "bias", None) is not None
        if has_bias != has_layer_bias:
            problem = "missing, but the model's module has a bias" if has_bias else "present, but the model's module has no bias"
            raise SourceError(f"tensor {name}.bias: {problem}; re-export or re-quantize the checkpoint")


def check_fused_in_model(ckpt: GPTQCheckpoint, model, model_type: str) -> set[str]:
    """Layers stored apart that the model has as one Linear (runtime/fused.py IN_MODEL: Phi-3's and
    GLM-4's gate_up_proj), checked as that Linear: the same K, their N adding up to its, a bias where
    it has one, and one act-order (prepack concatenates them, exact only then). Returns those layers."""
    from quantprep.build.prepack import can_fuse, fusion_plan, model_fusion_problem

    members_checked: set[str] = set()
    for name, members in fusion_plan(list(ckpt.layer_sizes), fuse=False, model_type=model_type):
        if len(members) == 1:
            continue
        sizes = [ckpt.layer_sizes[m] for m in members]
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise SourceError(f"tensor {members[0]}.qweight: the {model_type} model has no module {name}; the checkpoint "
                              "does not match its config.json") from None
        want = (sizes[0][0], sum(n for _, n, _ in sizes), any(b for _, _, b in sizes))
        have = (getattr(module, "in_features", None), getattr(module, "out_features", None), getattr(module, "bias", None) is not None)
        if want != have:
            raise SourceError(f"tensors {', '.join(members)}: {want[0]}x{want[1]} together{' with a bias' * want[2]}, the {model_type} "
                              f"model's {name} is {have[0]}x{have[1]}{' with a bias' * have[2]}; the checkpoint does not match its config.json")
        if not can_fuse([ckpt.layers.check(m) for m in members]):  # g_idx, groups, K: qweight is not read
            raise SourceError(model_fusion_problem(model_type, name, members))
        members_checked.update(members)
    return members_checked


def float32_tensors(ckpt: GPTQCheckpoint) -> set[str]:
    """Float tensors of the checkpoint that the model's own code holds in float32 whatever dtype it is
    built in (DeepSeek's router weight and e_score_correction_bias, which choose the experts): the
    artifact stores them so, not in the activation dtype, as load's model expects them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt.path, trust_remote_code=False)
    config.__dict__.pop("quantization_config", None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, trust_remote_code=False)
    return {name for name, t in model.state_dict(keep_vars=True).items() if t.dtype == torch.float32} & set(ckpt.other_tensors.names)


def check_experts_in_model(ckpt: GPTQCheckpoint, model, model_type: str) -> set[str]:
    """Layers that are experts' projections (format/expert_names.py), checked against the model's experts
    module, whose 3-D tensors give every expert's sizes: each expert index is one of the module's,
    each projection of that size, none with a bias, and every expert has all of them (the runtime's
    experts module has no float ones to fall back on). Returns those layers."""
    from quantprep.runtime.experts import experts_layout, stacked_expert

    by_experts: dict[str, dict[tuple[int, str], str]] = {}
    for name in ckpt.layer_sizes:
        if (e := stacked_expert(model, name)) is not None and e.projection in EXPERT_PROJECTIONS:
            by_experts.setdefault(e.experts, {})[(e.index, e.projection)] = name
    for experts_name, layers in by_experts.items():
        first = next(iter(layers.values()))
        try:
            E, H, inter = experts_layout(model.get_submodule(experts_name))
        except AttributeError:
            raise SourceError(f"tensor {first}.qweight: the {model_type} model has no module {experts_name}; the checkpoint "
                              "does not match its config.json") from None
        except ValueError as e:
            raise SourceError(f"tensor {first}.qweight: {e}; quantprep cannot run these experts quantized") from None
        sizes = {"gate_proj": (H, inter), "up_proj": (H, inter), "down_proj": (inter, H)}
        for (index, projection), name in sorted(layers.items()):
            K, N, has_bias = ckpt.layer_sizes[name]
            if index >= E:
                raise SourceError(f"tensor {name}.qweight: expert {index}, but the {model_type} model's {experts_name} has {E} "
                                  "experts; the checkpoint does not match its config.json")
            if (K, N) != sizes[projection]:
                raise SourceError(f"tensor {name}.qweight: {K}x{N}, the {model_type} model's experts' {projection} is "
                                  f"{sizes[projection][0]}x{sizes[projection][1]}; the checkpoint does not match its config.json")
            if has_bias:
                raise SourceError(f"tensor {name}.bias: present, but the {model_type} model's experts have no bias; re-export or "
                                  "re-quantize the checkpoint")
        missing = [f"{experts_name}.{e}.{p}" for e in range(E) for p in EXPERT_PROJECTIONS if (e, p) not in layers]
        if missing:
            raise SourceError(f"tensor {missing[0]}.qweight: missing ({len(missing)} of the {len(EXPERT_PROJECTIONS) * E} expert "
                              f"projections of {experts_name}); every expert must be quantized: re-quantize the checkpoint")
    return {name for layers in by_experts.values() for name in layers.values()}


def is_gptq_dir(path: Path) -> bool:
    if (path / "quantize_config.json").is_file():
        return True
    cfg = path / "config.json"
    return cfg.is_file() and "quantization_config" in _read_json(cfg)


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """A hub id -> local snapshot dir, from the local cache first (works offline)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"):
        raise SourceError(f"{repo_id}: not in the local Hugging Face cache and offline mode is on; download it on a connected machine or pass --source PATH")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as e:
        raise SourceError(f"{repo_id}: not in the local Hugging Face cache and could not be downloaded ({type(e).__name__}); pass --source PATH to a local copy") from None
