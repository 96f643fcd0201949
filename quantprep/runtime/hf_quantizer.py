"""`AutoModelForCausalLM.from_pretrained(artifact_dir)`: quantprep as a transformers quantizer.

An artifact's config.json carries `quantization_config = {"quant_method": "quantprep", ...}`
(artifact.transformers_config). `import quantprep` registers this config class and quantizer with
transformers, so from_pretrained, `pipeline("text-generation", model=artifact_dir)` and any serving
code written against transformers load an artifact as `quantprep.load` does: the same checks and
refusals (torch_model.open_artifact: manifest, signature with QUANTPREP_VERIFY_KEY, compatibility key,
device, dtype), the same modules (torch_model.install_modules), every tensor checked against the model
before a byte is read (torch_model.check_tensors, from the safetensors headers), the kcache rules
unchanged (QUANTPREP_TRUST_KCACHE). transformers then reads the shards into the swapped modules.

The shards are listed in artifact.WEIGHTS_INDEX, a name transformers does not look for on its own:
without quantprep imported, transformers warns "Unknown quantization type, got quantprep" and then
fails finding no weights file, instead of random-initializing the Linears it could not match.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from quantprep._io.jsonfile import read_json_object
from quantprep.distribution.policy import check_signature, signature_policy
from quantprep.distribution.signing import configured_key
from quantprep.errors import ArtifactError, ArtifactMismatch
from quantprep.format.artifact import WEIGHTS_INDEX, torch_dtypes
from quantprep.runtime.checked import checked_artifact
from quantprep.runtime.kcache import Kcache
from quantprep.runtime.torch_model import (
    activate_kcache,
    check_tensors,
    finish,
    install_modules,
    loaded_dtype,
    open_artifact,
    tied_names,
    untie_quantized_head,
)
from quantprep.targets import TARGET_NAMES, get_target

METHOD = "quantprep"
# Options for the load of one artifact directory (load_options): how `quantprep serve` passes its
# --trust-kcache and --verify-key to transformers' load of the one artifact it serves, and to no other.
_LOAD_OPTIONS: dict[Path, dict] = {}


@contextlib.contextmanager
def load_options(path: Path, trust_kcache: bool = False, verify_key: str | None = None, signed: bool = False):
    """Within the block, from_pretrained of exactly `path` loads with these options (signed: its
    signature was verified already, by the pull that brought it)."""
    path = Path(os.path.abspath(path))
    _LOAD_OPTIONS[path] = {"trust_kcache": trust_kcache, "verify_key": verify_key, "signed": signed}
    try:
        yield
    finally:
        _LOAD_OPTIONS.pop(path, None)


class QuantprepConfig(QuantizationConfigMixin):
    """config.json's quantization_config of an artifact; the manifest stays the authority (checked
    against it at load). from_pretrained loads as `quantprep.load(dir)` with its defaults (kcache
    trust from QUANTPREP_TRUST_KCACHE, signature from QUANTPREP_VERIFY_KEY): transformers ignores a
    quantization_config passed to from_pretrained when the model has one, so options cannot ride on it."""

    def __init__(self, target: str | None = None, device: str | None = None, act_dtype: str | None = None,
                 lm_head_quantized: bool = False, **kwargs):
        self.quant_method = METHOD
        self.target, self.device, self.act_dtype, self.lm_head_quantized = target, device, act_dtype, lm_head_quantized
        self.extra = kwargs  # format_version, bits, group_size: informative


def _device_of(device_map, default: str | None) -> str | None:
    """One device for the whole model: quantprep artifacts are not split across devices."""
    if device_map is None or device_map == "auto":
        return default
    if isinstance(device_map, (str, torch.device, int)):
        return str(device_map) if not isinstance(device_map, int) else f"cuda:{device_map}"
    devices = {str(v) if not isinstance(v, int) else f"cuda:{v}" for v in device_map.values()}
    if len(devices) != 1:
        raise ArtifactMismatch(f"device_map={device_map}: a quantprep artifact loads onto one device; pass one device")
    return devices.pop()


def loaded_directory(name_or_path: str, checkpoint_files: list[str]) -> Path:
    """The directory whose config transformers loaded, which is the one verified: every weights file
    it is about to read must be in it. An index there naming `../other/model-...` or an absolute
    path (a folder with an edited config, pointing at a signed artifact's shards) is refused."""
    here = Path(os.path.abspath(name_or_path)) if os.path.isdir(name_or_path) else Path(os.path.abspath(checkpoint_files[0])).parent
    for f in checkpoint_files:  # abspath normalizes `..` without following links (a Hub snapshot's files are links)
        if Path(os.path.abspath(f)).parent != here:
            raise ArtifactError(f"{here / WEIGHTS_INDEX}: points transformers at {f}, outside {here}; refusing it: an artifact's "
                                "index names only its own shards")
    return here


class QuantprepQuantizer(HfQuantizer):
    requires_calibration = True  # loads prepacked artifacts only; quantizing is `quantprep build`

    def __init__(self, quantization_config: QuantprepConfig, **kwargs):
        name = quantization_config.target
        if name in TARGET_NAMES and get_target(name).kind != "torch":
            raise ArtifactMismatch(f"an {name} artifact holds an OpenVINO IR, not torch weights: load it with quantprep.load(DIR), "
                                   "which returns openvino.genai's pipeline (docs/openvino.md)")
        super().__init__(quantization_config, **kwargs)
        self.dtype: torch.dtype | None = None
        self.device_map = None

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        packed = getattr(torch, self.quantization_config.act_dtype or "bfloat16")
        self.dtype = packed if dtype in (None, "auto") else dtype
        return self.dtype

    def update_device_map(self, device_map):
        self.device_map = device_map
        return {"": _device_of(device_map, self.quantization_config.device) or "cpu"}

    def _prepare_config(self, config):
        """Point transformers at the artifact's shard index, and untie a quantized lm_head from the
        embedding: before the weights are looked up and the model is built."""
        config.transformers_weights = WEIGHTS_INDEX
        if self.quantization_config.lm_head_quantized:
            config.tie_word_embeddings = False
        return config

    # the hook that sees the config at that point: update_attn_implementation in transformers 5.2x,
    # update_tp_plan before (5.17 on the GPU machine); the other one is then never called
    update_attn_implementation = update_tp_plan = _prepare_config

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files:
            raise ArtifactError(f"{model.config.name_or_path}: no {WEIGHTS_INDEX}; not a quantprep artifact (rebuild it)")
        path = loaded_directory(model.config.name_or_path, checkpoint_files)
        q = self.quantization_config
        options = _LOAD_OPTIONS.get(path, {})
        key = configured_key(options.get("verify_key"))
        hub_signed = None
        if not os.path.isdir(model.config.name_or_path):  # a Hub id: the signature policy of hf://ID applies
            # (to the signature; the identity of a published reference is `quantprep pull`'s, whose layout
            # from_pretrained does not read); then no key is left for open_artifact to check again
            ref = f"hf://{model.config.name_or_path}"
            hub_signed, key = check_signature(path, *signature_policy(ref, key), ref), None
        device = _device_of(self.device_map, None)
        art = open_artifact(path, checked_artifact(path, "once", key), device, self.dtype)
        if (q.target, q.act_dtype) != (art.manifest["target"]["name"], art.manifest["target"]["act_dtype"]):
            raise ArtifactError(f"{path}/config.json: quantization_config says target {q.target} ({q.act_dtype}), the manifest "
                                f"{art.manifest['target']['name']} ({art.manifest['target']['act_dtype']}); the artifact is inconsistent: rebuild it")
        untie_quantized_head(model.config, art.manifest)
        install_modules(model, path, art)
        tensors, where, held = {}, {}, model.state_dict(keep_vars=True)
        for shard in art.manifest["shards"]:
            try:
                with safe_open(path / shard, "pt") as f:
                    for name in f.keys():
                        meta = f.get_slice(name)
                        dt = torch_dtypes().get(meta.get_dtype())
                        if dt is None:
                            raise ArtifactError(f"{path / shard}: tensor {name} has dtype {meta.get_dtype()}; the artifact is corrupt: rebuild it")
                        tensors[name] = (loaded_dtype(held.get(name), dt, self.dtype, art.packed_dtype), tuple(meta.get_shape()))
                        where[name] = shard
            except ArtifactError:
                raise
            except Exception as e:
                raise ArtifactError(f"{path / shard}: cannot read safetensors file ({e}); the artifact is corrupt: rebuild it") from None
        check_tensors(path, model, tensors, skip=tied_names(model))
        # transformers reads the shards this index names (config.transformers_weights, in the directory it
        # loaded): it must name exactly the manifest's shards' tensors, and every file it read is one of them
        index = read_json_object(path / WEIGHTS_INDEX, ArtifactError, "the artifact is corrupt: rebuild it")
        if outside := sorted({Path(f).name for f in checkpoint_files} - set(art.manifest["shards"])):
            raise ArtifactError(f"{path / WEIGHTS_INDEX}: names {outside[0]}, which is not a shard of the manifest; refusing it")
        if index.get("weight_map") != where:
            raise ArtifactError(f"{path / WEIGHTS_INDEX}: does not list the tensors of the manifest's shards; the artifact is "
                                "inconsistent: rebuild it")
        self.path, self.art = path, art
        signed = (key is not None if hub_signed is None else hub_signed) or options.get("signed", False)
        self.kcache_status = activate_kcache(path, art, Kcache(path, art.manifest, options.get("trust_kcache", False), signed), False)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return finish(model, self.path, self.art, self.kcache_status, compile=False, warmup=False)

    def is_serializable(self) -> bool:
        return False  # an artifact is written by `quantprep build`, not save_pretrained

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Make transformers route quant_method "quantprep" here (idempotent)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(QuantprepConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(QuantprepQuantizer)


register()
