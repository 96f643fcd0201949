/* The "int4_a8" path, for decode: activations quantized to int8 per kernel group (absmax / 127, as
   llama.cpp's Q8 blocks and OpenVINO's CPU plugin do) and multiplied by the 4-bit codes with integer
   dot products, in pack_int4's layout as stored. Per group g of packed rows:
   y += a_g * (scale * sum(q * xq) + (zero - 8 * scale) * sum(xq)), exactly the kernel's
   w = (q - 8) * scale + zero times x = a_g * xq. AVX512-VNNI (64-column blocks): four packed rows
   are 128 contiguous bytes; one VBMI byte permute per 16 columns turns them into dwords of four
   consecutive rows' codes, which vpdpbusd wants. AVX2 (32-column blocks): two packed rows are 32
   bytes; a qword permute and a byte shuffle pair each column's two codes, vpmaddubsw multiplies
   them by the two activations (at most 2 * 15 * 127 per pair, so eight pairs add up in int16
   before they widen). The act-order gather is folded into the quantization (packed row k reads
   x[perm[k]]). Its error is the int8 rounding of the activations (tests/targets/test_cpu.py states
   the tolerance; BENCHMARKS.md, "llama.cpp, the CPU anchor", measures it on the real model). The
   library's A8_BLOCK says which layout it reads (a8_block()); 0, and no path: neither ISA. */
#include "quantprep.h"
#include <math.h>
#include <stdlib.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define A8_BLOCK 64
#elif defined(__AVX2__) && defined(__FMA__)
#define A8_BLOCK 32
#ifndef A8_AHEAD /* how far ahead (bytes) the kernel prefetches its block; 0: not at all (benchmarks/experiments/cpu_layers.py times both) */
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
                   reads below the memory's speed (benchmarks/experiments/README.md, "CPU decode layers") */   \
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
        int64_t t = thread_index(), T = thread_count();
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
        int64_t t = thread_index(), T = thread_count();
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
