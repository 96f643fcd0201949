"""GPTQ's on-disk integer packing, both directions, as vectorized tensor ops.

GPTQ packs `32 // bits` codes into each int32, lowest bits first:
  qweight int32 [K * bits / 32, N]  packs along K (rows),
  qzeros  int32 [G, N * bits / 32]  packs along N (columns).
"""

import sys

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
