"""An artifact whose modules run in torch -> a transformers model ready to `generate`, in five steps
(load_model): open (device, dtype, kcache), skeleton, modules, tensors, finish.

No repacking and no random init happen here: the model skeleton is built with its parameters on
the meta device, quantized Linears are swapped for the target's modules, and every tensor is
assigned straight from the (mmapped) safetensors files. This module never imports gptqmodel.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from quantprep.errors import ArtifactError, ArtifactMismatch
from quantprep.format.artifact import DEFAULT_SHAPES
from quantprep.runtime import cpu_attention, cpu_layers, plan
from quantprep.runtime.aot import compile_regions, prefetch_runtime
from quantprep.runtime.aot import install as install_packages
from quantprep.runtime.checked import check_compat, rebuild_command
from quantprep.runtime.experts import check_experts_installed, install_experts
from quantprep.runtime.fused import in_model
from quantprep.runtime.fused import install as install_fused
from quantprep.runtime.kcache import MEGACACHE, PLAN, Kcache, activate, scoped_env
from quantprep.targets import Target, act_dtype_problem, device_target

DECODE_STEPS = 2


@contextlib.contextmanager
def params_on_meta():
    """Create nn.Parameters on the meta device (no memory, init is a no-op); buffers stay real.

    Buffers computed in __init__ (rotary `inv_freq`) are not in the checkpoint, so they must be
    built for real, which `with torch.device("meta")` would not do.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def make_module(path: Path, target, name: str, meta: dict, dtype: torch.dtype) -> nn.Module:
    """The target's module for one manifest entry, once its target-specific metadata is checked (the
    boundary: ArtifactError is raised here, never made of the module's own exceptions)."""
    if problem := target.meta_problem(meta):
        raise ArtifactError(f"{path}: module {name} has malformed {target.name} metadata ({problem}); rebuild the artifact")
    return target.make_module(meta, dtype)


def _check_replaces(path: Path, config, name: str, in_features: int, out_features: int, model) -> bool:
    """The model's module that `name` replaces has these sizes; returns whether it has a bias."""
    try:
        old = model.get_submodule(name)
    except AttributeError:
        raise ArtifactError(f"{path}: module {name} in manifest.json does not exist in the {config.model_type} model") from None
    if (getattr(old, "in_features", None), getattr(old, "out_features", None)) != (in_features, out_features):
        raise ArtifactError(f"{path}: module {name} is {in_features}x{out_features} in the manifest but "
                            f"{getattr(old, 'in_features', '?')}x{getattr(old, 'out_features', '?')} in config.json; the artifact is inconsistent: rebuild it")
    return getattr(old, "bias", None) is not None


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r} in manifest.json; the artifact is corrupt: rebuild it")
    return dt


def usable_shapes(model, shapes: list[int]) -> list[int]:
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    return [s for s in shapes if s + DECODE_STEPS <= limit]


