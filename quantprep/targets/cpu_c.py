"""The cpu target's C kernels, as source: the int8-activation matmuls (int4_a8, int8_a8), decode
attention, and a decoder layer's other steps (RMSNorm, rotary embedding, the SiLU product,
gemv_bf16, a whole layer). Plain strings and ctypes signatures, no torch: targets/cpu.py and
runtime/cpu_attention.py and cpu_layers.py call them on torch's tensors, runtime/native_model.py on
numpy arrays; native.py compiles each once per machine (its cache key is the source itself).
"""

from __future__ import annotations

import ctypes

# bfloat16 <-> float in C, for the sources below: widening is exact; narrowing rounds to nearest even
BF16_C = r"""
#include <stdint.h>
#include <string.h>
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
"""


# The "int4_a8" path, for decode: activations quantized to int8 per kernel group (absmax / 127, as
# llama.cpp's Q8 blocks and OpenVINO's CPU plugin do) and multiplied by the 4-bit codes with integer
# dot products, in pack_int4's layout as stored. Per group g of packed rows:
# y += a_g * (scale * sum(q * xq) + (zero - 8 * scale) * sum(xq)), exactly the kernel's
# w = (q - 8) * scale + zero times x = a_g * xq. AVX512-VNNI (64-column blocks): four packed rows
# are 128 contiguous bytes; one VBMI byte permute per 16 columns turns them into dwords of four
# consecutive rows' codes, which vpdpbusd wants. AVX2 (32-column blocks): two packed rows are 32
# bytes; a qword permute and a byte shuffle pair each column's two codes, vpmaddubsw multiplies
# them by the two activations (at most 2 * 15 * 127 per pair, so eight pairs add up in int16
# before they widen). The act-order gather is folded into the quantization (packed row k reads
# x[perm[k]]). Its error is the int8 rounding of the activations (tests/targets/test_cpu.py states
# the tolerance; BENCHMARKS.md, "llama.cpp, the CPU anchor", measures it on the real model). The
# library's A8_BLOCK says which layout it reads (a8_block()); 0, and no path: neither ISA.
NATIVE_A8_SOURCE = BF16_C + r"""
#include <math.h>
#include <stdlib.h>
#if defined(_OPENMP) && defined(__GNUC__) && !defined(__clang__)
#include <omp.h>
#define GNU_OPENMP 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define A8_BLOCK 64
#elif defined(__AVX2__) && defined(__FMA__)
#define A8_BLOCK 32
#ifndef A8_AHEAD /* how far ahead (bytes) the kernel prefetches its block; 0: not at all (benchmarks/cpu_layers.py times both) */
#define A8_AHEAD 1024
#endif
#else
#define A8_BLOCK 0
#endif
int a8_block(void) { return A8_BLOCK; }
#ifdef A8_AHEAD
int a8_ahead(void) { return A8_AHEAD; }
#else
int a8_ahead(void) { return 0; }
#endif
#if A8_BLOCK
#include <immintrin.h>
/* Group g of row m: packed row k = x[m, perm[k]] (perm NULL: k; k >= K_in or a perm value out of range: 0),
   xq = round(x / a), a = max|x| / 127 (round half to even of the float product, as nearbyintf, by the
   1.5 * 2^23 addition: exact for |x / a| <= 127 without a libm call); xs = a, xsum = sum of xq. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off"))) /* x / a rounded to float before the addition, never one fused multiply-add */
#endif
static void quantize_group(const uint16_t *x, int64_t ldx, const int32_t *perm, int64_t K_in, int64_t Kp, int64_t gs,
                           int64_t m, int64_t g, int8_t *xq, float *xs, float *xsum) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    int64_t G = Kp / gs;
    float tmp[256]; /* gs <= 256: KERNEL_GROUP_SIZES */
    for (int64_t i = 0; i < gs; i++) {
        int64_t k = g * gs + i, src = perm && k < K_in ? perm[k] : k;
        tmp[i] = k < K_in && src >= 0 && src < K_in ? from_bf16(x[m * ldx + src]) : 0.f;
    }
    float amax = 0.f;
    int nan = 0;
    for (int64_t i = 0; i < gs; i++) {
        float v = tmp[i], a = v < 0.f ? -v : v;
        nan |= v != v;
        amax = a > amax ? a : amax;
    }
    /* a NaN or infinite activation: the group's codes 0 and its scale NaN, so the outputs are NaN, as
       the other paths give (never a conversion of NaN to an integer) */
    int finite = !nan && isfinite(amax);
    float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    int8_t *q = xq + m * Kp + g * gs;
    for (int64_t i = 0; i < gs; i++) {
        float r = finite ? (tmp[i] * inv + 12582912.0f) - 12582912.0f : 0.f;
        r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
        q[i] = (int8_t)(int32_t)r, sum += (int32_t)r;
    }
    xs[m * G + g] = finite ? amax / 127.f : NAN, xsum[m * G + g] = (float)sum;
}
#endif
#if A8_BLOCK == 64
/* Columns n0..n0+63 (a full block, `blk`: [Kp, 32] bytes) for rows r0..r0+MR-1 into acc [MR][64] */
#define BLOCK(MR)                                                                                                  \
    static void block_##MR(const uint8_t *blk, const uint32_t *sz, int64_t N, int64_t n0, int64_t Kp, int64_t gs,    \
                           const int8_t *xq, const float *xs, const float *xsum, float *acc) {                       \
        const __m512i m15 = _mm512_set1_epi8(15), hi16 = _mm512_set1_epi32((int)0xFFFF0000u);                      \
        /* dword i of the permutes of rows k..k+3 (a: rows k, k+1; b: k+2, k+3): byte i, or 16 + i, of each */  \
        __m512i ix0, ix1;                                                                                          \
        {                                                                                                          \
            uint8_t i0[64], i1[64];                                                                                \
            for (int i = 0; i < 16; i++)                                                                           \
                for (int r = 0; r < 4; r++) {                                                                      \
                    i0[4 * i + r] = (uint8_t)((r >> 1) * 64 + (r & 1) * 32 + i);                                   \
                    i1[4 * i + r] = (uint8_t)((r >> 1) * 64 + (r & 1) * 32 + 16 + i);                              \
                }                                                                                                  \
            ix0 = _mm512_loadu_si512(i0), ix1 = _mm512_loadu_si512(i1);                                             \
        }                                                                                                          \
        int64_t G = Kp / gs;                                                                                       \
        for (int64_t g = 0; g < G; g++) {                                                                          \
            __m512i ia[MR][4];                                                                                     \
            for (int r = 0; r < MR; r++)                                                                           \
                for (int c = 0; c < 4; c++) ia[r][c] = _mm512_setzero_si512();                                    \
            for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {                                                   \
                const uint8_t *p = blk + k * 32;                                                                   \
                __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);                                  \
                __m512i t0 = _mm512_permutex2var_epi8(a, ix0, b), t1 = _mm512_permutex2var_epi8(a, ix1, b);        \
                __m512i d[4] = {_mm512_and_si512(t0, m15), _mm512_and_si512(t1, m15),                               \
                                _mm512_and_si512(_mm512_srli_epi16(t0, 4), m15), _mm512_and_si512(_mm512_srli_epi16(t1, 4), m15)}; \
                for (int r = 0; r < MR; r++) {                                                                     \
                    int32_t w4;                                                                                    \
                    memcpy(&w4, xq + r * Kp + k, 4);                                                               \
                    __m512i xv = _mm512_set1_epi32(w4);                                                            \
                    for (int c = 0; c < 4; c++) ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], d[c], xv);                \
                }                                                                                                  \
            }                                                                                                      \
            for (int c = 0; c < 4; c++) {                                                                          \
                __m512i w = _mm512_loadu_si512(sz + g * N + n0 + 16 * c); /* (scale, zero) bfloat16 pairs */       \
                __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));                                          \
                __m512 zs = _mm512_fmadd_ps(s, _mm512_set1_ps(-8.f), _mm512_castsi512_ps(_mm512_and_si512(w, hi16))); \
                for (int r = 0; r < MR; r++) {                                                                     \
                    __m512 t = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(ia[r][c]), _mm512_mul_ps(zs, _mm512_set1_ps(xsum[r * G + g]))); \
                    float *o = acc + r * 64 + 16 * c;                                                              \
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(t, _mm512_set1_ps(xs[r * G + g]), _mm512_loadu_ps(o)));   \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    }
#elif A8_BLOCK == 32
/* Columns n0..n0+31 (a full block, `blk`: [Kp, 16] bytes) for rows r0..r0+MR-1 into acc [MR][32] */
#define BLOCK(MR)                                                                                                  \
    static void block_##MR(const uint8_t *blk, const uint32_t *sz, int64_t N, int64_t n0, int64_t Kp, int64_t gs,    \
                           const int8_t *xq, const float *xs, const float *xsum, float *acc) {                       \
        const __m256i m15 = _mm256_set1_epi8(15), hi16 = _mm256_set1_epi32((int)0xFFFF0000u);                      \
        /* in each 128-bit lane, byte j of row k then byte j of row k + 1 */                                      \
        const __m256i pair = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,                 \
                                              0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);                \
        int64_t G = Kp / gs;                                                                                       \
        for (int64_t g = 0; g < G; g++) {                                                                          \
            /* int32 sums of the even and odd columns of 0..15 ([0]) and 16..31 ([1]) */                          \
            __m256i ev[MR][2], od[MR][2];                                                                          \
            for (int r = 0; r < MR; r++)                                                                           \
                for (int c = 0; c < 2; c++) ev[r][c] = od[r][c] = _mm256_setzero_si256();                         \
            for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 16) {                                               \
                /* the block's bytes A8_AHEAD on: one stream per thread, which the hardware prefetch alone     \
                   reads below the memory's speed (BENCHMARKS.md, "CPU decode layers") */                       \
                for (int l = 0; A8_AHEAD && l < 256; l += 64) _mm_prefetch((const char *)((uintptr_t)blk + k0 * 16 + A8_AHEAD + l), _MM_HINT_T0); \
                __m256i s16[MR][2]; /* int16 sums of eight row pairs, column j in lane j */                        \
                for (int r = 0; r < MR; r++) s16[r][0] = s16[r][1] = _mm256_setzero_si256();                      \
                for (int64_t k = k0; k < k0 + 16; k += 2) {                                                        \
                    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + k * 16)); /* rows k, k + 1 */           \
                    v = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0xD8), pair);                              \
                    __m256i lo = _mm256_and_si256(v, m15), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);    \
                    for (int r = 0; r < MR; r++) {                                                                 \
                        int16_t x2;                                                                                \
                        memcpy(&x2, xq + r * Kp + k, 2);                                                           \
                        __m256i xv = _mm256_set1_epi16(x2);                                                        \
                        s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(lo, xv));                     \
                        s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(hi, xv));                     \
                    }                                                                                              \
                }                                                                                                  \
                for (int r = 0; r < MR; r++)                                                                       \
                    for (int c = 0; c < 2; c++) {                                                                  \
                        ev[r][c] = _mm256_add_epi32(ev[r][c], _mm256_srai_epi32(_mm256_slli_epi32(s16[r][c], 16), 16)); \
                        od[r][c] = _mm256_add_epi32(od[r][c], _mm256_srai_epi32(s16[r][c], 16));                   \
                    }                                                                                              \
            }                                                                                                      \
            for (int c = 0; c < 2; c++)                                                                            \
                for (int h = 0; h < 2; h++) { /* columns 16c + 8h .. 16c + 8h + 7 */                              \
                    __m256i w = _mm256_loadu_si256((const __m256i *)(sz + g * N + n0 + 16 * c + 8 * h));             \
                    __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));                                      \
                    __m256 zs = _mm256_fmadd_ps(s, _mm256_set1_ps(-8.f), _mm256_castsi256_ps(_mm256_and_si256(w, hi16))); \
                    for (int r = 0; r < MR; r++) {                                                                 \
                        __m256i a = _mm256_unpacklo_epi32(ev[r][c], od[r][c]), b = _mm256_unpackhi_epi32(ev[r][c], od[r][c]); \
                        __m256i dot = h ? _mm256_permute2x128_si256(a, b, 0x31) : _mm256_permute2x128_si256(a, b, 0x20); \
                        __m256 t = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot), _mm256_mul_ps(zs, _mm256_set1_ps(xsum[r * G + g]))); \
                        float *o = acc + r * 32 + 16 * c + 8 * h;                                                  \
                        _mm256_storeu_ps(o, _mm256_fmadd_ps(t, _mm256_set1_ps(xs[r * G + g]), _mm256_loadu_ps(o))); \
                    }                                                                                              \
                }                                                                                                  \
        }                                                                                                          \
    }
#endif
#if A8_BLOCK
BLOCK(1)
BLOCK(2)
BLOCK(3)
BLOCK(4)
/* The last, partial block (width columns, adjacent columns paired in each byte), one row */
static void tail_columns(const uint8_t *blk, const uint32_t *sz, int64_t N, int64_t n0, int64_t width, int64_t Kp, int64_t gs,
                         const int8_t *xq, const float *xs, const float *xsum, float *acc) {
    int64_t G = Kp / gs;
    for (int64_t j = 0; j < width; j++) {
        float y = 0.f;
        for (int64_t g = 0; g < G; g++) {
            int32_t dot = 0;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++)
                dot += ((blk[k * (width / 2) + j / 2] >> (4 * (j & 1))) & 15) * xq[k];
            uint32_t w = sz[g * N + n0 + j];
            float s = from_bf16((uint16_t)w), z = from_bf16((uint16_t)(w >> 16));
            y += xs[g] * (s * (float)dot + (z - 8.f * s) * xsum[g]);
        }
        acc[j] = y;
    }
}
#endif
/* x [M, >= K_in] bfloat16 (row stride ldx) @ pack_int4's layout of `block`-column blocks (Kp packed
   rows, N columns) with (scale, zero) bfloat16 pairs sz [Kp / gs, N] -> out [M, N] bfloat16 (row
   stride ldo). Returns 0; -1 when out of memory; -2 when this library has no kernel for `block`. */
int int4_a8_cpu(const uint16_t *x, int64_t M, int64_t ldx, const int32_t *perm, int64_t K_in, const uint8_t *packed,
                const uint32_t *sz, int64_t Kp, int64_t N, int64_t gs, int64_t block, uint16_t *out, int64_t ldo, int threads) {
#if A8_BLOCK
    if (block != A8_BLOCK) return -2;
    const int64_t B = A8_BLOCK;
    int64_t G = Kp / gs, blocks = N / B, n_full = blocks * B;
    int8_t *xq = malloc(M * Kp + 64);
    float *xs = malloc(2 * M * G * sizeof(float));
    if (xq == NULL || xs == NULL) return free(xq), free(xs), -1;
    float *xsum = xs + M * G;
#ifdef GNU_OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        int64_t t = 0, T = 1;
#ifdef GNU_OPENMP
        t = omp_get_thread_num(), T = omp_get_num_threads();
#endif
        for (int64_t i = t; i < M * G; i += T) quantize_group(x, ldx, perm, K_in, Kp, gs, i / G, i % G, xq, xs, xsum);
#ifdef GNU_OPENMP
#pragma omp barrier
#endif
        float acc[4 * A8_BLOCK];
        int64_t per = (blocks + T - 1) / T, b1 = (t + 1) * per < blocks ? (t + 1) * per : blocks;
        for (int64_t b = t * per; b < b1; b++)
            for (int64_t r0 = 0; r0 < M; r0 += 4) {
                int64_t mr = M - r0 < 4 ? M - r0 : 4;
                memset(acc, 0, sizeof(acc));
                const uint8_t *blk = packed + b * B * Kp / 2;
                const int8_t *q = xq + r0 * Kp;
                const float *s = xs + r0 * G, *sum = xsum + r0 * G;
#if A8_AHEAD
                if (r0 == 0 && b + 1 < b1) /* the next block's (scale, zero) rows, N * 4 bytes apart: no hardware prefetch follows them */
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t c = 0; c < B; c += 16) _mm_prefetch((const char *)(sz + g * N + (b + 1) * B + c), _MM_HINT_T0);
#endif
                if (mr == 4) block_4(blk, sz, N, b * B, Kp, gs, q, s, sum, acc);
                else if (mr == 3) block_3(blk, sz, N, b * B, Kp, gs, q, s, sum, acc);
                else if (mr == 2) block_2(blk, sz, N, b * B, Kp, gs, q, s, sum, acc);
                else block_1(blk, sz, N, b * B, Kp, gs, q, s, sum, acc);
                for (int64_t r = 0; r < mr; r++)
                    for (int j = 0; j < B; j++) out[(r0 + r) * ldo + b * B + j] = to_bf16(acc[r * B + j]);
            }
        if (t == T - 1 && n_full < N)
            for (int64_t m = 0; m < M; m++) {
                tail_columns(packed + n_full * Kp / 2, sz, N, n_full, N - n_full, Kp, gs, xq + m * Kp, xs + m * G, xsum + m * G, acc);
                for (int64_t j = 0; j < N - n_full; j++) out[m * ldo + n_full + j] = to_bf16(acc[j]);
            }
    }
    free(xq), free(xs);
    return 0;
#else
    (void)x, (void)M, (void)ldx, (void)perm, (void)K_in, (void)packed, (void)sz, (void)Kp, (void)N, (void)gs, (void)block, (void)out, (void)ldo,
        (void)threads;
    return -2;
#endif
}
#if A8_BLOCK == 64
/* int8_a8's sum over the G groups of row wr's integer dot product with the codes q, each times its
   activations' scale xs[g]; lanes: per group, the codes' sum in each dword lane */
static float int8_row(const int8_t *wr, const int8_t *q, const float *xs, const int32_t *lanes, int64_t G, int64_t gs) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i dot = _mm512_setzero_si512();
        for (int64_t c = 0; c < gs; c += 64)
            dot = _mm512_dpbusd_epi32(dot, _mm512_xor_si512(_mm512_loadu_si512(wr + g * gs + c), flip), _mm512_loadu_si512(q + g * gs + c));
        dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(_mm512_loadu_si512(lanes + g * 16), 7));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs[g]), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#elif A8_BLOCK == 32
static float int8_row(const int8_t *wr, const int8_t *q, const float *xs, const int32_t *lanes, int64_t G, int64_t gs) {
    (void)lanes;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i dot = _mm256_setzero_si256();
        for (int64_t c = 0; A8_AHEAD && c < gs; c += 64) /* rows follow each other: the weight is one stream per thread */
            _mm_prefetch((const char *)((uintptr_t)wr + g * gs + A8_AHEAD + c), _MM_HINT_T0);
        for (int64_t c = 0; c < gs; c += 32) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + g * gs + c));
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + g * gs + c));
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv));
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xs[g]), acc);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif
/* x [M, K] bfloat16 (row stride ldx) @ (w [N, K] int8, row-major, times scale [N] bfloat16 per row).T -> out [M, N]
   bfloat16 (row stride ldo), the activations rounded to int8 per group of 128 as int4_a8's (quantize_group),
   then integer dot products per group scaled in float32. AVX512-VNNI: u8 x s8 dot products of (w + 128) and
   the codes, less 128 times the codes' sums, per 16-lane slice of each group. AVX2: vpmaddubsw of |w| and
   the codes with w's signs (at most 2 * 128 * 127 per pair: no saturation), widened by vpmaddwd.
   K % 128 == 0. Returns 0; -1 when out of memory; -2 when this library has no kernel. */
int int8_a8_cpu(const uint16_t *x, int64_t M, int64_t ldx, const int8_t *w, const uint16_t *scale, int64_t N, int64_t K,
                uint16_t *out, int64_t ldo, int threads) {
#if A8_BLOCK
    const int64_t gs = 128, G = K / gs;
    int8_t *xq = malloc(M * K + 64);
    float *xs = malloc(2 * M * G * sizeof(float));
    int32_t *lanes = malloc((A8_BLOCK == 64 ? M * G * 16 : 1) * sizeof(int32_t)); /* AVX512: per group, the codes' sum in each dword lane */
    if (xq == NULL || xs == NULL || lanes == NULL) return free(xq), free(xs), free(lanes), -1;
#ifdef GNU_OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        int64_t t = 0, T = 1;
#ifdef GNU_OPENMP
        t = omp_get_thread_num(), T = omp_get_num_threads();
#endif
        for (int64_t i = t; i < M * G; i += T) {
            quantize_group(x, ldx, NULL, K, K, gs, i / G, i % G, xq, xs, xs + M * G);
            const int8_t *q = xq + (i / G) * K + (i % G) * gs;
            for (int l = 0; l < 16 && A8_BLOCK == 64; l++) {
                int32_t sum = 0;
                for (int64_t c = 0; c < gs; c += 64)
                    for (int j = 0; j < 4; j++) sum += q[c + 4 * l + j];
                lanes[i * 16 + l] = sum;
            }
        }
#ifdef GNU_OPENMP
#pragma omp barrier
#endif
        int64_t per = (N + T - 1) / T, n1 = (t + 1) * per < N ? (t + 1) * per : N;
        for (int64_t n = t * per; n < n1; n++)
            for (int64_t m = 0; m < M; m++)
                out[m * ldo + n] = to_bf16(int8_row(w + n * K, xq + m * K, xs + m * G, A8_BLOCK == 64 ? lanes + m * G * 16 : NULL, G, gs) *
                                           from_bf16(scale[n]));
    }
    free(xq), free(xs), free(lanes);
    return 0;
#else
    (void)x, (void)M, (void)ldx, (void)w, (void)scale, (void)N, (void)K, (void)out, (void)ldo, (void)threads;
    return -2;
#endif
}
"""


