"""Stage 2, prepack: everything GPTQModel does at load or first forward, done once, offline.

Unpack the integer codes, apply act-order (permute K by a stable argsort of `g_idx` so every
group becomes contiguous), then hand the layer to the target, which converts it to its kernel's
layout. All tensor ops are vectorized; the only loop is over layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from .gptq_format import unpack_cols, unpack_rows
from .source import GPTQCheckpoint, GPTQLayer


@dataclass
class UnpackedLayer:
    """A GPTQ layer in plain form, K already in act-order: row k belongs to group k // group_size."""

    name: str
    bits: int
    group_size: int
    in_features: int  # K
    out_features: int  # N
    codes: torch.Tensor  # uint8 [K, N], permuted K
    zeros: torch.Tensor  # uint8 [G, N], v2 (w = (code - zero) * scale)
    scales: torch.Tensor  # [G, N] as stored
    perm: torch.Tensor | None  # int64 [K]: permuted input k reads original input perm[k]; None = identity
    bias: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """Dense float32 weight [K, N] in the ORIGINAL input order: the reference every kernel is checked against."""
        gs = self.group_size
        s = self.scales.float().repeat_interleave(gs, 0)[: self.in_features]
        z = self.zeros.float().repeat_interleave(gs, 0)[: self.in_features]
        w = (self.codes.float() - z) * s
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm, w)
        return w


def act_order_perm(g_idx: torch.Tensor) -> torch.Tensor | None:
    """Stable argsort of g_idx; None when it is the identity (no act-order, nothing to gather)."""
    perm = torch.argsort(g_idx, stable=True)
    if torch.equal(perm, torch.arange(g_idx.numel())):
        return None
    return perm


def unpack_layer(layer: GPTQLayer) -> UnpackedLayer:
    codes = unpack_rows(layer.qweight, layer.bits)
    zeros = unpack_cols(layer.qzeros, layer.bits)[:, : layer.out_features]
    perm = act_order_perm(layer.g_idx)
    if perm is not None:
        codes = codes.index_select(0, perm)
    return UnpackedLayer(layer.name, layer.bits, layer.group_size, layer.in_features, layer.out_features,
                         codes, zeros, layer.scales, perm, layer.bias)


def fuse_layers(name: str, layers: list[UnpackedLayer]) -> UnpackedLayer:
    """Concatenate layers that read the same input along N: one matmul, one gather. Exact only
    when they share bits, group size and act-order permutation (then every K row has the same
    group in all of them); the caller checks `can_fuse` first."""
    if not can_fuse(layers):
        raise ValueError(f"{name}: layers {[x.name for x in layers]} cannot be fused")
    first = layers[0]
    bias = None
    if any(x.bias is not None for x in layers):
        dtype = next(x.bias.dtype for x in layers if x.bias is not None)
        bias = torch.cat([x.bias.to(dtype) if x.bias is not None else torch.zeros(x.out_features, dtype=dtype) for x in layers])
    return UnpackedLayer(name, first.bits, first.group_size, first.in_features, sum(x.out_features for x in layers),
                         torch.cat([x.codes for x in layers], 1), torch.cat([x.zeros for x in layers], 1),
                         torch.cat([x.scales.to(first.scales.dtype) for x in layers], 1), first.perm, bias)


def can_fuse(layers: list[UnpackedLayer]) -> bool:
    a = layers[0]
    same_perm = all((x.perm is None) == (a.perm is None) and (x.perm is None or torch.equal(x.perm, a.perm)) for x in layers)
    return same_perm and all((x.bits, x.group_size, x.in_features) == (a.bits, a.group_size, a.in_features) for x in layers)


PROBE_ROWS = 4


def probe_layer_names(names: list[str]) -> set[str]:
    names = sorted(names)
    return {names[0], names[len(names) // 2], names[-1]}


def make_probe(layer: UnpackedLayer, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fresh random input and the dense float32 reference output for one layer."""
    x = torch.randn(PROBE_ROWS, layer.in_features, generator=torch.Generator().manual_seed(seed))
    y = x @ layer.dequantize()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return {f"{layer.name}.x": x, f"{layer.name}.y": y}


# Layers that read the same input, fused into one prepacked matmul when exact (`can_fuse`):
# measured on Qwen2.5-1.5B shapes at M = 1-512, one call instead of several takes 1.47-2.31x less
# time for q/k/v and 0.95-1.61x for gate/up on an H200, 0.99-1.24x and 0.99-1.04x on the CPU
# (BENCHMARKS.md; fusion-cuda-h200.json, fusion-cpu.json).
FUSIONS = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}


def fusion_plan(names: list[str], fuse: bool = True) -> list[tuple[str, list[str]]]:
    """[(module name, [source layer names])]: a fused entry lists its members in output order."""
    present, groups = set(names), {}
    for name in names if fuse else []:
        parent, _, child = name.rpartition(".")
        for members, fused_child in FUSIONS.items():
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


def prepack_stream(ckpt: GPTQCheckpoint, packers: list[tuple[object, torch.dtype]], emit, progress: bool = True,
                   fuse: bool = True) -> tuple[list[dict[str, dict]], dict[str, torch.Tensor]]:
    """Prepack every layer for each (target, act dtype) in `packers` in one pass over the source:
    each layer is read (ckpt.layers reads it from disk), unpacked once, packed per target and
    handed to `emit(i, tensors)` for packer i, then dropped, so memory holds one layer, not the
    model. Returns (per-module manifest metadata per packer, verify probes)."""
    from .artifact import pause_point

    modules: list[dict[str, dict]] = [{} for _ in packers]
    probes: dict[str, torch.Tensor] = {}
    plan = fusion_plan(list(ckpt.layers), fuse)
    probe_names = probe_layer_names([name for name, _ in plan])
    names = ", ".join(t.name for t, _ in packers)
    for name, members in tqdm(plan, desc=f"prepack {names}", unit="layer", disable=not progress):
        layers = [unpack_layer(ckpt.layers[m]) for m in members]
        if len(layers) > 1 and can_fuse(layers):
            emit_layers = [(fuse_layers(name, layers), {"members": [m.rpartition(".")[2] for m in members],
                                                        "sizes": [x.out_features for x in layers]})]
        else:  # not fusable here (different act-order or groups): keep the layers separate
            emit_layers = [(x, None) for x in layers]
        for j, (unpacked, fused) in enumerate(emit_layers):
            if name in probe_names and j == 0:
                probes.update(make_probe(unpacked))
                pause_point("prepack")
            for i, (target, act_dtype) in enumerate(packers):
                packed, meta = target.pack(unpacked, act_dtype)
                if fused:
                    meta["fused"] = fused
                emit(i, {f"{unpacked.name}.{part}": t.contiguous() for part, t in packed.items()})
                modules[i][unpacked.name] = meta
    for key in ckpt.other_tensors:
        # Float weights are stored in the activation dtype so loading is a zero-copy mmap; large ones
        # are read and converted block by block as their shard is written (StoredRows).
        for i, t in enumerate(ckpt.other_tensors.read_converted(key, [act_dtype for _, act_dtype in packers])):
            emit(i, {key: t})
    return modules, probes

