/* The dequantize path's weight, [K, N] in bfloat16 or float32, in one pass over the packed bytes
   (pack_int4's layout): the tensor ops take seven passes and were most of that path's time at the
   1.5B's shapes (BENCHMARKS.md, "Kernel plans"). w = q * scale + (zero - 8 * scale) in float32,
   rounded once to bfloat16 (to nearest even; the kernel's codes and scales are finite). A call
   writes columns [n_begin, n_end) (whole blocks, or up to N) of every row, row k at
   out + dest[k] * ldo, one output row at a time so the writes run along it. With AVX512-BF16 and the
   AVX512 layout, 64 columns take a few vector instructions (faster than the compiler's loop on the
   1.5B's shapes but down_proj's, whose tiles are two blocks wide: benchmarks/experiments/cpu_dense_tiles.py
   builds it with -DBF16_BLOCK64=0). Threads split the columns: torch's own OpenMP threads, where the
   library links the libgomp torch loaded. */
#include "quantprep.h"
#include <stdlib.h>
#ifndef BF16_BLOCK64
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BF16_BLOCK64 1
#else
#define BF16_BLOCK64 0
#endif
#endif
#if BF16_BLOCK64
#include <immintrin.h>
#endif
#define AS_FLOAT(v) (v)
/* Columns [n0, n1) of row k (o: that row, indexed by column): each full block of `block` columns
   (its byte j of row k holds columns j and j + block/2), then the last, partial one (byte j:
   columns 2j and 2j + 1) when n1 reaches past the full blocks. */
#define ROW(T, CONVERT)                                                                                           \
    static void row_##T(const uint8_t *restrict packed, int64_t k, int64_t K, int64_t N, int64_t block,            \
                        const float *restrict s, const float *restrict z, int64_t n0, int64_t n1, T *restrict o) { \
        int64_t half = block / 2, n_full = N / block * block, tail = (N - n_full) / 2;                            \
        for (; n0 < n1 && n0 < n_full; n0 += block) {                                                             \
            const uint8_t *restrict p = packed + n0 * K / 2 + k * half;                                           \
            _Pragma("GCC ivdep") for (int64_t j = 0; j < half; j++) {                                             \
                o[n0 + j] = CONVERT((float)(p[j] & 15) * s[n0 + j] + z[n0 + j]);                                   \
                o[n0 + j + half] = CONVERT((float)(p[j] >> 4) * s[n0 + j + half] + z[n0 + j + half]);              \
            }                                                                                                     \
        }                                                                                                         \
        if (n1 <= n_full) return;                                                                                 \
        const uint8_t *restrict p = packed + n_full * K / 2 + k * tail;                                           \
        for (int64_t j = 0; j < tail; j++) {                                                                      \
            o[n_full + 2 * j] = CONVERT((float)(p[j] & 15) * s[n_full + 2 * j] + z[n_full + 2 * j]);               \
            o[n_full + 2 * j + 1] = CONVERT((float)(p[j] >> 4) * s[n_full + 2 * j + 1] + z[n_full + 2 * j + 1]);   \
        }                                                                                                         \
    }
ROW(uint16_t, to_bf16)
ROW(float, AS_FLOAT)
#if BF16_BLOCK64
/* row_uint16_t's full 64-column blocks: 16 bytes -> 16 low and 16 high nibbles -> two 16-float
   FMAs, rounded to bfloat16 by vcvtneps2bf16 (to nearest even, as to_bf16); returns where it stopped */
