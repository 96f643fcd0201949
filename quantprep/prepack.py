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


def prepack_checkpoint(ckpt: GPTQCheckpoint, target, act_dtype: torch.dtype, progress: bool = True
                       ) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict[str, torch.Tensor]]:
    """Returns (tensors for the artifact, per-module metadata for the manifest, verify probes)."""
    from .artifact import pause_point
    from .verify import make_probe, probe_layer_names

    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict] = {}
    probes: dict[str, torch.Tensor] = {}
    probe_names = probe_layer_names(list(ckpt.layers))
    for name, layer in tqdm(ckpt.layers.items(), desc=f"prepack {target.name}", unit="layer", disable=not progress):
        unpacked = unpack_layer(layer)
        if name in probe_names:
            probes.update(make_probe(unpacked))
            pause_point("prepack")
        packed, meta = target.pack(unpacked, act_dtype)
        for part, t in packed.items():
            tensors[f"{name}.{part}"] = t.contiguous()
        modules[name] = meta
    for key, t in ckpt.other_tensors.items():
        # Float weights are stored in the activation dtype so loading is a zero-copy mmap.
        tensors[key] = (t.to(act_dtype) if t.is_floating_point() else t).contiguous()
    return tensors, modules, probes