def int4_a8_function(lib: ctypes.CDLL):
    """`lib`'s int4_a8_cpu (a build of NATIVE_A8_SOURCE) with its C signature."""
    fn = lib.int4_a8_cpu
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def int8_a8_function(lib: ctypes.CDLL):
    """`lib`'s int8_a8_cpu (a build of NATIVE_A8_SOURCE) with its C signature."""
    fn = lib.int8_a8_cpu
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + \
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn



MAX_HEAD_DIM = 256  # the kernel keeps a query row and its sum on the stack

ATTENTION_SOURCE = BF16_C + f"#define MAX_D {MAX_HEAD_DIM}\n" + r"""
#include <math.h>
#include <stdlib.h>
/* out[b, 0, h, :] = softmax(scale * q[b, h] . k[b, h / (H / KV), t] over t < S) . v[b, h / (H / KV)], all
   bfloat16, summed in float32; one (batch, head) per task. Strides are in elements; the last dimension is dense. */
int decode_attention(const uint16_t *q, int64_t q_sb, int64_t q_sh, const uint16_t *k, int64_t k_sb, int64_t k_sh,
                     int64_t k_ss, const uint16_t *v, int64_t v_sb, int64_t v_sh, int64_t v_ss, uint16_t *out,
                     int64_t B, int64_t H, int64_t KV, int64_t S, int64_t D, float scale) {
    if (D % 16 || D > MAX_D || KV < 1 || H % KV || S < 1) return -2;
    int failed = 0;
    #pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H, g = h / (H / KV);
        float *s = malloc((size_t)S * sizeof(float));
        if (!s) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float qf[MAX_D], acc[MAX_D];
        const uint16_t *qr = q + b * q_sb + h * q_sh;
        for (int64_t d = 0; d < D; d++) { qf[d] = from_bf16(qr[d]) * scale; acc[d] = 0.0f; }
        float max = -INFINITY;
        for (int64_t t = 0; t < S; t++) {
            const uint16_t *kr = k + b * k_sb + g * k_sh + t * k_ss;
            float part[16] = {0};  /* 16 partial sums: the compiler vectorizes them */
            for (int64_t d = 0; d < D; d += 16)
                for (int j = 0; j < 16; j++) part[j] += qf[d + j] * from_bf16(kr[d + j]);
            float dot = 0.0f;
            for (int j = 0; j < 16; j++) dot += part[j];
            s[t] = dot;
            max = dot > max ? dot : max;
        }
        float sum = 0.0f;
        for (int64_t t = 0; t < S; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
        for (int64_t t = 0; t < S; t++) {
            const uint16_t *vr = v + b * v_sb + g * v_sh + t * v_ss;
            for (int64_t d = 0; d < D; d++) acc[d] += s[t] * from_bf16(vr[d]);
        }
        uint16_t *o = out + (b * H + h) * D;
        for (int64_t d = 0; d < D; d++) o[d] = to_bf16(acc[d] / sum);
        free(s);
    }
    return failed ? -1 : 0;
}
"""


