"""RMSNorm and the gated MLP's SiLU product on the CPU: quantprep's C in place of transformers' tensor ops.

transformers' RMSNorm is seven tensor ops (float32 copy, square, mean, rsqrt, two products, the cast
back) and the MLP's act_fn(gate) * up two more, each a dispatch and a pass over memory. At decode
(one row) the dispatches cost more than the arithmetic: together about a tenth of a token's time on
the 1.5B (BENCHMARKS.md, "CPU decode attention"). Here each is one C call with the same arithmetic
and the same roundings: RMSNorm sums the squares in float32, rounds the normalized row to the
activation dtype, then multiplies by the weight and rounds again; the MLP rounds SiLU(gate) before
the product.

`use(model)` replaces the RMSNorm and MLP modules of a bfloat16 CPU model (load does it) with
CpuRMSNorm and CpuGatedMLP: the same parameters under the same names, whose forward runs the C
kernel where it computes the same (`runs_here`: eager bfloat16 CPU rows, no autograd) and the
replaced class's own forward everywhere else (torch.compile, export, other dtypes).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from quantprep.targets import native
from quantprep.targets.cpu import BF16_C, eager

SOURCE = BF16_C + r"""
#include <math.h>
/* y[r] = bf16(w * bf16(x[r] / sqrt(mean(x[r]^2) + eps))) for rows of n bfloat16 values; row strides in elements. */
void rms_norm(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy, int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        float part[16] = {0};  /* 16 partial sums: the compiler vectorizes them */
        int64_t d = 0;
        for (; d + 16 <= n; d += 16)
            for (int j = 0; j < 16; j++) { float v = from_bf16(xr[d + j]); part[j] += v * v; }
        for (; d < n; d++) { float v = from_bf16(xr[d]); part[0] += v * v; }
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += part[j];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        uint16_t *yr = y + r * ldy;
        for (d = 0; d < n; d++) yr[d] = to_bf16(from_bf16(w[d]) * from_bf16(to_bf16(from_bf16(xr[d]) * inv)));
    }
}
/* y[r, j] = bf16(bf16(silu(gu[r, j])) * gu[r, n + j]) for j < n: the gate and up halves of one fused row. */
void silu_mul(const uint16_t *gu, int64_t ldg, uint16_t *y, int64_t ldy, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * ldg, *u = g + n;
        uint16_t *yr = y + r * ldy;
        for (int64_t j = 0; j < n; j++) {
            float a = from_bf16(g[j]);
            yr[j] = to_bf16(from_bf16(to_bf16(a / (1.0f + expf(-a)))) * from_bf16(u[j]));
        }
    }
}
"""


@functools.cache
def library() -> ctypes.CDLL | None:
    """SOURCE compiled (native.py, with torch's OpenMP where it can), or None without a C compiler."""
    lib = native.library_with_torch_openmp(SOURCE)
    if lib is None:
        return None
    lib.rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_float]
    lib.rms_norm.restype = None
    lib.silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.silu_mul.restype = None
    return lib


def runs_here(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether C may compute on x (and a layer's weight): eager, contiguous, bfloat16, on the CPU, not
    empty, no autograd. Checked in the order of what is cheapest to rule out: these run per layer
    and token."""
    if x.dtype is not torch.bfloat16 or not x.is_contiguous() or x.device.type != "cpu" or not eager(x) or x.numel() == 0:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    return weight is None or (type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype is torch.bfloat16 and
                              weight.device.type == "cpu" and weight.dim() == 1 and weight.is_contiguous() and
                              weight.shape[0] == x.shape[-1])


class CpuRMSNorm(nn.Module):
    """transformers' RMSNorm (`weight * normalize(x)`, `variance_epsilon`) with its forward in C."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon, self.replaced = norm.weight, norm.variance_epsilon, type(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib, w = library(), self.weight
        if lib is None or not runs_here(x, w):
            return self.replaced.forward(self, x)
        y, n = torch.empty_like(x), x.shape[-1]
        lib.rms_norm(x.data_ptr(), n, w.data_ptr(), y.data_ptr(), n, x.numel() // n, n, self.variance_epsilon)
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, in C (replaces {self.replaced.__name__})"


class CpuGatedMLP(nn.Module):
    """transformers' gated MLP, down(silu(gate(x)) * up(x)), whose gate and up quantprep fused into
    gate_up_proj (runtime/fused.py): one fused matmul, the SiLU product in C, down_proj."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        for name, child in mlp.named_children():
            self.add_module(name, child)
        self.replaced = type(mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = library()
        if lib is None or not runs_here(x):
            return self.replaced.forward(self, x)
        gu = self.gate_up_proj(x)
        if not runs_here(gu):
            return self.replaced.forward(self, x)
        n = gu.shape[-1] // 2
        y = gu.new_empty(*gu.shape[:-1], n)
        lib.silu_mul(gu.data_ptr(), 2 * n, y.data_ptr(), n, gu.numel() // (2 * n), n)
        return self.down_proj(y)


def same_forward(module: nn.Module, reference: type) -> bool:
    """Whether module's class has reference's forward, instruction for instruction (transformers
    copies Llama's into each family that shares it: "Copied from")."""
    a, b = type(module).forward.__code__, reference.forward.__code__
    return (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts)


def is_rms_norm(module: nn.Module) -> bool:
    """transformers' Llama-style RMSNorm: Llama, Qwen2, Mistral and the families that copy it (one
    weight, variance_epsilon, normalize then scale); Gemma's (1 + weight) and others are left alone."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return same_forward(module, LlamaRMSNorm) and set(module._parameters) == {"weight"} and hasattr(module, "variance_epsilon")


def is_fused_silu_mlp(module: nn.Module) -> bool:
    """A Llama-style MLP (down(act(gate(x)) * up(x))) with act SiLU and gate/up fused into equal parts."""
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP

    fused = getattr(module, "gate_up_proj", None)
    return same_forward(module, LlamaMLP) and type(getattr(module, "act_fn", None)) in (nn.SiLU, SiLUActivation) and \
        len(getattr(fused, "parts", ())) == 2 and fused.parts[0] == fused.parts[1]


def use(model: nn.Module) -> int:
    """Replace the RMSNorm and fused SiLU MLP modules of a bfloat16 CPU model; how many were replaced
    (0: another dtype or no C compiler)."""
    if model.dtype != torch.bfloat16 or library() is None:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = CpuRMSNorm(child) if is_rms_norm(child) else CpuGatedMLP(child) if is_fused_silu_mlp(child) else None
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced
