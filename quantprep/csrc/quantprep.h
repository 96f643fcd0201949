/* quantprep's C kernels: what the six .c files here share, and every function they export.

   This header is the ABI's one home. Each .c file includes it, so the compiler checks every
   definition against the declaration here; targets/c_abi.py mirrors the declarations for ctypes
   (SIGNATURES, QuantLinearArgs, DecodeLayerArgs) and tests/test_csrc.py checks that mirror against
   this file. targets/c_library.py compiles each .c file on first use. */
#ifndef QUANTPREP_H
#define QUANTPREP_H

#include <stdint.h>
#include <string.h>

#define MAX_D 256 /* the largest head dimension: attention and the rotary embedding keep a row on the stack */
#define ROUTER_TIE 1 /* decode_layer's status where the last of the router's top-k and the best left out are equal:
                        which one torch.topk takes is its own, so the caller chooses from the logits C left */

#if defined(_OPENMP) && defined(__GNUC__) && !defined(__clang__)
#include <omp.h>
#define GNU_OPENMP 1 /* libgomp's: the runtime c_library.library_with_torch_openmp checked torch runs on */
#endif
/* Inside a parallel region: this thread's index and the team's size (0 and 1 without OpenMP) */
static inline int64_t thread_index(void) {
#ifdef GNU_OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static inline int64_t thread_count(void) {
#ifdef GNU_OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* bfloat16 <-> float: widening is exact; narrowing rounds to nearest even */
static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* pack.c: GPTQ's int32 codes -> pack_int4's layout (targets/cpu.py) */
void pack_int4_cpu(const uint32_t *qweight, const int64_t *dest, int64_t K, int64_t N, int64_t block, uint8_t *out);

/* dequant.c: pack_int4's layout -> a dense bfloat16 or float32 weight */
int dequant_int4_cpu(const uint8_t *packed, const int32_t *dest, const void *sz, int sz_bf16, int64_t K, int64_t N,
                     int64_t block, int64_t gs, int64_t rows, int64_t n_begin, int64_t n_end, int64_t ldo, int bf16, void *out,
                     int threads);

/* a8.c: matmuls with the activations rounded to int8 */
int a8_block(void);
int a8_ahead(void);
int int4_a8_cpu(const uint16_t *x, int64_t M, int64_t ldx, const int32_t *perm, int64_t K_in, const uint8_t *packed,
                const uint32_t *sz, int64_t Kp, int64_t N, int64_t gs, int64_t block, uint16_t *out, int64_t ldo, int threads);
int int8_a8_cpu(const uint16_t *x, int64_t M, int64_t ldx, const int8_t *w, const uint16_t *scale, int64_t N, int64_t K,
                uint16_t *out, int64_t ldo, int threads);

/* attention.c: one query token's attention over a bfloat16 KV cache */
int decode_attention(const uint16_t *q, int64_t q_sb, int64_t q_sh, const uint16_t *k, int64_t k_sb, int64_t k_sh,
                     int64_t k_ss, const uint16_t *v, int64_t v_sb, int64_t v_sh, int64_t v_ss, uint16_t *out,
                     int64_t B, int64_t H, int64_t KV, int64_t S, int64_t D, float scale);

/* gemv.c: a few rows' matmuls in float32, the activations as they are; QuantLinear: one projection's
   kernel arguments (int4_a8_cpu's, int4_gemv_cpu's) */
typedef struct {
    const int32_t *perm; const uint8_t *qweight; const uint32_t *scales_and_zeros; const uint16_t *bias;
    int64_t in, padded_in, out, group, block;
} QuantLinear;
int int4_gemv_rows(const QuantLinear *const *w, const uint16_t *x, int64_t ldx, int64_t rows, uint16_t *out, int64_t ldo, int threads);
int int4_gemv_cpu(const uint16_t *x, int64_t M, int64_t ldx, const int32_t *perm, int64_t K_in, const uint8_t *packed,
                  const uint32_t *sz, int64_t Kp, int64_t N, int64_t gs, int64_t block, uint16_t *out, int64_t ldo, int threads);

/* layers.c: a decoder layer's other steps, and a whole layer */
typedef struct {
    /* the kernels a layer calls, from the other libraries (the types declared once, above) */
    __typeof__(int4_a8_cpu) *matmul; /* the four projections': int4_a8_cpu, or int4_gemv_cpu (the same arguments) */
    __typeof__(decode_attention) *attention;
    __typeof__(int4_gemv_rows) *experts_matmul; /* a sparse block's experts (int4_gemv_rows), or NULL: the gated MLP */
    const uint16_t *norm1, *norm2;
    const uint16_t *q_norm, *k_norm;  /* Qwen3's per-head norms of q and k (qk_norm), or NULL: none */
    float eps1, eps2, q_eps, k_eps, scaling;
    int64_t hidden, heads, kv_heads, head_dim, intermediate; /* intermediate: an expert's, in a sparse block */
    int64_t window;  /* a sliding window: row p attends to rows p - window + 1..p; 0: to every row before it */
    QuantLinear qkv, o, gate_up, down; /* gate_up and down: the gated MLP's, unused in a sparse block */
    /* A sparse block (experts_matmul set): the router's bfloat16 weight [experts, hidden]; each expert's two
       projections; how the top_k weights are made (renormalize: divided by their sum; round_weights: rounded to
       bfloat16, as is each expert's output times its weight); where the router's choice goes between the two
       calls of a row (decode_layer, then sparse_experts): the experts (top_k), their weights (top_k), the
       normalized row they run on (hidden) and the router's logits (experts: the caller's at ROUTER_TIE) */
    const uint16_t *router;
    const QuantLinear *experts_gate_up, *experts_down;
    int64_t *chosen;
    float *chosen_weights;
    uint16_t *routed, *logits;
    int64_t experts, top_k, renormalize, round_weights;
} DecodeLayer;

int gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t N, int64_t K);
void rms_norm(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t ldy, int64_t rows, int64_t n, float eps);
void qk_norm(uint16_t *qkv, int64_t ld, int64_t rows, int64_t heads, int64_t kv_heads, int64_t D, const uint16_t *q_w,
             const uint16_t *k_w, float q_eps, float k_eps);
void rotary(uint16_t *qkv, int64_t ld, int64_t rows, int64_t heads, int64_t D, const uint16_t *cos, const uint16_t *sin);
void silu_mul(const uint16_t *gu, int64_t ldg, uint16_t *y, int64_t ldy, int64_t rows, int64_t n);
int layer_rows(const DecodeLayer *L, const uint16_t *x, int64_t rows, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
               uint16_t *k_cache, uint16_t *v_cache, int64_t capacity, int64_t filled, int threads);
int decode_layer(const DecodeLayer *L, const uint16_t *x, uint16_t *out, const uint16_t *cos, const uint16_t *sin,
                 uint16_t *k_cache, uint16_t *v_cache, int64_t capacity, int64_t filled, int threads);
int sparse_experts(const DecodeLayer *L, uint16_t *out, int threads);

#endif