static int64_t row_bf16_block64(const uint8_t *restrict packed, int64_t k, int64_t K, int64_t N, const float *restrict s,
                                const float *restrict z, int64_t n0, int64_t n1, uint16_t *restrict o) {
    const __m128i m15 = _mm_set1_epi8(15);
    int64_t stop = n1 < N / 64 * 64 ? n1 : N / 64 * 64;
    for (; n0 < stop; n0 += 64) {
        const uint8_t *p = packed + n0 * K / 2 + k * 32;
        for (int h = 0; h < 32; h += 16) {
            __m128i b = _mm_loadu_si128((const __m128i *)(p + h));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m15)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m15)));
            int64_t c = n0 + h;
            lo = _mm512_fmadd_ps(lo, _mm512_loadu_ps(s + c), _mm512_loadu_ps(z + c));
            hi = _mm512_fmadd_ps(hi, _mm512_loadu_ps(s + c + 32), _mm512_loadu_ps(z + c + 32));
            _mm256_storeu_si256((__m256i *)(o + c), (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_storeu_si256((__m256i *)(o + c + 32), (__m256i)_mm512_cvtneps_pbh(hi));
        }
    }
    return n0;
}
#endif
/* One group's scale and zero - 8 * scale, columns [c0, c1), as float from the stored pairs
   sz[n] = (scale, zero) in float32 (sz_bf16 0) or bfloat16 (1) */
static void group_floats(const void *sz, int sz_bf16, int64_t g, int64_t N, int64_t c0, int64_t c1, float *s, float *z) {
    for (int64_t n = c0; n < c1; n++) {
        float a, b;
        if (sz_bf16) {
            const uint16_t *p = (const uint16_t *)sz + 2 * (g * N + n);
            uint32_t ua = (uint32_t)p[0] << 16, ub = (uint32_t)p[1] << 16;
            memcpy(&a, &ua, 4), memcpy(&b, &ub, 4);
        } else {
            const float *p = (const float *)sz + 2 * (g * N + n);
            a = p[0], b = p[1];
        }
        s[n - c0] = a, z[n - c0] = b - 8 * a;
    }
}
/* K: the packed rows (padded), sz: [K / gs, N, 2]. Packed rows 0..rows-1 are written, row k to
   output row dest[k] (dest NULL: k; a row outside 0..rows-1 is skipped, so no write leaves the
   buffer), so an act-order weight comes out in the activations' own order; columns [n_begin, n_end)
   of it to out + dest[k] * ldo + (n - n_begin). Each thread takes whole blocks of the columns.
   Returns 0, or -1 when a thread could not allocate its group's floats. */
int dequant_int4_cpu(const uint8_t *packed, const int32_t *dest, const void *sz, int sz_bf16, int64_t K, int64_t N,
                     int64_t block, int64_t gs, int64_t rows, int64_t n_begin, int64_t n_end, int64_t ldo, int bf16, void *out,
                     int threads) {
    int64_t blocks = (n_end - n_begin + block - 1) / block;
    int failed = 0;
#ifdef GNU_OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
#endif
    {
        int64_t t = thread_index(), T = thread_count();
        int64_t per = (blocks + T - 1) / T * block, c0 = n_begin + t * per, c1 = c0 + per < n_end ? c0 + per : n_end;
        float *s = c0 < c1 ? malloc(2 * (c1 - c0) * sizeof(float)) : NULL, *z = s ? s + (c1 - c0) : NULL; /* none: no columns left */
        failed |= c0 < c1 && s == NULL;
        for (int64_t k = 0, g = -1; k < rows && s != NULL; k++) {
            int64_t r = dest ? dest[k] : k, n0 = c0;
            if (r < 0 || r >= rows) continue;
            if (k / gs != g) group_floats(sz, sz_bf16, g = k / gs, N, c0, c1, s, z);
            if (bf16) {
                uint16_t *o = (uint16_t *)out + r * ldo - n_begin;
#if BF16_BLOCK64
                if (block == 64) n0 = row_bf16_block64(packed, k, K, N, s - c0, z - c0, n0, c1, o);
#endif
                row_uint16_t(packed, k, K, N, block, s - c0, z - c0, n0, c1, o);
            } else {
                row_float(packed, k, K, N, block, s - c0, z - c0, n0, c1, (float *)out + r * ldo - n_begin);
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