def attention_function(lib: ctypes.CDLL):
    """`lib`'s decode_attention (a build of ATTENTION_SOURCE) with its C signature."""
    fn = lib.decode_attention
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] + [ctypes.c_int64] * 3
                   + [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_float])
    fn.restype = ctypes.c_int
    return fn


LAYERS_SOURCE = BF16_C + f"#define MAX_D {MAX_HEAD_DIM}\n" + r"""
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
/* `rows` consecutive tokens through a decoder layer (runtime/architectures.py: Llama's, Qwen2's, Qwen3's,
   Mistral's) whose four projections run int4_a8 (targets/cpu.py) and whose attention runs decode_attention,
   both called through the pointers in L: at one row (decode_layer) the same calls, in the same order and
   with the same roundings, as the modules' own C forwards, with no Python between them (BENCHMARKS.md,
   "CPU decode layers"). x and out: `rows` rows of `hidden`; cos, sin: each row's rotary embedding; the new
   keys and values go into rows filled..filled+rows-1 of each head of k_cache, v_cache ([kv_heads,
   capacity, D]), and row r attends to rows 0..filled+r (causal: a prompt's tokens as one call,
   runtime/native_model.py), the last L->window of them where that is not 0 (a sliding window). 0, -1 (no
   memory) or a kernel's error. */
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
    const uint16_t *q_norm, *k_norm;  /* Qwen3's per-head norms of q and k (qk_norm), or NULL: none */
    float eps1, eps2, q_eps, k_eps, scaling;
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    int64_t window;  /* a sliding window: row p attends to rows p - window + 1..p; 0: to every row before it */
    QuantLinear qkv, o, gate_up, down;
} DecodeLayer;

static int quant_linear(const DecodeLayer *L, const QuantLinear *p, const uint16_t *x, int64_t rows, uint16_t *y, int threads) {
    int status = L->int4_a8(x, rows, p->in, p->perm, p->in, p->qweight, p->scales_and_zeros, p->padded_in, p->out, p->group,
                            p->block, y, p->out, threads);
    if (status == 0 && p->bias)  /* as the module's y + bias: rounded once */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t n = 0; n < p->out; n++) y[r * p->out + n] = to_bf16(from_bf16(y[r * p->out + n]) + from_bf16(p->bias[n]));
    return status;
}

static void add_to(const uint16_t *residual, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = to_bf16(from_bf16(residual[i]) + from_bf16(y[i]));
}

int layer_rows(const DecodeLayer *L, const uint16_t *x, int64_t rows, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
               uint16_t *k_cache, uint16_t *v_cache, int64_t capacity, int64_t filled, int threads) {
    int64_t n = L->hidden, D = L->head_dim, I = L->intermediate, q_size = L->heads * D, kv_size = L->kv_heads * D;
    int64_t qkv_size = q_size + 2 * kv_size;
    if (rows < 1 || filled < 0 || filled + rows > capacity) return -2;
    uint16_t *buffer = malloc((size_t)rows * (size_t)(3 * n + qkv_size + q_size + 3 * I) * sizeof(uint16_t));
    if (!buffer) return -1;
    uint16_t *xn = buffer, *qkv = xn + rows * n, *attn = qkv + rows * qkv_size, *h = attn + rows * q_size, *hn = h + rows * n,
             *gu = hn + rows * n, *act = gu + rows * 2 * I;
    int status;
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
    if ((status = quant_linear(L, &L->gate_up, hn, rows, gu, threads))) goto done;
    silu_mul(gu, 2 * I, act, I, rows, I);
    if ((status = quant_linear(L, &L->down, act, rows, out, threads))) goto done;
    add_to(h, out, rows * n);
done:
    free(buffer);
    return status;
}

int decode_layer(const DecodeLayer *L, const uint16_t *x, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
                 uint16_t *k_cache, uint16_t *v_cache, int64_t capacity, int64_t filled, int threads) {
    return layer_rows(L, x, 1, out, cos, sin, k_cache, v_cache, capacity, filled, threads);
}
"""


