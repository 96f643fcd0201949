"""GPTQ's on-disk integer packing, both directions, as vectorized tensor ops.

GPTQ packs `32 // bits` codes into each int32, lowest bits first:
  qweight int32 [K * bits / 32, N]  packs along K (rows),
  qzeros  int32 [G, N * bits / 32]  packs along N (columns).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property

import torch

SUPPORTED_BITS = (4, 8)


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(32 // bits, dtype=torch.int32) * bits


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> uint8 codes [R * 32/bits, C].

    Works on the int32's little-endian bytes: byte b of a word holds codes 2b (low nibble) and
    2b+1 (high) at 4 bits, code b at 8 bits. uint8 throughout: 4x less memory traffic than int32.
    """
    assert sys.byteorder == "little"
    R, C = packed.shape
    b = packed.contiguous().view(torch.uint8).reshape(R, C, 4).permute(0, 2, 1)  # [R, 4, C] view
    if bits == 8:
        return b.reshape(R * 4, C)
    out = torch.empty(R, 4, 2, C, dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(b, 0xF, out=out[:, :, 0])
    torch.bitwise_right_shift(b, 4, out=out[:, :, 1])
    return out.view(R * 8, C)


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> uint8 codes [R, C * 32/bits]."""
    vals = (packed.unsqueeze(-1) >> _shifts(bits)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], -1).to(torch.uint8)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    # Wrap an unsigned 32-bit value held in int64 to int32 two's complement.
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [K, N] in [0, 2**bits) -> int32 [K * bits/32, N]."""
    per = 32 // bits
    k, n = codes.shape
    v = codes.to(torch.int64).reshape(k // per, per, n) << _shifts(bits).to(torch.int64).view(1, per, 1)
    return _to_int32(v.sum(1))


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [G, N] in [0, 2**bits) -> int32 [G, N * bits/32]."""
    per = 32 // bits
    g, n = codes.shape
    v = codes.to(torch.int64).reshape(g, n // per, per) << _shifts(bits).to(torch.int64)
    return _to_int32(v.sum(-1))


def v1_zero_offset(bits: int) -> int:
    """What GPTQModel adds to each packed qzeros int32 to turn v1 (zero-1) into v2 (zero).

    It is a plain int32 add (carries cross nibbles), the exact inverse of the subtraction
    GPTQModel does when it saves v1; reproducing it keeps us bit-identical to GPTQModel,
    including for asymmetric zeros of 0.
    """
    return sum(1 << s for s in range(0, 32, bits))


def v1_to_v2_qzeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    return _to_int32((qzeros.to(torch.int64) + v1_zero_offset(bits)) % 2**32)


def v2_to_v1_qzeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    return _to_int32((qzeros.to(torch.int64) - v1_zero_offset(bits)) % 2**32)


@dataclass
class PrepackLayer:
    """A GPTQ layer (or a fused group of them) ready for a target to pack: `qweight` still GPTQ's
    packed int32 words with K in the checkpoint's order, zeros unpacked, and `perm` the act-order
    permutation. `codes` (unpacked at first use) are in act-order: row k belongs to group k // group_size."""

    name: str
    bits: int
    group_size: int
    in_features: int  # K
    out_features: int  # N
    qweight: torch.Tensor  # int32 [K * bits/32, N] as GPTQ packs it, K in the ORIGINAL order (fused: members side by side)
    zeros: torch.Tensor  # uint8 [G, N], v2 (w = (code - zero) * scale)
    scales: torch.Tensor  # [G, N] as stored
    perm: torch.Tensor | None  # int64 [K]: permuted input k reads original input perm[k]; None = identity
    bias: torch.Tensor | None

    @cached_property
    def codes(self) -> torch.Tensor:
        """uint8 [K, N], permuted K: unpacked at first use (a target with a fused packer never asks)."""
        return self.unpack_codes()

    def unpack_codes(self, block: int = 1 << 24) -> torch.Tensor:
        """The codes, unpacked and put in act-order about `block` codes at a time, straight into the
        result: whole, the temporaries of a Qwen2.5-32B gate/up took 680 MB beside its 283 MB of codes."""
        K, N = self.in_features, self.out_features
        codes, cols = torch.empty(K, N, dtype=torch.uint8), max(1, block // K)
        for c0 in range(0, N, cols):
            part = unpack_rows(self.qweight[:, c0:c0 + cols], self.bits)
            codes[:, c0:c0 + part.shape[1]] = part if self.perm is None else part.index_select(0, self.perm)
        return codes

    def dequantize(self) -> torch.Tensor:
        """Dense float32 weight [K, N] in the ORIGINAL input order: the reference every kernel is checked against."""
        w = self.dequantize_rows(0, self.in_features)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm, w)
        return w

    def dequantize_rows(self, k0: int, k1: int) -> torch.Tensor:
        """Float32 rows k0:k1 of the weight in the permuted (act-order) input order: (code - zero) * scale."""
        group = torch.arange(k0, k1) // self.group_size
        return self.codes[k0:k1].float().sub_(self.zeros[group]).mul_(self.scales[group])

    def reference_matmul(self, x: torch.Tensor, block: int = 1 << 23) -> torch.Tensor:
        """x [M, K] float32 @ dequantize(), about `block` weights at a time: the whole float32
        weight and its temporaries took 2.2 GB for a Qwen2.5-32B down_proj. x @ W = x[:, perm] @ W_perm."""
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        y, rows = x.new_zeros(x.shape[0], self.out_features), max(1, block // self.out_features)
        for k0 in range(0, self.in_features, rows):
            y.addmm_(x[:, k0:k0 + rows], self.dequantize_rows(k0, min(k0 + rows, self.in_features)))
        return y