def run_shapes(model, shapes: list[int], each=None) -> list[dict]:
    """Prefill each length with batch 1, then DECODE_STEPS decode steps (M=1). Token ids are
    random: only the shapes matter for kernels. each(length): called after each one (warm's bar)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    timings = []
    for length in shapes:
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen).to(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS,
                           min_new_tokens=DECODE_STEPS, do_sample=False, pad_token_id=0)
        device_target(device.type).synchronize()
        timings.append({"prefill": length, "decode_steps": DECODE_STEPS, "s": round(time.perf_counter() - t0, 3)})
        if each:
            each(length)
    return timings


def compile_model(model, manifest: dict, status: dict, dtype: torch.dtype) -> None:
    """load(compile=True): the kcache's compiled MLP packages where they fit (aot.py; no dynamo),
    torch.compile for the rest, with the mega-cache restored first. Updates `status`."""
    root = Path(status["dir"]) if status.get("status") == "used" else None
    status["aot"] = install_packages(model, root, manifest["kcache"].get("aot", []), dtype) if root else 0
    status["compiled_regions"] = compile_regions(model)
    if root and status["compiled_regions"] and (root / MEGACACHE).is_file():  # before their first call
        info = torch.compiler.load_cache_artifacts((root / MEGACACHE).read_bytes())
        status["loaded"] = {kind: len(items) for kind, items in info.artifacts.items()} if info else {}


@dataclass(frozen=True)
class OpenedArtifact:
    """An artifact directory after every check (open_artifact), carried down the load."""

    path: Path
    manifest: dict
    target: Target
    device: torch.device  # where its modules run (cpu for an emulated xpu/cuda artifact)
    dtype: torch.dtype  # the activation dtype asked for
    packed_dtype: torch.dtype  # the one its float tensors are stored in
    emulate: bool  # running another device's artifact through that target's CPU path


def open_artifact(path: Path, checked: tuple[dict, Target], device: str | torch.device | None,
                  dtype: torch.dtype | None) -> OpenedArtifact:
    """A checked artifact (`checked`: checked.checked_artifact's result, every check before a byte of
    weights is read) on this machine: its compatibility key, the device and dtype. Returns what the
    later steps need (OpenedArtifact), read and checked once."""
    manifest, target = checked
    if target.kind != "torch":
        raise ArtifactMismatch(f"{path}: an {target.name} artifact runs in OpenVINO: load it with quantprep.load, "
                               "`quantprep generate` or `quantprep serve`")
    emulate = device is not None and torch.device(device).type == "cpu" and target.device != "cpu"
    check_compat(path, manifest, target, emulate)
    device = torch.device(device or target.device)
    if device.type != target.device and not emulate:
        raise ArtifactMismatch(f"{path}: packed for {target.device} kernels, cannot run on {device.type}; "
                               f"build one for it: {rebuild_command(manifest, device.type)}")
    packed_dtype = _dtype(manifest["target"]["act_dtype"])
    if problem := act_dtype_problem(target, packed_dtype):
        raise ArtifactError(f"{path}: packed for {packed_dtype} activations, but {problem}; rebuild the artifact "
                            f"with --act-dtype {str(target.default_act_dtype).removeprefix('torch.')}")
    dtype = dtype or packed_dtype
    if problem := act_dtype_problem(target, dtype):
        raise ArtifactMismatch(f"{path}: dtype={dtype}: {problem}; pass one of those or leave dtype out")
    if not emulate and (note := target.load_warning()):
        warnings.warn(f"{path}: {note}", stacklevel=3)
    if not emulate:  # before the device starts
        os.environ.update(target.run_env(manifest, dict(os.environ)))
    return OpenedArtifact(path, manifest, target, device, dtype, packed_dtype, emulate)


def activate_kcache(path: Path, art: OpenedArtifact, kcache: Kcache | None, compile: bool) -> dict:
    """kcache.activate for this device (None: not to be used), then the target's warning on its driver's caches."""
    status = activate(kcache, art.device.type, compile) if kcache is not None else {"status": "off"}
    if not art.emulate and (msg := art.target.cache_warning(dict(os.environ))):
        warnings.warn(f"{path}: {msg}", stacklevel=3)
    return status


def untie_quantized_head(config, manifest: dict) -> None:
    """A quantized lm_head cannot share the embedding's weight."""
    if config.tie_word_embeddings and "lm_head" in manifest["modules"]:
        config.tie_word_embeddings = False


def install_modules(model, path: Path, art: OpenedArtifact) -> None:
    """Swap the model's Linears for the target's modules the manifest lists (sizes and biases checked);
    a layer's experts, first, for a QuantizedExperts whose slots this fills (runtime/experts.py)."""
    config, target, dtype = model.config, art.target, art.dtype
    install_experts(model, path, art.manifest["modules"])
    for name, meta in art.manifest["modules"].items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fused = meta.get("fused")
        if fused and fused_in_model(path, config, name, fused, meta["out_features"]):
            fused = None  # the model's own fused Linear: the prepacked module replaces it whole, no members to serve
        members, sizes = (fused["members"], fused["sizes"]) if fused else ([child], [meta["out_features"]])
        biases = [_check_replaces(path, config, f"{parent_name}.{member}" if parent_name else member, meta["in_features"], size, model)
                  for member, size in zip(members, sizes, strict=True)]
        if meta["bias"] != any(biases):  # a fused bias holds zeros for members without one
            raise ArtifactError(f"{path}: tensor {name}.bias: {'present' if meta['bias'] else 'missing'} in the artifact, but the "
                                f"{config.model_type} model's module has {'a bias' if any(biases) else 'none'}; rebuild the artifact")
        if fused and sum(sizes) != meta["out_features"]:
            raise ArtifactError(f"{path}: fused module {name}: sizes {sizes} do not add up to {meta['out_features']}; rebuild the artifact")
        module = make_module(path, target, name, meta, dtype)
        if fused:
            install_fused(parent, child, module, members, sizes)
        else:
            setattr(parent, child, module)
    check_experts_installed(model, path)


