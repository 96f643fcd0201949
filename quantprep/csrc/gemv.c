/* The "int4_gemv" path, for decode: a few rows of bfloat16 activations times pack_int4's layout as
   stored, in float32, with no rounding of the activations (int4_a8 rounds them to int8). Per group
   g of packed rows and column n: y += scale * sum(q * x) + (zero - 8 * scale) * sum(x), the
   kernel's w = (q - 8) * scale + zero times x, summed in float32 and rounded once to bfloat16.
   It streams each thread's blocks with a prefetch ahead, and int4_gemv_rows runs an MoE token's
   experts, each its own weight, in one call (benchmarks/experiments/README.md, "MoE decode on the
   CPU", measures both against torch's _weight_int4pack_mm_for_cpu). A full block's byte j of packed row k holds columns j and j + block / 2; the
   last, partial block's byte j holds columns 2j and 2j + 1 (dequant.c reads the same layout). */
#include "quantprep.h"
#include <stdlib.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define GEMV_AVX512 1
#else
#define GEMV_AVX512 0
#endif
/* How far ahead (bytes) a thread prefetches its stream of blocks (0: not at all), and into which cache
   (__builtin_prefetch's locality: 2, L2): from memory, the fastest of the distances and levels tried
   (benchmarks/experiments/cpu_moe_prefetch.py) */
#ifndef GEMV_AHEAD
#define GEMV_AHEAD 6144
#endif
#ifndef GEMV_LOCALITY
#define GEMV_LOCALITY 2
#endif
#if GEMV_AHEAD
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + GEMV_AHEAD, 0, GEMV_LOCALITY)
#else
#define PREFETCH(p) ((void)0)
#endif

/* acc[j] = sum over packed rows k0..k1-1 of (code(k, j) + offset) * x[k], for the `block` columns of
   one full block whose row k starts at blk + k * block / 2; returns the offset (0 or 16). x is xf
   (float) or xb (the same values as bfloat16). */
static int group_block(const uint8_t *blk, int64_t block, const float *xf, const uint16_t *xb, int64_t k0, int64_t k1,
                       float *acc) {
    int64_t half = block / 2;
#if GEMV_AVX512 && defined(__AVX512BF16__)
    /* Two packed rows at a time with vdpbf16ps (exact products, float32 sums): each dword holds one
       column's codes of rows k and k + 1 as bfloat16 16 + q (exponent 4, q the top four mantissa
       bits: 0x4180 | q << 3), the two activations beside them. Half the instructions of the float path
       per byte, which bounds its speed. The offset 16 comes back out through the group's sum of x. */
    if (block == 64 && !(k0 & 1) && !(k1 & 1)) {
        const __m512i mask = _mm512_set1_epi32(0x00780078), base = _mm512_set1_epi32(0x41804180);
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = k0; k < k1; k += 2) {
            const uint8_t *p = blk + k * 32;
            PREFETCH(p);
            __m512i w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
            __m512i w1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32)));
            /* 128-bit lane L: dword i of lo is byte 8L + i of both rows, of hi byte 8L + 4 + i */
            __m512i d[2] = {_mm512_unpacklo_epi16(w0, w1), _mm512_unpackhi_epi16(w0, w1)};
            uint32_t pair;
            memcpy(&pair, xb + k, 4);
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < 2; c++) {
                __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi32(d[c], 3), mask, base, 0xEA); /* (a & b) | c */
                __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi32(d[c], 1), mask, base, 0xEA);
                a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)lo, x);
                a[2 + c] = _mm512_dpbf16_ps(a[2 + c], (__m512bh)hi, x);
            }
        }
        float t[4][16];
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(t[c], a[c]);
        for (int L = 0; L < 4; L++) /* byte b holds columns b (low nibble) and b + 32 */
            for (int i = 0; i < 4; i++) {
                acc[8 * L + i] = t[0][4 * L + i], acc[8 * L + 4 + i] = t[1][4 * L + i];
                acc[32 + 8 * L + i] = t[2][4 * L + i], acc[32 + 8 * L + 4 + i] = t[3][4 * L + i];
            }
        return 16;
    }