class QuantLinearArgs(ctypes.Structure):
    """LAYERS_SOURCE's QuantLinear: one projection's int4_a8 arguments."""
    _fields_ = [("perm", ctypes.c_void_p), ("qweight", ctypes.c_void_p), ("scales_and_zeros", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)] + [(f, ctypes.c_int64) for f in ("in_features", "padded_in", "out", "group", "block")]


class DecodeLayerArgs(ctypes.Structure):
    """LAYERS_SOURCE's DecodeLayer."""
    _fields_ = [(f, ctypes.c_void_p) for f in ("int4_a8", "attention", "norm1", "norm2", "q_norm", "k_norm")] + \
        [(f, ctypes.c_float) for f in ("eps1", "eps2", "q_eps", "k_eps", "scaling")] + \
        [(f, ctypes.c_int64) for f in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "window")] + \
        [(f, QuantLinearArgs) for f in ("qkv", "o", "gate_up", "down")]


def layers_functions(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of LAYERS_SOURCE) with its functions' C signatures set."""
    lib.rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_float]
    lib.rms_norm.restype = None
    lib.silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.silu_mul.restype = None
    lib.rotary.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2
    lib.rotary.restype = None
    lib.qk_norm.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 2 + [ctypes.c_float] * 2
    lib.qk_norm.restype = None
    lib.gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    lib.gemv_bf16.restype = ctypes.c_int
    lib.decode_layer.argtypes = [ctypes.POINTER(DecodeLayerArgs)] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.decode_layer.restype = ctypes.c_int
    lib.layer_rows.argtypes = [ctypes.POINTER(DecodeLayerArgs), ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + \
        [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.layer_rows.restype = ctypes.c_int
    return lib
