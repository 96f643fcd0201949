"""RMSNorm, the gated MLP, decode attention and the float lm_head on the CPU: quantprep's C in place of torch's ops.

At decode (one row) a token's time beside its matmuls is mostly dispatch: transformers' RMSNorm is
seven tensor ops, the MLP's act_fn(gate) * up two more, and the attention's views, rotary embedding
(ten ops) and member projections a dozen (BENCHMARKS.md, "CPU decode attention"). Here each is one C
call with the same arithmetic and the same roundings as transformers': RMSNorm sums the squares in
float32, rounds the normalized row, then multiplies by the weight and rounds again; the MLP rounds
SiLU(gate) before the product; the rotary embedding rounds each product and their sum. The float
lm_head a GPTQ checkpoint keeps is the largest read of a token, and torch's bfloat16 matrix-vector
product reads it at a fraction of the memory speed; gemv_bf16 (AVX512-BF16 or AVX2) sums exact products in
float32 as torch does.

`use(model)` (load calls it) swaps the classes of the RMSNorm, MLP, attention, decoder layer and
bias-free bfloat16 Linear modules of a bfloat16 CPU model for subclasses of them and of CpuRMSNorm,
CpuGatedMLP, CpuDecodeAttention, CpuDecoderLayer and CpuLinear: each module keeps its parameters,
submodules, hooks and tied weights, isinstance checks still hold, and its forward runs C where it
computes the same (`runs_here`: eager bfloat16 CPU rows, no autograd; attention: one token of a
"quantprep_cpu" model, no mask or sliding window; no hooks on fused members) and the replaced
class's own forward everywhere else (torch.compile, export, other dtypes, prefill's attention, a
Linear's several rows where torch has a bfloat16 GEMM kernel). Where a decode token's four
projections run int4_a8, a decoder layer is one C call (decode_layer) that makes its modules' C
calls in turn, without the Python between them (BENCHMARKS.md, "CPU decode layers").
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from quantprep.runtime import cpu_attention
from quantprep.runtime.fused import FusedMember
from quantprep.targets import native
from quantprep.targets.common import SLOW_HALF_GEMM
from quantprep.targets.cpu import BF16_C, CpuInt4Linear, eager, native_int4_a8

SOURCE = BF16_C + f"#define MAX_D {cpu_attention.MAX_HEAD_DIM}\n" + r"""
#include <math.h>
#include <stdlib.h>
#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
/* y[n] = bf16(sum_k x[k] w[n, k]) for one bfloat16 row x of K % 32 == 0 and w [N, K] row-major: products
   exact in float32 (a bfloat16 product has 16 significant bits), sums in float32, as torch's bfloat16
   linear; four rows of w at a time. AVX512-BF16's dot products, or with AVX2 each 16 values widened to
   float32 in two halves (the even ones shifted up, the odd ones masked) and fused multiply-adds. 0, or -2:
   built with neither. */
int gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k));
        }
        for (int r = 0; r < rows; r++) y[n0 + r] = to_bf16(_mm512_reduce_add_ps(acc[r]));
    }
    return 0;
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000);
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
        __m256 even_acc[4], odd_acc[4];
        for (int r = 0; r < 4; r++) even_acc[r] = odd_acc[r] = _mm256_setzero_ps();
        int rows = N - n0 < 4 ? (int)(N - n0) : 4;
        for (int64_t k = 0; k < K; k += 16) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + k));
            __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)), xo = _mm256_castsi256_ps(_mm256_and_si256(xv, odd));
            for (int r = 0; r < rows; r++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (n0 + r) * K + k));
                even_acc[r] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), even_acc[r]);
                odd_acc[r] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(wv, odd)), odd_acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            __m256 s = _mm256_add_ps(even_acc[r], odd_acc[r]);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            y[n0 + r] = to_bf16(_mm_cvtss_f32(h));
        }
    }
    return 0;
#else
    (void)x, (void)w, (void)y, (void)N, (void)K;
    return -2;
#endif
}
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
/* The query and key heads at the start of each fused q/k/v row, rotated in place as transformers'
   apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, each product and the sum rounded to bfloat16. */
