/* Decode attention (runtime/cpu_attention.py): one query token against a bfloat16 KV cache, read once
   per head, accumulated in float32 as torch's SDPA does. */
#include "quantprep.h"
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