def fused_in_model(path: Path, config, name: str, fused: dict, out_features: int) -> bool:
    """Whether the fused module `name` is one the model itself has (runtime/fused.py IN_MODEL), its
    members then in the model's order and their sizes adding up (else the artifact is refused)."""
    own = in_model(config.model_type, name.rpartition(".")[2])
    if own is None:
        return False
    if list(fused["members"]) != list(own) or sum(fused["sizes"]) != out_features:
        raise ArtifactError(f"{path}: fused module {name}: members {fused['members']} of sizes {fused['sizes']}, but the "
                            f"{config.model_type} model's {name} is {list(own)} adding up to {out_features}; rebuild the artifact")
    return True


def loaded_dtype(held: torch.Tensor | None, stored: torch.dtype, dtype: torch.dtype, packed: torch.dtype) -> torch.dtype:
    """The dtype a stored tensor loads in: a float one in the activation dtype asked for, where that is
    not the artifact's, unless the model's code holds it in float32 (`held`: the model's tensor;
    DeepSeek's router, which the build stored so: build/source.py float32_tensors)."""
    if not stored.is_floating_point or dtype == packed:
        return stored
    return torch.float32 if held is not None and held.dtype == torch.float32 else dtype


def check_tensors(path: Path, model, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], skip: set[str] = frozenset(),
                  prefix: str = "") -> None:
    """Every artifact tensor is one of the model's, with its dtype and shape; every model tensor is in
    the artifact (`skip`: names the model ties to another). `tensors`: name -> (dtype, shape), as
    the model will receive them; `prefix`: where `model` sits in the artifact (one module: verify)."""
    expected = model.state_dict(keep_vars=True)  # meta tensors: the dtype and shape each name must have
    for name, (dt, shape) in tensors.items():
        want = expected.get(name)
        if want is None:
            raise ArtifactError(f"{path}: tensor {prefix}{name} is not part of the model; the artifact is inconsistent: rebuild it")
        if want.dtype != dt or tuple(want.shape) != tuple(shape):
            raise ArtifactError(f"{path}: tensor {prefix}{name} is {dt} {tuple(shape)}, the model needs {want.dtype} {tuple(want.shape)}; "
                                "the artifact is corrupt: rebuild it")
    for name in expected:
        if name not in tensors and name not in skip:
            raise ArtifactError(f"{path}: tensor {prefix}{name} is missing from the artifact; rebuild it")


def check_modules(path: Path, model) -> None:
    """Each packed module's own checks of the tensors it was given (PackedLinear.check_loaded)."""
    from quantprep.targets.packed import PackedLinear

    for name, m in model.named_modules():
        if isinstance(m, PackedLinear) and (problem := m.check_loaded()):
            raise ArtifactError(f"{path}: tensor {name}.{problem}; the artifact is corrupt: rebuild it")


def tied_names(model) -> set[str]:
    """Names the model ties to another tensor (the lm_head of tied embeddings): not stored."""
    shared = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return shared | set(getattr(model, "all_tied_weights_keys", None) or {})


def apply_plan(model, path: Path, art: OpenedArtifact, kcache_status: dict) -> None:
    """The kcache's kernel plan (runtime/plan.py), when the kcache is used and has one; a plan that
    is damaged or timed on another machine is ignored with a warning (the fixed rules run)."""
    if not kcache_status.get("plan_dir") or PLAN not in art.manifest["kcache"]["files"]:
        return
    try:
        kcache_status["plan"] = plan.apply(model, plan.read(Path(kcache_status["plan_dir"]), art.manifest["kcache"]), art.device.type)
    except ArtifactError as e:
        kcache_status["plan"] = f"ignored: {e}"
        warnings.warn(f"{path}: kernel plan not used: {e}", stacklevel=3)


def report_c(model, path: Path) -> None:
    """A CPU model's `quantprep_c`: how many modules run quantprep's C here, by kind (cpu_layers.c_modules).
    One warning when quantprep has C for some of them and none runs it: its libraries did not build or
    load (targets/c_library.py), so torch's slower ops run; not when QUANTPREP_NATIVE=0 asked for that."""
    from quantprep.targets import c_library

    model.quantprep_c = counts = cpu_layers.c_modules(model)
    if not any(counts.values()) and not c_library.turned_off() and cpu_layers.expects_c(model):
        warnings.warn(f"{path}: none of this model's modules run quantprep's C kernels, which did not build or load here "
                      f"({c_library.unavailable_reason()}); torch's slower ops run instead", stacklevel=4)