void rotary(uint16_t *qkv, int64_t ld, int64_t rows, int64_t heads, int64_t D, const uint16_t *cos, const uint16_t *sin) {
    int64_t half = D / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *x = qkv + r * ld + h * D;
            float t[MAX_D];
            for (int64_t d = 0; d < D; d++) t[d] = from_bf16(x[d]);
            for (int64_t d = 0; d < D; d++) {
                float rotated = d < half ? -t[d + half] : t[d - half];
                float a = from_bf16(to_bf16(t[d] * from_bf16(cos[r * D + d]))), b = from_bf16(to_bf16(rotated * from_bf16(sin[r * D + d])));
                x[d] = to_bf16(a + b);
            }
        }
}
/* e^x to float32's precision (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2]), in
   plain float operations so that the loops calling it vectorize (libm's expf is a call per value). */
static inline float exp_poly(float in) {
    float x = in < -86.5f ? -86.5f : in > 88.72f ? 88.72f : in;  /* not fminf/fmaxf, floorf: those do not vectorize */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 126) << 23;  /* 2^(n - 1), times 2 below: n reaches 128 near the top */
    float scale;
    memcpy(&scale, &bits, 4);
    return in > 88.72f ? INFINITY : 2.0f * p * scale;  /* past float's range: infinity, as expf (so silu(-big) is -0) */
}
/* y[r, j] = bf16(bf16(silu(gu[r, j])) * gu[r, n + j]) for j < n: the gate and up halves of one fused row. */
void silu_mul(const uint16_t *gu, int64_t ldg, uint16_t *y, int64_t ldy, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *restrict g = gu + r * ldg, *restrict u = gu + r * ldg + n;
        uint16_t *restrict yr = y + r * ldy;
        for (int64_t j = 0; j < n; j++) {
            float a = from_bf16(g[j]);
            yr[j] = to_bf16(from_bf16(to_bf16(a / (1.0f + exp_poly(-a)))) * from_bf16(u[j]));
        }
    }
}
/* One decode token through a Llama/Qwen2 decoder layer whose four projections run int4_a8 (targets/cpu.py)
   and whose attention runs decode_attention (cpu_attention.py), both called through the pointers in L:
   the same calls, in the same order and with the same roundings, as the modules' own C forwards, with no
   Python between them (BENCHMARKS.md, "CPU decode layers"). x and out: one row of `hidden`; cos, sin: the
   row's rotary embedding; the new key and value go into row `filled` of each head of k_cache, v_cache
   ([kv_heads, capacity, D]), and attention reads rows 0..filled. 0, -1 (no memory) or a kernel's error. */
typedef int (*int4_a8_fn)(const uint16_t *, int64_t, int64_t, const int32_t *, int64_t, const uint8_t *, const uint32_t *,
                          int64_t, int64_t, int64_t, int64_t, uint16_t *, int64_t, int);
typedef int (*attention_fn)(const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t, int64_t, int64_t,
                            const uint16_t *, int64_t, int64_t, int64_t, uint16_t *, int64_t, int64_t, int64_t, int64_t,
                            int64_t, float);
typedef struct {
    const int32_t *perm; const uint8_t *qweight; const uint32_t *scales_and_zeros; const uint16_t *bias;
    int64_t in, padded_in, out, group, block;
} QuantLinear;
typedef struct {
    int4_a8_fn int4_a8; attention_fn attention;
    const uint16_t *norm1, *norm2;
    float eps1, eps2, scaling;
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    QuantLinear qkv, o, gate_up, down;
} DecodeLayer;

static int quant_linear(const DecodeLayer *L, const QuantLinear *p, const uint16_t *x, uint16_t *y, int threads) {
    int status = L->int4_a8(x, 1, p->in, p->perm, p->in, p->qweight, p->scales_and_zeros, p->padded_in, p->out, p->group,
                            p->block, y, p->out, threads);
    if (status == 0 && p->bias)  /* as the module's y + bias: rounded once */
        for (int64_t n = 0; n < p->out; n++) y[n] = to_bf16(from_bf16(y[n]) + from_bf16(p->bias[n]));
    return status;
}

static void add_to(const uint16_t *residual, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = to_bf16(from_bf16(residual[i]) + from_bf16(y[i]));
}

