"""A pure-torch emulator of `aten._weight_int4pack_mm_with_scales_and_zeros` (the XPU int4 kernel).

No Arc GPU is reachable from here, so this is the only XPU evidence we can produce: the xpu
target's artifacts are run through it on CPU and compared with the dense reference. It follows:

- pytorch `aten/src/ATen/native/native_functions.yaml`:
  `_weight_int4pack_mm_with_scales_and_zeros(Tensor self, Tensor mat2, int qGroupSize,
  Tensor qScale, Tensor qZeros) -> Tensor`, dispatched to `_weight_int4pack_mm_xpu` only.
- pytorch `aten/src/ATen/native/mkldnn/xpu/Blas.cpp`, `_weight_int4pack_mm_xpu` (5 arguments):
  A is bf16/fp16/fp32 by its checks, 2-D, contiguous; but `detail/WoQMatmul.cpp` has an int4
  primitive for f16 and bf16 only, and fp32 asserts there, so the emulator refuses fp32 as the
  device would (docs/xpu.md); B is int32 2-D [N, K/8]; qZeros is int8 (kChar);
  qGroupSize > 1 and a multiple of 32; qScale and qZeros are 2-D with size(1) == N; the output
  is empty({M, N}) in A's dtype.
- pytorch `aten/src/ATen/native/mkldnn/xpu/detail/WoQMatmul.cpp`, `woq_matmul_int4`: B is
  viewed as u4 {k, n} with format_tag::ba (k contiguous, "4bit pack into s32"), so element
  (n, k) is nibble k % 8 (bits 4*(k%8)) of word [n][k // 8], lowest first: GPTQ's
  `qweight.T.contiguous()`. Scales and zero points use mask (1<<0)+(1<<1) with groups
  {group_size, 1} over [K/group_size, N] contiguous memory; zero points are s8. oneDNN applies
  the zero point before the scale: w = (q - zero) * scale.
- Not checked by the op but needed by oneDNN's group shape: K divisible by qGroupSize. The
  emulator checks it, so an artifact that passes here does not rely on unchecked behaviour.
- Scales in A's dtype: the primitive's cache key omits the scale dtype, so scales of another
  dtype could meet a primitive created for A's; the emulator refuses them.

Precision: oneDNN computes half-precision inputs in f16/bf16 (fpmath mode); the emulator
accumulates in float32 and rounds the output to A's dtype, so it may be slightly more accurate
than the device: tolerances in tests are those of the activation dtype. `dequantize_nk` is the
emulator's internal float path (the weight the kernel would see, in float32): exactness checks of
the layout use it instead of the op.
"""

from __future__ import annotations

import torch

ACT_DTYPES = (torch.float16, torch.bfloat16)  # oneDNN's int4 primitives (WoQMatmul.cpp)


def unpack_int4_nk(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> int32 codes [N, K], element k at bits 4*(k%8) of word k//8."""
    shifts = torch.arange(8, dtype=torch.int32, device=qweight.device) * 4
    return ((qweight.unsqueeze(-1) >> shifts) & 0xF).reshape(qweight.shape[0], -1)


def dequantize_nk(qweight: torch.Tensor, group_size: int, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The weight the kernel computes with, float32 [N, K]: (q - zero) * scale per group."""
    q = unpack_int4_nk(qweight)
    g = torch.arange(q.shape[1], device=q.device) // group_size
    return (q - zeros.T[:, g].to(torch.int32)).float() * scales.T[:, g].float()


def weight_int4pack_mm_with_scales_and_zeros(x: torch.Tensor, qweight: torch.Tensor, group_size: int,
                                             scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Same signature and semantics as the XPU op: returns x @ W.T with W[n, k] =
    (q[n, k] - zeros[k // group_size, n]) * scales[k // group_size, n], in x's dtype."""
    if x.dim() != 2 or not x.is_contiguous():
        raise RuntimeError(f"_weight_int4pack_mm_xpu: A must be a contiguous 2-D tensor, got {x.dtype} {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:  # Blas.cpp lets fp32 through; oneDNN's cached path then asserts
        raise RuntimeError(f"_weight_int4pack_mm_xpu: oneDNN has no int4 matmul for {x.dtype} activations (f16 and bf16 only)")
    if scales.dtype != x.dtype:
        raise RuntimeError(f"_weight_int4pack_mm_xpu: qScale must be in A's dtype {x.dtype}, got {scales.dtype}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise RuntimeError(f"_weight_int4pack_mm_xpu: B must be int32 2-D, got {qweight.dtype} {tuple(qweight.shape)}")
    if zeros.dtype != torch.int8:
        raise RuntimeError(f"_weight_int4pack_mm_xpu: qZeros must be int8 (kChar), got {zeros.dtype}")
    if not (group_size > 1 and group_size % 32 == 0):
        raise RuntimeError(f"_weight_int4pack_mm_xpu: qGroupSize must be > 1 and a multiple of 32, got {group_size}")
    N, K = qweight.shape[0], x.shape[1]
    if qweight.shape[1] * 8 != K or K % group_size:
        raise RuntimeError(f"_weight_int4pack_mm_xpu: K={K} must equal 8 * B.size(1) = {qweight.shape[1] * 8} and be divisible by qGroupSize={group_size}")
    for name, t in (("qScale", scales), ("qZeros", zeros)):
        if t.dim() != 2 or t.shape != (K // group_size, N) or not t.is_contiguous():
            raise RuntimeError(f"_weight_int4pack_mm_xpu: {name} must be contiguous [{K // group_size}, {N}], got {tuple(t.shape)}")
    return (x.float() @ dequantize_nk(qweight, group_size, scales, zeros).T).to(x.dtype)
