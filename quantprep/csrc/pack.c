/* pack_int4's layout (targets/cpu.py) straight from GPTQ's packed int32 codes, act-order gather
   included: one pass where the tensor ops take six over unpacked bytes (unpack, gather, shift, or,
   permute copy): it packs several times faster at the 7B-32B shapes (benchmarks/experiments/results/:
   cpu-pack-avx512.json, pack-prepack-cpu-avx512.json). The build side only: an artifact never carries
   it; without a compiler, the tensor ops. */
#include "quantprep.h"
/* qweight [K/8, N]: code k of column n at bits 4*(k%8) of qweight[k/8][n]. dest [K] or NULL: source
   row k goes to row dest[k] of the result. out: per block of `block` columns, [K, block/2] bytes,
   byte j of row k = code(n0+j+block/2) << 4 | code(n0+j); a last, partial block pairs adjacent
   columns. Each source word is read once: a block's 8 rows at a time, written where they go. */
void pack_int4_cpu(const uint32_t *qweight, const int64_t *dest, int64_t K, int64_t N, int64_t block, uint8_t *out) {
    int64_t n_full = N / block * block;
    for (int64_t n0 = 0; n0 < N; n0 += block) {
        int64_t width = n0 < n_full ? block : N - n_full, half = width / 2;
        uint8_t *blk = out + n0 * K / 2;
        for (int64_t w = 0; w < K / 8; w++) {
            const uint32_t *row = qweight + w * N + n0;
            for (int r = 0; r < 8; r++) {
                uint8_t *o = blk + (dest ? dest[8 * w + r] : 8 * w + r) * half;
                if (n0 < n_full)
                    for (int64_t j = 0; j < half; j++)
                        o[j] = (uint8_t)(((row[j] >> (4 * r)) & 15) | (((row[j + half] >> (4 * r)) & 15) << 4));
                else
                    for (int64_t j = 0; j < half; j++)
                        o[j] = (uint8_t)(((row[2 * j] >> (4 * r)) & 15) | (((row[2 * j + 1] >> (4 * r)) & 15) << 4));
            }
        }
    }
}
