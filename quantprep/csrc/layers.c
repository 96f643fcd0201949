/* A decoder layer's steps besides its matmuls and attention (runtime/cpu_layers.py: RMSNorm, Qwen3's
   q/k norms, the rotary embedding, the SiLU product, the float lm_head's gemv_bf16), and a whole layer
   as one call (layer_rows, decode_layer) that calls the matmul kernels and decode_attention through the
   pointers in its DecodeLayer (runtime/engine.py, runtime/cpu_layers.py). */
#include "quantprep.h"
#include <math.h>
#include <stdlib.h>
#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
/* y[n] = bf16(sum_k x[k] w[n, k]) for one bfloat16 row x of K % 32 == 0 and w [N, K] row-major: products
   exact in float32 (a bfloat16 product has 16 significant bits), sums in float32, as torch's bfloat16
   linear; four rows of w at a time with AVX512-BF16's dot products, or with AVX2 each 16 values widened to
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
    /* eight rows at a time: each x vector widened once for eight rows of w */
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000);
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 8) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        int rows = N - n0 < 8 ? (int)(N - n0) : 8;
        for (int64_t k = 0; k < K; k += 16) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + k));
            __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)), xo = _mm256_castsi256_ps(_mm256_and_si256(xv, odd));
            for (int r = 0; r < rows; r++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (n0 + r) * K + k));
                acc[r] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), acc[r]);
                acc[r] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(wv, odd)), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
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
/* yr = bf16(w * bf16(xr / sqrt(mean(xr^2) + eps))) for one row of n bfloat16 values (yr may be xr). */
static inline void rms_norm_row(const uint16_t *xr, const uint16_t *w, uint16_t *yr, int64_t n, float eps) {
    float part[16] = {0};  /* 16 partial sums: the compiler vectorizes them */
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int j = 0; j < 16; j++) { float v = from_bf16(xr[d + j]); part[j] += v * v; }
    for (; d < n; d++) { float v = from_bf16(xr[d]); part[0] += v * v; }
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += part[j];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (d = 0; d < n; d++) yr[d] = to_bf16(from_bf16(w[d]) * from_bf16(to_bf16(from_bf16(xr[d]) * inv)));
}
/* rms_norm_row over rows of n values; row strides in elements. */
void rms_norm(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy, int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * ldx, w, y + r * ldy, n, eps);
}
/* Qwen3's q_norm and k_norm: rms_norm_row in place on each query head (weight q_w) and key head (k_w)
   at the start of each fused q/k/v row, as the modules' norms of the heads' view, before the rotary embedding. */
void qk_norm(uint16_t *qkv, int64_t ld, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D, const uint16_t *q_w,
             const uint16_t *k_w, float q_eps, float k_eps) {
    #pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            uint16_t *x = qkv + r * ld + h * D;
            rms_norm_row(x, h < heads ? q_w : k_w, x, D, h < heads ? q_eps : k_eps);
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
    /* 2^(n - 1), times 2 below (n reaches 128 near the top): n + 126 is the low bits of n + 1.5 * 2^23 + 126,
       shifted into the exponent. No conversion to int: for a NaN (n is NaN where `in` is) that is undefined
       behavior, as a shift of the negative int it gave was (UBSan) */
    float biased = n + 12583038.0f;
    uint32_t bits;
    memcpy(&bits, &biased, 4);
    bits <<= 23;
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
static int quant_linear(const DecodeLayer *L, const QuantLinear *p, const uint16_t *x, int64_t rows, uint16_t *y, int threads) {
    int status = L->matmul(x, rows, p->in, p->perm, p->in, p->qweight, p->scales_and_zeros, p->padded_in, p->out, p->group,
                            p->block, y, p->out, threads);
    if (status == 0 && p->bias)  /* as the module's y + bias: rounded once */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t n = 0; n < p->out; n++) y[r * p->out + n] = to_bf16(from_bf16(y[r * p->out + n]) + from_bf16(p->bias[n]));
    return status;
}

static void add_to(const uint16_t *residual, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = to_bf16(from_bf16(residual[i]) + from_bf16(y[i]));
}