#endif
    (void)xb;
#if GEMV_AVX512
    if (block == 64) {
        const __m256i m15 = _mm256_set1_epi8(15);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = k0; k < k1; k++) {
            const uint8_t *p = blk + k * 32;
            if (!(k & 1)) PREFETCH(p);
            __m256i b = _mm256_loadu_si256((const __m256i *)p);
            __m256i lo = _mm256_and_si256(b, m15), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m15);
            __m512 x = _mm512_set1_ps(xf[k]);
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))), x, a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))), x, a1);
            a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))), x, a2);
            a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))), x, a3);
        }
        _mm512_storeu_ps(acc, a0), _mm512_storeu_ps(acc + 16, a1), _mm512_storeu_ps(acc + 32, a2), _mm512_storeu_ps(acc + 48, a3);
        return 0;
    }
    if (block == 32) {
        const __m128i m15 = _mm_set1_epi8(15);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (int64_t k = k0; k < k1; k++) {
            const uint8_t *p = blk + k * 16;
            if (!(k & 3)) PREFETCH(p);
            __m128i b = _mm_loadu_si128((const __m128i *)p);
            __m512 x = _mm512_set1_ps(xf[k]);
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m15))), x, a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m15))), x, a1);
        }
        _mm512_storeu_ps(acc, a0), _mm512_storeu_ps(acc + 16, a1);
        return 0;
    }
#endif
    for (int64_t j = 0; j < block; j++) acc[j] = 0.f;
    for (int64_t k = k0; k < k1; k++) {
        const uint8_t *restrict p = blk + k * half;
        if (!(k & 1)) PREFETCH(p);
        float x = xf[k];
#pragma GCC ivdep
        for (int64_t j = 0; j < half; j++) acc[j] += (float)(p[j] & 15) * x, acc[j + half] += (float)(p[j] >> 4) * x;
    }
    return 0;
}

/* columns [n0, n0 + width) of row m's product through w (a full block, or the last, partial one:
   byte j holds columns 2j and 2j + 1) into out, with the bias added as the module adds it */
static void block_columns(const QuantLinear *w, int64_t n0, int64_t width, const float *xf, const uint16_t *xb, const float *xsum,
                          uint16_t *out) {
    int64_t Kp = w->padded_in, gs = w->group, G = Kp / gs, N = w->out, block = w->block;
    const uint8_t *blk = w->qweight + n0 * Kp / 2;
    float acc[64], y[64] = {0};
    for (int64_t g = 0; g < G; g++) {
        int offset = 0;
        if (width == block) {
            offset = group_block(blk, block, xf, xb, g * gs, (g + 1) * gs, acc);
        } else {
            for (int64_t j = 0; j < width; j++) {
                float dot = 0.f;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) dot += (float)((blk[k * (width / 2) + j / 2] >> (4 * (j & 1))) & 15) * xf[k];
                acc[j] = dot;
            }
        }
        const uint32_t *sz = w->scales_and_zeros + g * N + n0;
        for (int64_t j = 0; j < width; j++) {
            float s = from_bf16((uint16_t)sz[j]), z = from_bf16((uint16_t)(sz[j] >> 16));
            y[j] += s * acc[j] + (z - (float)(8 + offset) * s) * xsum[g];
        }
    }
    for (int64_t j = 0; j < width; j++) out[n0 + j] = to_bf16(y[j]);
    if (w->bias) /* as the module's y + bias: rounded once more */
        for (int64_t j = 0; j < width; j++) out[n0 + j] = to_bf16(from_bf16(out[n0 + j]) + from_bf16(w->bias[n0 + j]));
}

/* Row r of x (bfloat16, row stride ldx; 0: the one row for every r) through projection w[r] (its
   `block`-column blocks of pack_int4's layout, `padded_in` packed rows, `out` columns; packed row k
   is input column perm[k], perm NULL: k; k >= `in` or a perm value out of range reads 0; (scale,
   zero) bfloat16 pairs [padded_in / group, out]) into row r of out (row stride ldo), for r < rows:
   an MoE token's experts, each its own weight, in one call. Threads take runs of the blocks of all
   the rows. Returns 0; -1 when out of memory; -2 for a block other than 32 or 64, a group size
   over 256 or not dividing padded_in, or a negative size. */