def finish(model, path: Path, art: OpenedArtifact, kcache_status: dict, compile: bool, warmup: bool, prefetch=None):
    """After the weights are in: generation config, compile, the warmed buckets, warm-up, status."""
    from transformers import GenerationConfig

    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    if art.device.type == "cpu":  # decode attention: quantprep's C kernel where it is faster than torch's SDPA
        model.quantprep_attention = cpu_attention.NAME if cpu_attention.use(model) else model.config._attn_implementation
        cpu_layers.use(model)  # RMSNorm, the MLP and decode attention in fewer, C, steps
    manifest = art.manifest
    check_modules(path, model)
    apply_plan(model, path, art, kcache_status)  # before compile: compiled regions trace the planned paths
    if art.device.type == "cpu":
        report_c(model, path)  # after the plan: it decides which linears' paths are C
    # the prefill lengths warm ran: quantprep.tools.serving pads prompts to them
    model.quantprep_buckets = usable_shapes(model, manifest.get("kcache", manifest.get("serving", {})).get("shapes", DEFAULT_SHAPES))
    # A used kcache's cache directories are set while this model compiles and runs (its forward,
    # wrapped), not for the process: another model or a child process never writes into this
    # artifact's copy, and a compile the first request triggers still finds what warm shipped.
    env = kcache_status.get("env", {})
    if env:
        forward = model.forward

        @functools.wraps(forward)
        def forward_in_kcache_env(*args, **kwargs):
            with scoped_env(env):
                return forward(*args, **kwargs)

        model.forward = forward_in_kcache_env
    with scoped_env(env):
        if compile:
            if prefetch:
                prefetch.join()
            compile_model(model, manifest, kcache_status, art.dtype)
    if warmup:  # in the thread that will serve: PyTorch's oneDNN primitive cache on xpu is per thread
        model.quantprep_warmup = run_shapes(model, model.quantprep_buckets)
    model.quantprep_kcache = kcache_status
    model.quantprep_path = path  # the directory that was checked: read its tokenizer from here (not a reference's name)
    return model


def load_model(path: Path, checked: tuple[dict, Target], kcache: Kcache | None, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, compile: bool = False, warmup: bool = False):
    """A checked torch artifact (`checked`: checked.checked_artifact's result; `kcache`: its kcache as
    load opened it, None: not to be used) -> the transformers model, in eval mode (quantprep.load
    says what each option does)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # 2-4 s of imports an openvino artifact does without

    # 1. open: this machine's device and dtype for the artifact, and its kcache's verdict
    art = open_artifact(path, checked, device, dtype)
    manifest, device, dtype = art.manifest, art.device, art.dtype
    kcache_status = activate_kcache(path, art, kcache, compile)
    # 2. skeleton: transformers' model from config.json, parameters on the meta device
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the modules are swapped here, not by a transformers quantizer
    untie_quantized_head(config, manifest)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    # 3. modules: the target's packed modules in place of the quantized Linears
    install_modules(model, path, art)
    # Inductor's import overlaps the weight copies below; after from_config, which did this load's own imports
    prefetch = prefetch_runtime(manifest["kcache"].get("aot", [])) if compile and kcache_status.get("status") == "used" else None
    # 4. tensors: every one assigned from the safetensors files, each checked against the model's
    load_tensors(model, path, art)
    # 5. finish: generation config, kernel plan, compile, warm-up
    return finish(model, path, art, kcache_status, compile, warmup, prefetch)


def load_tensors(model, path: Path, art: OpenedArtifact) -> None:
    """Assign the shards' tensors (in the dtype asked for) to the model, each one's name, dtype and
    shape checked first; every model tensor must have come from the artifact."""
    state: dict[str, torch.Tensor] = {}
    for shard in art.manifest["shards"]:
        try:
            state.update(load_file(path / shard, device=str(art.device)))
        except Exception as e:
            raise ArtifactError(f"{path / shard}: cannot read safetensors file ({e}); the artifact is corrupt: rebuild it") from None
    if art.dtype != art.packed_dtype:
        held = model.state_dict(keep_vars=True)
        state = {k: v.to(loaded_dtype(held.get(k), v.dtype, art.dtype, art.packed_dtype)) for k, v in state.items()}
    check_tensors(path, model, {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}, skip=tied_names(model))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":
            raise ArtifactError(f"{path}: tensor {name} is missing from the artifact; rebuild it")
    if art.device.type != "cpu":
        model.to(art.device)  # moves the buffers built in __init__ (rotary); loaded tensors are already there