/* A sparse block (Qwen3-MoE's, Mixtral's: transformers' router, then the experts as runtime/experts.py
   runs a decode token's) at one row, in two calls so that the caller can check the chosen experts'
   tensors before C reads them. route: the router's logits rounded to bfloat16 (gemv_bf16, as F.linear),
   their softmax in float32, the top_k largest (NaN first), divided by their sum where L->renormalize,
   rounded to bfloat16 where L->round_weights (Qwen3-MoE's router returns bfloat16 weights, Mixtral's
   float32 ones); the choice, x and the logits into L->chosen, L->chosen_weights, L->routed and
   L->logits. Where the last of the top_k and the best left out are equal (bfloat16 logits make it
   common: a token-layer in ten on random weights), ROUTER_TIE: which of equal experts torch.topk takes
   is its own, and the caller's torch.topk chooses from L->logits. Equal within 8 ulps: torch's exp is
   not expf. Equal ones within the top_k are taken either way; torch may order them otherwise, which
   changes only the order of the float32 sum of their outputs. */
static int route(const DecodeLayer *L, const uint16_t *x) {
    int64_t E = L->experts, k = L->top_k, n = L->hidden;
    if (k < 1 || k > E || n % 32 || !L->chosen || !L->chosen_weights || !L->routed || !L->logits) return -2;
    float *prob = malloc(E * sizeof(float));
    if (!prob) return -1;
    int status = gemv_bf16(x, L->router, L->logits, E, n);
    if (status == 0) {
        float max = -INFINITY, sum = 0.f, total = 0.f;
        for (int64_t e = 0; e < E; e++) prob[e] = from_bf16(L->logits[e]), max = prob[e] > max ? prob[e] : max;
        for (int64_t e = 0; e < E; e++) prob[e] = expf(prob[e] - max), sum += prob[e];
        for (int64_t e = 0; e < E; e++) prob[e] *= 1.f / sum;
        int64_t next = -1; /* the best left out */
        for (int64_t j = 0; j < k + (k < E); j++) { /* the top_k, largest first, then the best left out */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= L->chosen[i] == e;
                if (!taken && (best < 0 || (isnan(prob[e]) && !isnan(prob[best])) || prob[e] > prob[best])) best = e;
            }
            if (j == k) next = best;
            else L->chosen[j] = best, L->chosen_weights[j] = prob[best], total += prob[best];
        }
        float last = prob[L->chosen[k - 1]], left = next >= 0 ? prob[next] : 0.f; /* last >= left */
        if (next >= 0 && (last - left <= 0x1p-20f * last || (isnan(last) && isnan(left)))) status = ROUTER_TIE;
        for (int64_t j = 0; j < k; j++) {
            if (L->renormalize) L->chosen_weights[j] /= total;
            if (L->round_weights) L->chosen_weights[j] = from_bf16(to_bf16(L->chosen_weights[j]));
        }
        memcpy(L->routed, x, n * sizeof(uint16_t));
    }
    free(prob);
    return status;
}

/* The second call: the experts route chose (L->chosen, each below L->experts) on L->routed, their
   gate_up projections in one experts_matmul call and their down ones in another, silu_mul between;
   out = out + the sum over the k of output times weight (in float32, rounded once; where
   L->round_weights each product rounded to bfloat16 first), rounded as the layer's residual add.
   out holds the residual decode_layer left there. 0, -1 (no memory), -2 or a kernel's error. */
int sparse_experts(const DecodeLayer *L, uint16_t *out, int threads) {
    int64_t k = L->top_k, n = L->hidden, I = L->intermediate;
    if (!L->experts_matmul || k < 1 || k > L->experts || !L->chosen || !L->chosen_weights || !L->routed) return -2;
    for (int64_t j = 0; j < k; j++)
        if (L->chosen[j] < 0 || L->chosen[j] >= L->experts) return -2;
    char *buffer = malloc(2 * k * sizeof(QuantLinear *) + k * (3 * I + n) * sizeof(uint16_t));
    if (!buffer) return -1;
    const QuantLinear **gate_up = (const QuantLinear **)buffer, **down = gate_up + k;
    uint16_t *gu = (uint16_t *)(down + k), *act = gu + k * 2 * I, *y = act + k * I;
    for (int64_t j = 0; j < k; j++) gate_up[j] = &L->experts_gate_up[L->chosen[j]], down[j] = &L->experts_down[L->chosen[j]];
    int status = L->experts_matmul(gate_up, L->routed, 0, k, gu, 2 * I, threads);
    if (status == 0) {
        silu_mul(gu, 2 * I, act, I, k, I);
        status = L->experts_matmul(down, act, I, k, y, n, threads);
    }
    if (status == 0)
        for (int64_t i = 0; i < n; i++) {
            float s = 0.f;
            for (int64_t j = 0; j < k; j++) {
                float v = from_bf16(y[j * n + i]) * L->chosen_weights[j];
                s += L->round_weights ? from_bf16(to_bf16(v)) : v;
            }
            out[i] = to_bf16(from_bf16(out[i]) + from_bf16(to_bf16(s)));
        }
    free(buffer);
    return status;
}