int int4_gemv_rows(const QuantLinear *const *w, const uint16_t *x, int64_t ldx, int64_t rows, uint16_t *out, int64_t ldo, int threads) {
    int64_t floats = 0;
    if (rows < 0) return -2;
    threads = threads > 0 ? threads : 1;
    for (int64_t r = 0; r < rows; r++) {
        const QuantLinear *p = w[r];
        if ((p->block != 32 && p->block != 64) || p->group <= 0 || p->group > 256 || p->padded_in % p->group ||
            p->in < 0 || p->in > p->padded_in || p->out < 0)
            return -2;
        floats += p->padded_in + p->padded_in / p->group + (p->padded_in + 1) / 2; /* xf, xsum, xb */
    }
    float *xf = malloc(floats * sizeof(float) + 2 * (rows + 1) * sizeof(int64_t) + 8);
    if (xf == NULL) return -1;
    int64_t *at = (int64_t *)(xf + floats + (floats & 1)), *first = at + rows + 1; /* row r's floats; its first block */
    at[0] = first[0] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const QuantLinear *p = w[r];
        at[r + 1] = at[r] + p->padded_in + p->padded_in / p->group + (p->padded_in + 1) / 2;
        first[r + 1] = first[r] + (p->out + p->block - 1) / p->block;
    }
#ifdef GNU_OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        int64_t t = thread_index(), T = thread_count();
        for (int64_t r = t; r < rows; r += T) { /* x gathered into each weight's row order, and each group's sum */
            const QuantLinear *p = w[r];
            float *f = xf + at[r], *sum = f + p->padded_in;
            uint16_t *b = (uint16_t *)(sum + p->padded_in / p->group);
            for (int64_t g = 0; g < p->padded_in / p->group; g++) {
                float total = 0.f;
                for (int64_t k = g * p->group; k < (g + 1) * p->group; k++) {
                    int64_t src = p->perm && k < p->in ? p->perm[k] : k;
                    uint16_t v = k < p->in && src >= 0 && src < p->in ? x[r * ldx + src] : 0;
                    b[k] = v, f[k] = from_bf16(v), total += f[k];
                }
                sum[g] = total;
            }
        }
#ifdef GNU_OPENMP
#pragma omp barrier
#endif
        int64_t total = first[rows], per = (total + T - 1) / T, i1 = (t + 1) * per < total ? (t + 1) * per : total;
        for (int64_t i = t * per, r = 0; i < i1; i++) {
            while (i >= first[r + 1]) r++;
            const QuantLinear *p = w[r];
            int64_t n0 = (i - first[r]) * p->block, width = p->out - n0 < p->block ? p->out - n0 : p->block;
            const float *f = xf + at[r], *sum = f + p->padded_in;
            block_columns(p, n0, width, f, (const uint16_t *)(sum + p->padded_in / p->group), sum, out + r * ldo);
        }
    }
    free(xf);
    return 0;
}

/* x [M, >= K_in] bfloat16 (row stride ldx) @ one projection (int4_a8_cpu's arguments) -> out [M, N]
   bfloat16 (row stride ldo): int4_gemv_rows with the one weight for every row. */
int int4_gemv_cpu(const uint16_t *x, int64_t M, int64_t ldx, const int32_t *perm, int64_t K_in, const uint8_t *packed,
                  const uint32_t *sz, int64_t Kp, int64_t N, int64_t gs, int64_t block, uint16_t *out, int64_t ldo, int threads) {
    QuantLinear w = {perm, packed, sz, NULL, K_in, Kp, N, gs, block};
    const QuantLinear **each = malloc((M > 0 ? M : 1) * sizeof(*each));
    if (each == NULL) return -1;
    for (int64_t m = 0; m < M; m++) each[m] = &w;
    int status = int4_gemv_rows(each, x, ldx, M, out, ldo, threads);
    free(each);
    return status;
}