int decode_layer(const DecodeLayer *L, const uint16_t *x, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
                 uint16_t *k_cache, uint16_t *v_cache, int64_t capacity, int64_t filled, int threads) {
    int64_t n = L->hidden, D = L->head_dim, I = L->intermediate, q_size = L->heads * D, kv_size = L->kv_heads * D;
    int64_t qkv_size = q_size + 2 * kv_size;
    uint16_t *buffer = malloc((size_t)(3 * n + qkv_size + q_size + 3 * I) * sizeof(uint16_t));
    if (!buffer) return -1;
    uint16_t *xn = buffer, *qkv = xn + n, *attn = qkv + qkv_size, *h = attn + q_size, *hn = h + n, *gu = hn + n, *act = gu + 2 * I;
    int status;
    rms_norm(x, n, L->norm1, xn, n, 1, n, L->eps1);
    if ((status = quant_linear(L, &L->qkv, xn, qkv, threads))) goto done;
    rotary(qkv, qkv_size, 1, (q_size + kv_size) / D, D, cos, sin);
    for (int64_t g = 0; g < L->kv_heads; g++) {
        memcpy(k_cache + (g * capacity + filled) * D, qkv + q_size + g * D, D * sizeof(uint16_t));
        memcpy(v_cache + (g * capacity + filled) * D, qkv + q_size + kv_size + g * D, D * sizeof(uint16_t));
    }
    if ((status = L->attention(qkv, qkv_size, D, k_cache, kv_size * capacity, capacity * D, D, v_cache, kv_size * capacity,
                               capacity * D, D, attn, 1, L->heads, L->kv_heads, filled + 1, D, L->scaling))) goto done;
    if ((status = quant_linear(L, &L->o, attn, h, threads))) goto done;
    add_to(x, h, n);
    rms_norm(h, n, L->norm2, hn, n, 1, n, L->eps2);
    if ((status = quant_linear(L, &L->gate_up, hn, gu, threads))) goto done;
    silu_mul(gu, 2 * I, act, I, 1, I);
    if ((status = quant_linear(L, &L->down, act, out, threads))) goto done;
    add_to(h, out, n);
done:
    free(buffer);
    return status;
}
"""


@functools.cache
def library() -> ctypes.CDLL | None:
    """SOURCE compiled (native.py, with torch's OpenMP where it can), or None without a C compiler."""
    # No code here reads floating-point exception flags, and without trapping math gcc vectorizes
    # exp_poly's selects with AVX2 too (with AVX512 it used masks; on AVX2 silu_mul stayed scalar,
    # 3x torch's time: BENCHMARKS.md, "CPU decode layers"). The results are the same.
    lib = native.library_with_torch_openmp(SOURCE, ("-fno-trapping-math",))
    if lib is None:
        return None
    lib.rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_float]
    lib.rms_norm.restype = None
    lib.silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.silu_mul.restype = None
    lib.rotary.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
    lib.rotary.restype = None
    lib.gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    lib.gemv_bf16.restype = ctypes.c_int
    lib.decode_layer.argtypes = [ctypes.POINTER(DecodeLayerArgs)] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.decode_layer.restype = ctypes.c_int
    return lib


class QuantLinearArgs(ctypes.Structure):
    """SOURCE's QuantLinear: one projection's int4_a8 arguments."""
    _fields_ = [("perm", ctypes.c_void_p), ("qweight", ctypes.c_void_p), ("scales_and_zeros", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)] + [(f, ctypes.c_int64) for f in ("in_features", "padded_in", "out", "group", "block")]