/* `rows` consecutive tokens through a decoder layer (runtime/architectures.py: Llama's, Qwen2's, Qwen3's,
   Mistral's; Qwen3-MoE's and Mixtral's at one row, up to their router's choice, sparse_experts doing
   the rest) whose projections run int4_a8 or int4_gemv (targets/cpu.py) and whose attention runs
   decode_attention, all called through the pointers in L: at one row (decode_layer) the same calls,
   in the same order and with the same roundings, as the modules' own C forwards, with no Python
   between them (benchmarks/experiments/README.md, "CPU decode layers"). x and out: `rows` rows of
   `hidden`; cos, sin: each row's rotary embedding; the new keys and values go into rows
   filled..filled+rows-1 of each head of k_cache, v_cache ([kv_heads, capacity, D]), and row r attends
   to rows 0..filled+r (causal: a prompt's tokens as one call, runtime/engine.py), the last L->window
   of them where that is not 0 (a sliding window). 0, -1 (no memory) or a kernel's error. */
int layer_rows(const DecodeLayer *L, const uint16_t *x, int64_t rows, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
               uint16_t *k_cache, uint16_t *v_cache, int64_t capacity, int64_t filled, int threads) {
    int64_t n = L->hidden, D = L->head_dim, I = L->intermediate, q_size = L->heads * D, kv_size = L->kv_heads * D;
    int64_t qkv_size = q_size + 2 * kv_size;
    if (rows < 1 || filled < 0 || filled + rows > capacity || (L->experts_matmul && rows != 1)) return -2;
    uint16_t *buffer = malloc((size_t)rows * (size_t)(3 * n + qkv_size + q_size + 3 * I) * sizeof(uint16_t));
    if (!buffer) return -1;
    uint16_t *xn = buffer, *qkv = xn + rows * n, *attn = qkv + rows * qkv_size, *h = attn + rows * q_size, *hn = h + rows * n,
             *gu = hn + rows * n, *act = gu + rows * 2 * I;
    int status, tied = 0;
    rms_norm(x, n, L->norm1, xn, n, rows, n, L->eps1);
    if ((status = quant_linear(L, &L->qkv, xn, rows, qkv, threads))) goto done;
    if (L->q_norm) qk_norm(qkv, qkv_size, rows, L->heads, L->kv_heads, D, L->q_norm, L->k_norm, L->q_eps, L->k_eps);
    rotary(qkv, qkv_size, rows, (q_size + kv_size) / D, D, cos, sin);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < L->kv_heads; g++) {
            memcpy(k_cache + (g * capacity + filled + r) * D, qkv + r * qkv_size + q_size + g * D, D * sizeof(uint16_t));
            memcpy(v_cache + (g * capacity + filled + r) * D, qkv + r * qkv_size + q_size + kv_size + g * D, D * sizeof(uint16_t));
        }
    for (int64_t r = 0; r < rows; r++) {
        int64_t end = filled + r + 1, start = L->window > 0 && end > L->window ? end - L->window : 0;
        if ((status = L->attention(qkv + r * qkv_size, qkv_size, D, k_cache + start * D, kv_size * capacity, capacity * D, D,
                                   v_cache + start * D, kv_size * capacity, capacity * D, D, attn + r * q_size, 1, L->heads,
                                   L->kv_heads, end - start, D, L->scaling))) goto done;
    }
    if ((status = quant_linear(L, &L->o, attn, rows, h, threads))) goto done;
    add_to(x, h, rows * n);
    rms_norm(h, n, L->norm2, hn, n, rows, n, L->eps2);
    if (L->experts_matmul) { /* the router's choice; the residual in out, for sparse_experts */
        if ((status = route(L, hn)) == 0 || (tied = status == ROUTER_TIE)) memcpy(out, h, n * sizeof(uint16_t));
        goto done;
    }
    if ((status = quant_linear(L, &L->gate_up, hn, rows, gu, threads))) goto done;
    silu_mul(gu, 2 * I, act, I, rows, I);
    if ((status = quant_linear(L, &L->down, act, rows, out, threads))) goto done;
    add_to(h, out, rows * n);
done:
    free(buffer);
    return status == ROUTER_TIE && !tied ? -2 : status; /* a kernel's own code is never taken for the router's tie */
}

int decode_layer(const DecodeLayer *L, const uint16_t *x, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
                 uint16_t *k_cache, uint16_t *v_cache, int64_t capacity, int64_t filled, int threads) {
    return layer_rows(L, x, 1, out, cos, sin, k_cache, v_cache, capacity, filled, threads);
}
