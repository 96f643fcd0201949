"""Stage 2, prepack: everything GPTQModel does at load or first forward, done once, offline.

Unpack zeros and scales, find the act-order permutation (a stable argsort of `g_idx`, so every
group becomes contiguous), then hand the layer to the target, which converts it to its kernel's
layout: from the unpacked codes (K permuted), or straight from GPTQ's packed int32 where a target
has a fused packer (the cpu target). The only Python loop is over layers.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from quantprep._io.staging import stage_reached
from quantprep.build.lm_head import QUANTIZED_BY, head_weight_key, round_head
from quantprep.build.source import GPTQCheckpoint, GPTQLayer, float32_tensors
from quantprep.errors import SourceError
from quantprep.format.expert_names import expert_linear
from quantprep.format.gptq import PrepackLayer, unpack_cols
from quantprep.runtime.fused import IN_MODEL, in_model


def act_order_perm(g_idx: torch.Tensor) -> torch.Tensor | None:
    """Stable argsort of g_idx; None when it is the identity (no act-order, nothing to gather)."""
    perm = torch.argsort(g_idx, stable=True)
    if torch.equal(perm, torch.arange(g_idx.numel())):
        return None
    return perm


def prepare_layer(layer: GPTQLayer) -> PrepackLayer:
    return prepare_layers(layer.name, [layer])


def prepare_layers(name: str, layers: list[GPTQLayer]) -> PrepackLayer:
    """One layer, or layers that read the same input concatenated along N (fused: one matmul, one
    gather; exact when `can_fuse`). The codes stay packed until a target asks for them."""
    if len(layers) > 1 and not can_fuse(layers):
        raise ValueError(f"{name}: layers {[x.name for x in layers]} cannot be fused")
    first = layers[0]
    K, N = first.in_features, sum(x.out_features for x in layers)
    perm = act_order_perm(first.g_idx)
    qweight = torch.cat([x.qweight for x in layers], 1) if len(layers) > 1 else first.qweight
    zeros = torch.cat([unpack_cols(x.qzeros, x.bits)[:, : x.out_features] for x in layers], 1)
    scales = torch.cat([x.scales.to(first.scales.dtype) for x in layers], 1)
    bias = None
    if any(x.bias is not None for x in layers):
        dtype = next(x.bias.dtype for x in layers if x.bias is not None)
        bias = torch.cat([x.bias.to(dtype) if x.bias is not None else torch.zeros(x.out_features, dtype=dtype) for x in layers])
    return PrepackLayer(name, first.bits, first.group_size, K, N, qweight, zeros, scales, perm, bias)


def can_fuse(layers: list[GPTQLayer]) -> bool:
    """Same bits, group size, K and g_idx: then every K row has the same group in all of them."""
    a = layers[0]
    return all((x.bits, x.group_size, x.in_features) == (a.bits, a.group_size, a.in_features)
               and torch.equal(x.g_idx, a.g_idx) for x in layers)


PROBE_ROWS = 4
# Every expert is probed (calibration may have routed it no token: gptqmodel then rounds it to
# nearest, and no logits test reaches an expert no text chooses), with one row: probes.safetensors
# then holds (K + N) float32 per expert module: 157 MB for Qwen3-30B-A3B's 6144 experts, 1% of its weights.
EXPERT_PROBE_ROWS = 1


def probe_layer_names(names: list[str]) -> set[str]:
    """The first, middle and last module, and every expert's modules."""
    names = sorted(names)
    return {names[0], names[len(names) // 2], names[-1]} | {n for n in names if expert_linear(n)}


def make_probe(layer: PrepackLayer, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fresh random input and the dense float32 reference output for one layer."""
    rows = EXPERT_PROBE_ROWS if expert_linear(layer.name) else PROBE_ROWS
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(seed))
    y = layer.reference_matmul(x)
    if layer.bias is not None:
        y = y + layer.bias.float()
    return {f"{layer.name}.x": x, f"{layer.name}.y": y}


# Layers that read the same input, fused into one prepacked matmul when exact (`can_fuse`): one
# call instead of several is faster for q/k/v and gate/up on the GPU and no slower on the CPU
# (benchmarks/experiments/README.md, "Fusion of q/k/v and gate/up").
FUSIONS = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}


def fusion_plan(names: list[str], fuse: bool = True, model_type: str | None = None) -> list[tuple[str, list[str]]]:
    """[(module name, [source layer names])]: a fused entry lists its members in output order.
    Members of a Linear the model itself has fused (runtime/fused.py IN_MODEL, by `model_type`) are
    planned as that Linear, in the model's order, whatever `fuse` says: the model has no others."""
    present, groups = set(names), {}
    own = {members: child for child, members in IN_MODEL.get(model_type or "", {}).items()}
    fusions = {**{m: c for m, c in FUSIONS.items() if fuse and c not in own.values()}, **own}
    for name in names:
        parent, _, child = name.rpartition(".")
        for members, fused_child in fusions.items():
            full = [f"{parent}.{c}" for c in members]
            if child == members[0] and all(m in present for m in full):
                groups.update({m: (f"{parent}.{fused_child}", full) for m in full})
    plan, seen = [], set()
    for name in names:
        entry = groups.get(name, (name, [name]))
        if entry[0] not in seen:
            seen.add(entry[0])
            plan.append(entry)
    return plan


def model_fusion_problem(model_type: str | None, name: str, members: list[str]) -> str:
    return (f"tensors {', '.join(members)}: the {model_type} model has them as one Linear, {name}, but their act-order "
            "(g_idx), groups or input sizes differ, so they cannot be concatenated exactly; re-quantize the model "
            "(gptqmodel gives them one g_idx: they read the same input)")


def prepack_stream(ckpt: GPTQCheckpoint, packers: list[tuple[object, torch.dtype]], emit, progress: bool = True,
                   fuse: bool = True, lm_head: str = "float") -> tuple[list[dict[str, dict]], dict[str, torch.Tensor]]:
    """Prepack every layer for each (target, act dtype) in `packers` in one pass over the source:
    each layer is read (ckpt.layers reads it from disk), its codes unpacked at most once (when a
    target or the verify probe asks), packed per target and handed to `emit(i, tensors)` for
    packer i, then dropped, so memory holds one layer, not the model. lm_head "int8" or "int4": the
    float lm_head rounded and packed as one more layer (build/lm_head.py). Returns (per-module
    manifest metadata per packer, verify probes)."""
    modules: list[dict[str, dict]] = [{} for _ in packers]
    probes: dict[str, torch.Tensor] = {}
    plan = fusion_plan(list(ckpt.layers), fuse, ckpt.model_config.get("model_type"))
    probe_names = probe_layer_names([name for name, _ in plan])
    head_key = head_weight_key(ckpt) if lm_head != "float" else None  # a head it cannot round fails before any work
    names = ", ".join(t.name for t, _ in packers)
    for name, members in tqdm(plan, desc=f"prepack {names}", unit="layer", disable=not progress):
        layers, fused = [ckpt.layers[m] for m in members], None
        if len(layers) > 1 and can_fuse(layers):
            fused = {"members": [m.rpartition(".")[2] for m in members], "sizes": [x.out_features for x in layers]}
            layers = [prepare_layers(name, layers)]  # the packed sources go once unpacked
        elif len(layers) > 1 and in_model(ckpt.model_config.get("model_type"), name.rpartition(".")[2]):
            raise SourceError(model_fusion_problem(ckpt.model_config.get("model_type"), name, members))
        # else not fusable here (different act-order or groups): the layers stay separate
        for j, layer in enumerate(layers):
            unpacked = layer if fused else prepare_layer(layer)
            if name in probe_names and (j == 0 or expert_linear(name)):  # an expert's unfused gate and up: both
                probes.update(make_probe(unpacked))
                stage_reached("prepack")
            for i, (target, act_dtype) in enumerate(packers):
                packed, meta = target.pack(unpacked, act_dtype)
                if fused:
                    meta["fused"] = fused
                emit(i, {f"{unpacked.name}.{part}": t.contiguous() for part, t in packed.items()})
                modules[i][unpacked.name] = meta
            del unpacked, layer  # one unpacked layer in memory at a time, also across iterations
        del layers
    skip = set()
    if lm_head != "float":
        skip = {"lm_head.weight"} & {head_key}  # an untied head is replaced; a tied one is the embedding, still needed
        head = round_head(ckpt.other_tensors[head_key], lm_head)
        for i, (target, act_dtype) in enumerate(packers):
            packed, meta = target.pack(head, act_dtype)
            emit(i, {f"lm_head.{part}": t.contiguous() for part, t in packed.items()})
            modules[i]["lm_head"] = dict(meta, quantized_by=QUANTIZED_BY[lm_head])
        del head
    float32 = float32_tensors(ckpt)
    for key in ckpt.other_tensors:
        if key in skip:
            continue
        # Float weights are stored in the activation dtype so loading is a zero-copy mmap (those the model
        # keeps in float32: so); large ones are read and converted block by block as their shard is written (StoredRows).
        dtypes = [torch.float32 if key in float32 else act_dtype for _, act_dtype in packers]
        for i, t in enumerate(ckpt.other_tensors.read_converted(key, dtypes)):
            emit(i, {key: t})
    return modules, probes