class DecodeLayerArgs(ctypes.Structure):
    """SOURCE's DecodeLayer."""
    _fields_ = [("int4_a8", ctypes.c_void_p), ("attention", ctypes.c_void_p), ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scaling", ctypes.c_float)] + \
        [(f, ctypes.c_int64) for f in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + \
        [(f, QuantLinearArgs) for f in ("qkv", "o", "gate_up", "down")]


def runs_here(x: torch.Tensor, weight: torch.Tensor | None = None, weight_shape: tuple[int, ...] | None = None) -> bool:
    """Whether C may compute on x (and a layer's weight, of weight_shape: default x's last dimension):
    eager, contiguous, bfloat16, on the CPU, not empty, no autograd. Checked in the order of what is
    cheapest to rule out: these run per layer and token."""
    if x.dtype is not torch.bfloat16 or not x.is_contiguous() or x.device.type != "cpu" or not eager(x) or x.numel() == 0:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    return weight is None or (type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype is torch.bfloat16 and
                              weight.device.type == "cpu" and weight.is_contiguous() and
                              weight.shape == (weight_shape or x.shape[-1:]))


class Replacement(nn.Module):
    """A transformers module whose class `replace` swapped for `replacement_class(base, its class)`: a
    subclass of both, so its parameters, submodules, attributes and hooks stay where they were and
    isinstance checks on the replaced class still hold (transformers records attentions by class).
    `replaced` is that class; its forward runs wherever C does not. Pickles and copies through
    `rebuild` (the combined class is made at run time)."""

    replaced: type

    def __reduce_ex__(self, protocol):
        return rebuild, (type(self).__bases__[0], self.replaced, self.__getstate__())


@functools.cache
def replacement_class(base: type, replaced: type) -> type:
    return type(f"Cpu{replaced.__name__}", (base, replaced), {"replaced": replaced, "__module__": __name__})


def rebuild(base: type, replaced: type, state: dict) -> nn.Module:
    module = object.__new__(replacement_class(base, replaced))
    module.__setstate__(state)
    return module


def fused_as_built(parent: nn.Module, fused: str, members: tuple[str, ...]) -> bool:
    """Whether `parent`'s fused projection and its members are the ones load installed (runtime/fused.py),
    with no forward hooks on them or on every module: a hook, or a member put in its place, must
    see the member calls transformers' forward makes."""
    mods = parent._modules
    group = [mods.get(fused)] + [mods.get(m) for m in members]
    return (not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
            and all(type(m) is FusedMember and m.group.fused is group[0] for m in group[1:])
            and not any(m._forward_hooks or m._forward_pre_hooks for m in group))


class CpuRMSNorm(Replacement):
    """transformers' RMSNorm (`weight * normalize(x)`, `variance_epsilon`) with its forward in C."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not runs_here(x, w) or (lib := library()) is None:  # runs_here first: traced code never calls into ctypes
            return self.replaced.forward(self, x)
        y, n = torch.empty_like(x), x.shape[-1]
        lib.rms_norm(x.data_ptr(), n, w.data_ptr(), y.data_ptr(), n, x.numel() // n, n, self.variance_epsilon)
        return y


class CpuGatedMLP(Replacement):
    """transformers' gated MLP, down(silu(gate(x)) * up(x)), whose gate and up quantprep fused into
    gate_up_proj (runtime/fused.py): one fused matmul, the SiLU product in C, down_proj."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_here(x) or not fused_as_built(self, "gate_up_proj", ("gate_proj", "up_proj")) or (lib := library()) is None:
            return self.replaced.forward(self, x)
        gu = self.gate_up_proj(x)
        if not runs_here(gu):
            return self.replaced.forward(self, x)
        n = gu.shape[-1] // 2
        y = gu.new_empty(*gu.shape[:-1], n)
        lib.silu_mul(gu.data_ptr(), 2 * n, y.data_ptr(), n, gu.numel() // (2 * n), n)
        return self.down_proj(y)


class CpuDecodeAttention(Replacement):
    """transformers' Llama/Qwen2 attention, whose q/k/v quantprep fused into qkv_proj, with one decode
    token in fewer steps: the fused matmul, the rotary embedding in C in place on its output, the
    cache's own update, the decode kernel (cpu_attention), o_proj. What is not one token of a
    "quantprep_cpu" model without a mask or a sliding window takes the replaced class's forward."""

    def decodes_as_built(self) -> bool:
        """This module's own conditions for the decode steps (its inputs': decodes_here): not training,
        no sliding window, the "quantprep_cpu" attention, q/k/v fused as load built them."""
        return not self.training and getattr(self, "sliding_window", None) is None and \
            self.config._attn_implementation == cpu_attention.NAME and fused_as_built(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def decodes_here(self, x: torch.Tensor, position_embeddings, attention_mask, cache, kwargs: dict) -> bool:
        if attention_mask is not None or cache is None or position_embeddings is None or x.dim() != 3 or x.shape[1] != 1 or \
                kwargs.get("output_attentions") or not runs_here(x) or not self.decodes_as_built():
            return False
        cos, sin = position_embeddings
        return all(runs_here(t) and t.shape == (x.shape[0], 1, self.head_dim) for t in (cos, sin))

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)  # its name before transformers 5.40
        if not self.decodes_here(hidden_states, position_embeddings, attention_mask, cache, kwargs) or (lib := library()) is None:
            return self.replaced.forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        B, D = hidden_states.shape[0], self.head_dim
        q_size, kv_size = self.qkv_proj.parts[0], self.qkv_proj.parts[1]
        qkv = self.qkv_proj(hidden_states).contiguous()  # [B, 1, q + 2 kv]
        cos, sin = position_embeddings
        lib.rotary(qkv.data_ptr(), qkv.shape[-1], B, (q_size + kv_size) // D, D, cos.data_ptr(), sin.data_ptr())
        q = qkv[..., :q_size].view(B, 1, -1, D).transpose(1, 2)
        k = qkv[..., q_size:q_size + kv_size].view(B, 1, -1, D).transpose(1, 2)
        v = qkv[..., q_size + kv_size:].view(B, 1, -1, D).transpose(1, 2)
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        out, _ = cpu_attention.attention(self, q, k, v, None, scaling=self.scaling)
        return self.o_proj(out.reshape(B, 1, q_size)), None


def quant_linear_args(linear: nn.Module) -> QuantLinearArgs | None:
    """int4_a8's arguments for a projection that runs it at one row (its plan's choice at M = 1) and
    writes its outputs unpadded, with a bfloat16 bias if any; else None."""
    if type(linear) is not CpuInt4Linear or linear.path_for(1) != "int4_a8" or linear.padded_out != linear.out_features or \
            linear._forward_hooks or linear._forward_pre_hooks:
        return None
    bias = linear.bias
    if bias is not None and not runs_here(bias, bias, (linear.out_features,)):
        return None
    perm, qweight, sz, K, N, group = linear.int4_a8_weight()
    return QuantLinearArgs(perm, qweight, sz, None if bias is None else bias.data_ptr(), linear.in_features, K, N, group,
                           linear.pack_block_n)


ATTENTION_MEMBERS, MLP_MEMBERS = ("qkv_proj", "o_proj", "q_proj", "k_proj", "v_proj"), ("gate_up_proj", "down_proj", "gate_proj", "up_proj")


class CpuDecoderLayer(Replacement):
    """transformers' Llama/Qwen2 decoder layer. At one decode token of a layer whose norms, attention and
    MLP are this file's and whose four projections run int4_a8 at one row (a plan's choice, after
    `warm --int8-activations`), the whole layer is one C call (decode_layer): the calls those modules'
    forwards make, in their order, without Python between them. Everything else (prefill, batches,
    autograd, hooks on a member, another cache or kernel) takes the replaced forward, which calls the modules."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)  # its name before transformers 5.40
        decode = self.decode_args(hidden_states, attention_mask, cache, position_embeddings, kwargs)
        if decode is not None:
            args, layer = decode
            room = layer.room((1, args.kv_heads, 1, args.head_dim), torch.bfloat16, hidden_states.device)
            if room is not None and room[0].is_contiguous() and room[1].is_contiguous():  # C writes row n of each head
                keys, values, n = room
                out = torch.empty_like(hidden_states)
                cos, sin = position_embeddings
                status = library().decode_layer(ctypes.byref(args), hidden_states.data_ptr(), out.data_ptr(), cos.data_ptr(),
                                                sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2], n,
                                                torch.get_num_threads())
                if status == -1:
                    raise MemoryError("decode_layer could not allocate its buffers")
                if status:
                    raise ValueError(f"decode_layer's kernels refused this layer ({status})")
                layer.written(keys, values, n + 1)
                return out
        return self.replaced.forward(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings,
                                     **kwargs)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_decode_layer", None)  # addresses in this process's memory: built again at the next call
        return state

    def _apply(self, fn, recurse: bool = True):
        vars(self).pop("_decode_layer", None)  # .to(), .float(), ...: the old tensors are not kept
        return super()._apply(fn, recurse)

    def decode_args(self, x: torch.Tensor, attention_mask, cache, position_embeddings, kwargs: dict) -> tuple | None:
        """(decode_layer's arguments, this layer's cache) where it computes what the replaced forward
        would, else None.

        The inputs and the cache are checked at every call. The layer's modules, hooks, plans and
        tensors are checked whole (layer_args) when `watched` changes: after a layer that streamed its
        weights through the caches, each Python object a check touches comes from memory, and checking
        everything at every call cost about a seventh of a token (BENCHMARKS.md, "CPU decode layers")."""
        qkv = getattr(self._modules.get("self_attn"), "_modules", {}).get("qkv_proj")
        if type(qkv) is not CpuInt4Linear or qkv.path_for(1) != "int4_a8":  # the default plans: nothing more to check
            vars(self).pop("_decode_layer", None)  # nor anything kept from before
            return None
        if attention_mask is not None or position_embeddings is None or torch.is_grad_enabled() or x.dim() != 3 or \
                x.shape[:2] != (1, 1) or not runs_here(x) or kwargs.get("output_attentions") or \
                torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return None
        watched = self.watched()
        state = vars(self).get("_decode_layer")
        if state is None or state[0] != watched:
            built = self.layer_args(x)
            state = self._decode_layer = (self.watched(), *(built or (None, None, None)))  # as it stands after the build
        _, args, layer_idx, _ = state
        layers = getattr(cache, "layers", None)
        if args is None or x.shape[2] != args.hidden or layers is None or not 0 <= layer_idx < len(layers) or \
                getattr(cache, "offloading", False) or type(cache).update is not cache_update():
            return None
        cos, sin = position_embeddings
        D, kv_heads, layer = args.head_dim, args.kv_heads, layers[layer_idx]
        if not (checked_rotary(cos, sin, D) and type(layer) is cpu_attention.growing_layer_class() and layer.is_initialized
                and all(type(t) is torch.Tensor and t.dim() == 4 and t.dtype == torch.bfloat16 and t.shape[0] == 1
                        and t.shape[1] == kv_heads and t.shape[3] == D for t in (layer.keys, layer.values))):
            return None
        return args, layer

    def watched(self) -> tuple:
        """What layer_args' result depends on, compared at each call: the member modules themselves (a
        tuple compares them by identity), their classes, forwards set on them and hooks, the attention's
        mode, settings and cache index, the norms' epsilons, each projection's plan and parts, and the
        ids, addresses, shapes, strides and dtypes of the tensors C reads (the state that holds the tuple keeps them and
        their storage alive, so no other tensor or allocation takes their ids or addresses)."""
        mods = self._modules  # instance dicts read directly: a missing attribute through nn.Module costs an exception
        attn, mlp = mods.get("self_attn"), mods.get("mlp")
        norms = (mods.get("input_layernorm"), mods.get("post_attention_layernorm"))
        a, am, mm = vars(attn) if attn is not None else {}, getattr(attn, "_modules", {}), getattr(mlp, "_modules", {})
        members = (attn, mlp, *norms, *map(am.get, ATTENTION_MEMBERS), *map(mm.get, MLP_MEMBERS))
        out = [*members, *map(type, members), *(a.get(k) for k in ("training", "sliding_window", "layer_idx", "scaling", "head_dim")),
               getattr(a.get("config"), "_attn_implementation", None)]
        for m in members:
            if m is not None:
                d = vars(m)
                out += [d.get("forward"), bool(d["_forward_hooks"] or d["_forward_pre_hooks"])]
        tensors = []
        for norm in norms:
            if norm is not None:
                out.append(vars(norm).get("variance_epsilon"))
                tensors.append(norm._parameters.get("weight"))
        for linear in (am.get("qkv_proj"), am.get("o_proj"), mm.get("gate_up_proj"), mm.get("down_proj")):
            if type(linear) is CpuInt4Linear:
                out += [linear.plan, linear.plan_max_m, vars(linear).get("parts")]
                tensors += linear._buffers.values()
        out += [(id(t), t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors if t is not None]
        return tuple(out)

    def layer_args(self, x: torch.Tensor) -> tuple[DecodeLayerArgs, int, list] | None:
        """(decode_layer's arguments, the layer's index in the cache, what keeps the memory they point
        into alive), or None where this layer does not run it. x: a row that runs_here."""
        hidden = x.shape[-1]
        mods = self._modules
        attn, mlp, norm1, norm2 = (mods.get(m) for m in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))
        replaced = ((attn, CpuDecodeAttention), (mlp, CpuGatedMLP), (norm1, CpuRMSNorm), (norm2, CpuRMSNorm))
        if not all(isinstance(m, Replacement) and type(m) is replacement_class(base, m.replaced) for m, base in replaced):
            return None  # another class (a subclass, a parametrization's) may compute something else
        members = [attn, mlp, norm1, norm2, *(attn._modules.get(m) for m in ATTENTION_MEMBERS), *(mlp._modules.get(m) for m in MLP_MEMBERS)]
        weights = [norm._parameters.get("weight") for norm in (norm1, norm2)]  # read once: C and the state get the same tensors
        projections = [attn._modules.get(m) for m in ("qkv_proj", "o_proj")] + [mlp._modules.get(m) for m in ("gate_up_proj", "down_proj")]
        if None in members or any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in members) or \
                not attn.decodes_as_built() or not fused_as_built(mlp, "gate_up_proj", ("gate_proj", "up_proj")) or \
                not all(w is not None and runs_here(x, w) for w in weights):
            return None
        buffers = [dict(m._buffers) for m in projections]
        tensors = [*weights, *(t for b in buffers for t in b.values() if t is not None)]
        kept = tensors + [t.untyped_storage() for t in tensors]  # before C's addresses are read: they stay valid
        addresses = [t.data_ptr() for t in tensors]
        linears = [quant_linear_args(m) for m in projections]
        qkv, o, gate_up, down = projections
        if len(qkv.parts) != 3 or len(gate_up.parts) != 2:
            return None
        D, (q_size, kv_size, v_size), (inter, up_size) = attn.head_dim, qkv.parts, gate_up.parts
        if None in linears or (attention := cpu_attention.kernel()) is None or v_size != kv_size or up_size != inter or \
                not (isinstance(D, int) and 0 < D <= cpu_attention.MAX_HEAD_DIM and D % 16 == 0 and q_size % D == 0 and
                     kv_size % D == 0 and kv_size and (q_size // D) % (kv_size // D) == 0) or \
                (qkv.in_features, qkv.out_features, o.in_features, o.out_features, gate_up.in_features, gate_up.out_features,
                 down.in_features, down.out_features) != (hidden, q_size + 2 * kv_size, q_size, hidden, hidden, 2 * inter, inter, hidden) or \
                any(m._buffers.get(k) is not t for m, b in zip(projections, buffers, strict=True) for k, t in b.items()) or \
                [t.data_ptr() for t in tensors] != addresses:
            return None  # sizes C's buffers are not made for, or tensors replaced or moved while this ran
        args = DecodeLayerArgs(ctypes.cast(native_int4_a8(), ctypes.c_void_p).value, ctypes.cast(attention, ctypes.c_void_p).value,
                               weights[0].data_ptr(), weights[1].data_ptr(), norm1.variance_epsilon, norm2.variance_epsilon,
                               attn.scaling, hidden, q_size // D, kv_size // D, D, inter, *linears)
        return args, attn.layer_idx, kept


_rotary = threading.local()


def checked_rotary(cos: torch.Tensor, sin: torch.Tensor, D: int) -> bool:
    """Whether C may read cos and sin as one row of D each. Every layer of a token gets the same two
    tensors: the last pair that passed is kept (so no other tensor takes their ids) and passes again."""
    last = getattr(_rotary, "passed", None)
    if last is not None and last[0] is cos and last[1] is sin and last[2] == D:
        return True
    if runs_here(cos) and runs_here(sin) and cos.shape == sin.shape == (1, 1, D):
        _rotary.passed = (cos, sin, D)
        return True
    return False


@functools.cache
def cache_update():
    from transformers.cache_utils import Cache

    return Cache.update


# Where torch has no bfloat16 GEMM kernel (SLOW_HALF_GEMM), from FLOAT32_MIN_ROWS rows the float lm_head
# multiplies in float32, FLOAT32_TILE_ROWS rows of its weight converted at a time (BENCHMARKS.md, "CPU
# decode layers": the crossover, and smaller tiles made the float32 GEMM slower).
FLOAT32_MIN_ROWS = 16
FLOAT32_TILE_ROWS = 4096


class CpuLinear(nn.Linear):
    """A dense bfloat16 Linear without bias (the float lm_head a GPTQ checkpoint keeps). One row at a
    time in C (gemv_bf16): torch's bfloat16 matrix-vector product reads the weight well below this
    machine's memory speed. Many rows where torch has no bfloat16 GEMM kernel: in float32 over tiles
    of the weight, as the quantized linears' dense paths do there. Other inputs: nn.Linear's forward.
    `replace` makes an nn.Linear one (a subclass without state of its own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, K, N = self.weight, self.in_features, self.out_features
        if self.bias is not None or x.dim() == 0 or x.shape[-1] != K or not runs_here(x, w, (N, K)):
            return super().forward(x)
        rows = x.numel() // K
        if rows >= FLOAT32_MIN_ROWS and SLOW_HALF_GEMM:
            return self.float32_tiles(x)
        if rows != 1:
            return super().forward(x)
        y = x.new_empty(*x.shape[:-1], N)
        if library().gemv_bf16(x.data_ptr(), w.data_ptr(), y.data_ptr(), N, K) != 0:
            return super().forward(x)
        return y

    def float32_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T, each output's sum in float32 (as torch's bfloat16 GEMM sums), rounded to x's dtype."""
        w, K, N = self.weight, self.in_features, self.out_features
        rows, y = x.reshape(-1, K).float(), x.new_empty(*x.shape[:-1], N)
        out = y.view(-1, N)
        tile = w.new_empty(min(FLOAT32_TILE_ROWS, N), K, dtype=torch.float32)
        for n0 in range(0, N, FLOAT32_TILE_ROWS):
            n1 = min(n0 + FLOAT32_TILE_ROWS, N)
            t = tile[: n1 - n0]
            t.copy_(w[n0:n1])
            out[:, n0:n1] = rows @ t.T
        return y


def same_code(f, g) -> bool:
    """Whether two functions are the same instructions on the same names and constants (transformers
    copies Llama's code into each family that shares it: "Copied from")."""
    a, b = inspect.unwrap(f).__code__, inspect.unwrap(g).__code__
    return (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts)


def same_forward(module: nn.Module, reference: type) -> bool:
    return same_code(type(module).forward, reference.forward)


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


def is_fused_decode_attention(module: nn.Module) -> bool:
    """Llama's or Qwen2's attention (forward and rotary embedding instruction for instruction) with
    q/k/v fused into qkv_proj in that order and a head size the kernels take."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    if not any(same_forward(module, c) for c in (modeling_llama.LlamaAttention, Qwen2Attention)):
        return False
    rotary = inspect.unwrap(type(module).forward).__globals__
    if not all(callable(rotary.get(f)) and same_code(rotary[f], getattr(modeling_llama, f)) for f in ("apply_rotary_pos_emb", "rotate_half")):
        return False
    c, D = module.config, getattr(module, "head_dim", 0)
    parts = getattr(getattr(module, "qkv_proj", None), "parts", ())
    return isinstance(D, int) and 0 < D <= cpu_attention.MAX_HEAD_DIM and D % 16 == 0 and \
        parts == (c.num_attention_heads * D, c.num_key_value_heads * D, c.num_key_value_heads * D)


def is_decoder_layer(module: nn.Module) -> bool:
    """Llama's or Qwen2's decoder layer (forward instruction for instruction), with its four members."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return same_forward(module, LlamaDecoderLayer) and \
        all(m in module._modules for m in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))


def is_dense_bf16_linear(module: nn.Module) -> bool:
    """An nn.Linear (exactly) with a bfloat16 weight, no bias and K % 32 == 0, where this library has gemv_bf16."""
    return type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.bfloat16 and \
        module.in_features % 32 == 0 and gemv_bf16_built()


@functools.cache
def gemv_bf16_built() -> bool:
    """Whether gemv_bf16 was compiled for this CPU (AVX512-BF16, or AVX2 and FMA), by calling it on one 32-long row."""
    x = torch.zeros(32, dtype=torch.bfloat16)
    y = torch.empty(1, dtype=torch.bfloat16)
    return library() is not None and library().gemv_bf16(x.data_ptr(), x.data_ptr(), y.data_ptr(), 1, 32) == 0


def replace(module: nn.Module) -> nn.Module | None:
    """Swap the class of one module this file has C for (in place; the module keeps everything it
    holds) and return it, else None."""
    if is_rms_norm(module):
        module.__class__ = replacement_class(CpuRMSNorm, type(module))
    elif is_fused_silu_mlp(module):
        module.__class__ = replacement_class(CpuGatedMLP, type(module))
    elif is_fused_decode_attention(module):
        module.__class__ = replacement_class(CpuDecodeAttention, type(module))
    elif is_decoder_layer(module):
        module.__class__ = replacement_class(CpuDecoderLayer, type(module))
    elif is_dense_bf16_linear(module):
        module.__class__ = CpuLinear
    else:
        return None
    return module


def use(model: nn.Module) -> int:
    """Give the RMSNorm, fused SiLU MLP, fused Llama/Qwen2 attention, Llama/Qwen2 decoder layer and dense
    bfloat16 Linear modules of a bfloat16 CPU model their C forwards (replace); how many (0: another
    dtype or no C compiler)."""
    if model.dtype != torch.bfloat16 or library() is None:
        return 0
    return sum(replace(m) is not None for m in list(model.modules()))
