/* One-token decode of a Llama-family model on the CPU, for chatbot/engine/fast.py.
 *
 * Built at first use with the system C compiler (-O3 -march=native -fopenmp) and loaded
 * through ctypes; every tensor is owned by torch on the Python side and passed as a
 * pointer. One call runs the whole forward pass of one token inside one OpenMP parallel
 * region, so a decode step costs one Python->C transition instead of ~700 torch ops.
 *
 * Weight formats (rows of a [N, K] matrix) are ggml's, as a GGUF file stores them: F32, F16,
 * BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and Q2_K..Q6_K (super-blocks of 256);
 * e.g. Q8_0: fp16 scale d, 32 int8 q, w = d q; Q4_1: fp16 d, fp16 m, 16 bytes, w = d q + m,
 * byte j holding q[j] in its low nibble and q[j + 16] in its high nibble (dequant_block has
 * every layout).
 * Activations (the input vectors of the matrix products) take one of three forms, `act`:
 *   ACT_F32  float32; a block dot product widens the weights to float32 in registers, so a
 *            weight that is exactly representable gives the float32 result (up to order).
 *   ACT_Q8   per block of 32: a float scale and int8 values (ggml's Q8 activations, as
 *            llama.cpp runs Q4_1/Q8_0 files): integer dot products, lossy (~1/254 of the
 *            block's largest value).
 *   ACT_I16  per block of 32: a float scale and int16 values (|x| <= 32767): 16-bit
 *            integer products (madd), an error of at most 1/65534 of the block's largest
 *            value where ACT_Q8 has 1/254: 65534 / 254 = 258x finer. (This is the one place
 *            the figure is derived; the Python side refers here.) The K-quants take the same
 *            int16 per super-block of 256 (prepare_k), so that a super-block's products add
 *            up in int32 before one conversion to float.
 *   With ACT_Q8 the K-quants take int8 per super-block of 256 (ggml's Q8_K, as llama.cpp
 *   runs them): prepare_k's values within +-127, the same integer products, and tile
 *   products that skip the inputs' high byte (one byte product per weight where int16 inputs
 *   take two: --opt fast). Q4_0/Q5_0/Q5_1 take them through their int16 products.
 * Prefill (many inputs at once) has its own batched products: ACT_I16, chatbot_matmul (AVX2
 * and AVX-512: weights unpacked to int16 rows-in-lanes, see there), and ACT_Q8 into matrices in
 * 8-row tiles, chatbot_matmul_x8 (the tiles' bytes as stored; each input's result that of the
 * one-token tile product).
 *
 * Cache: per layer, keys and values as [n_kv_heads, cap, head_dim] float32 (batch 1), the
 * layout of a transformers cache tensor [1, H, S, D] with a preallocated S = cap.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#ifdef _OPENMP
#include <omp.h>
#else
#include <pthread.h>
#include <unistd.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CB_AVX2 1
#endif

/* 64-bit ARM: NEON is always there. The int8 dot products (sdot, ACT_Q8) where the compiler
 * targets a CPU that has them (armv8.2-a+dotprod: most cores since 2018), a widening
 * multiply and pairwise add otherwise. Each NEON product does the arithmetic of the AVX2
 * one: the same integer sums, float sums in another order (4 lanes where AVX2 has 8). */
#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(CB_AVX2)
#include <arm_neon.h>
#define CB_NEON 1
#endif

#define QK 32
/* bytes ahead of the weights being read that the matrix products prefetch: the hardware
 * prefetcher alone left one core at ~24 GB/s on a 1 GB model (8 KB: 8% faster decode) */
#define PREFETCH 8192
#define QK_K 256

enum {
    FMT_F32 = 0, FMT_BF16 = 1, FMT_Q8_0 = 2, FMT_Q4_1 = 3, FMT_F16 = 4, FMT_Q4_0 = 5, FMT_Q5_0 = 6,
    FMT_Q5_1 = 7, FMT_Q2_K = 8, FMT_Q3_K = 9, FMT_Q4_K = 10, FMT_Q5_K = 11, FMT_Q6_K = 12
};
enum { ACT_F32 = 0, ACT_Q8 = 1, ACT_I16 = 2 };

typedef struct {
    uint16_t d;
    int8_t qs[QK];
} block_q8_0; /* 34 bytes */

typedef struct {
    uint16_t d, m;
    uint8_t qs[QK / 2];
} block_q4_1; /* 20 bytes */

typedef struct {
    const void *data;
    int32_t fmt;
    int32_t rows;
    int32_t cols;
    int32_t x8; /* rows in 8-row tiles (chatbot_repack: Q4_K and Q6_K on AVX2 and up) */
} Mat;

/* Row blocks of one product, each in its own format (q, k and v of a Q4_K_M file: Q4_K, Q4_K,
 * Q6_K), with an optional bias over all rows (qwen2's q/k/v bias). */
typedef struct {
    Mat part[3];
    const float *bias; /* [rows] or NULL */
    int32_t n_parts;
    int32_t rows;
} Group;

typedef struct {
    int32_t n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim, vocab, n_threads;
    float eps, attn_scale;
    int32_t rope_len, cap;
    const float *rope_cos; /* [rope_len, head_dim / 2] */
    const float *rope_sin;
    const Mat *embed;      /* [vocab, dim], rows looked up */
    const Mat *lm_head;    /* [vocab, dim] */
    const float *final_norm;
    const float *const *attn_norm; /* per layer [dim] */
    const float *const *ffn_norm;
    const Group *wqkv;  /* per layer [(H + 2 Hkv) D, dim]: q, k, v stacked */
    const Group *wo;    /* [dim, H D] */
    const Group *wgu;   /* [2 F, dim]: gate, up stacked */
    const Group *wdown; /* [dim, F] */
    float *const *kcache; /* per layer [Hkv, cap, D] */
    float *const *vcache;
    float *scratch; /* see chatbot_scratch_floats() */
    int32_t act; /* ACT_F32, ACT_Q8 or ACT_I16: the form of the inputs of Q8_0/Q4_1 products */
    int32_t act_i16_sites; /* with ACT_Q8: bit SITE_x set -> that product's inputs are ACT_I16 */
    const float *const *q_norm; /* NULL, or per layer [head_dim]: RMSNorm of each q head (qwen3) */
    const float *const *k_norm;
    /* Gemma 2/3 (all NULL or 0 for the others): */
    const float *const *post_attn_norm; /* NULL, or per layer [dim]: RMSNorm of the attention's output */
    const float *const *post_ffn_norm;  /* NULL, or per layer [dim]: RMSNorm of the MLP's output */
    const int32_t *window;   /* NULL, or per layer: attend to the last `window` positions only (0: all) */
    const int32_t *rope_sel; /* NULL, or per layer: 1 takes the second rotary table */
    const float *rope_cos2;  /* [rope_len, head_dim / 2]: a second rope (gemma3's local layers) */
    const float *rope_sin2;
    float embed_scale;   /* the embedding rows times this (0: 1) */
    float attn_softcap;  /* scores -> cap * tanh(scores / cap) (0: none) */
    float final_softcap; /* the same on the logits */
    int32_t act_fn;      /* ACT_FN_SILU or ACT_FN_GELU_TANH */
} Model;

enum { ACT_FN_SILU = 0, ACT_FN_GELU_TANH = 1 };

/* The five kinds of product of a layer and the head, for Model.act_i16_sites. */
enum { SITE_QKV = 0, SITE_O = 1, SITE_GU = 2, SITE_DOWN = 3, SITE_HEAD = 4 };

/* The form of the inputs of the products at `site`: the model's, or int16 where the model's
 * int8 inputs are overridden for that site. */
static inline int site_act(const Model *m, int site) {
    return m->act == ACT_Q8 && (m->act_i16_sites >> site & 1) ? ACT_I16 : m->act;
}

/* ---------------------------------------------------------------- scalar helpers */

static inline float fp16_to_f32(uint16_t h) {
#ifdef CB_AVX2
    return _cvtsh_ss(h);
#elif defined(CB_NEON)
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f32_to_fp16(float f) {
#ifdef CB_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    /* round to nearest even; overflow to inf; subnormals kept */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (x > 0x7f800000 ? 0x200 : 0));
    if (x >= 0x477ff000) return (uint16_t)(sign | 0x7c00);
    if (x < 0x38800000) { /* subnormal or zero in fp16 */
        float a;
        memcpy(&a, &x, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f)); /* a / 2^-24 */
    }
    const uint32_t mant_odd = (x >> 13) & 1;
    x += 0xc8000fff + mant_odd; /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (x >> 13));
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef CB_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp for x <= 0 (softmax after subtracting the max); Cephes-style, ~1 ulp. */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#endif

#ifdef CB_NEON
/* exp256's polynomial on four lanes */
static inline float32x4_t exp4(float32x4_t x) {
    x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(88.3762626647949f)), vdupq_n_f32(-88.3762626647949f));
    const float32x4_t fx = vrndmq_f32(vfmaq_f32(vdupq_n_f32(0.5f), x, vdupq_n_f32(1.44269504088896341f)));
    x = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
    x = vfmsq_f32(x, fx, vdupq_n_f32(-2.12194440e-4f));
    const float32x4_t z = vmulq_f32(x, x);
    float32x4_t y = vdupq_n_f32(1.9875691500E-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), y, x);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), y, x);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), y, x);
    y = vfmaq_f32(x, y, z);
    y = vaddq_f32(y, vdupq_n_f32(1.0f));
    const int32x4_t e = vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127));
    return vmulq_f32(y, vreinterpretq_f32_s32(vshlq_n_s32(e, 23)));
}

/* p + w x for 8 int16 weights and 8 floats */
static inline float32x4_t fma_i16x8(float32x4_t p, int16x8_t w, const float *x) {
    p = vfmaq_f32(p, vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vld1q_f32(x));
    return vfmaq_f32(p, vcvtq_f32_s32(vmovl_high_s16(w)), vld1q_f32(x + 4));
}

/* p + w x for 16 unsigned byte weights and 16 floats */
static inline float32x4_t fma_u8x16(float32x4_t p, uint8x16_t w, const float *x) {
    p = fma_i16x8(p, vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(w))), x);
    return fma_i16x8(p, vreinterpretq_s16_u16(vmovl_high_u8(w)), x + 8);
}

/* p + w x for 16 signed byte weights and 16 floats */
static inline float32x4_t fma_s8x16(float32x4_t p, int8x16_t w, const float *x) {
    p = fma_i16x8(p, vmovl_s8(vget_low_s8(w)), x);
    return fma_i16x8(p, vmovl_high_s8(w), x + 8);
}

/* the exact sum of 32 int8 products: a0 . b0 + a1 . b1 */
static inline int32_t dot_i8x32(int8x16_t a0, int8x16_t b0, int8x16_t a1, int8x16_t b1) {
#ifdef __ARM_FEATURE_DOTPROD
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), a0, b0), a1, b1));
#else
    int32x4_t s = vpaddlq_s16(vmull_s8(vget_low_s8(a0), vget_low_s8(b0)));
    s = vpadalq_s16(s, vmull_high_s8(a0, b0));
    s = vpadalq_s16(s, vmull_s8(vget_low_s8(a1), vget_low_s8(b1)));
    return vaddvq_s32(vpadalq_s16(s, vmull_high_s8(a1, b1)));
#endif
}

/* the exact sum of 32 products of signed bytes (w0: values 0-15, w1: 16-31) with int16 x
 * (8 per int32 lane: |sum| <= 8 x 128 x 32767) */
static inline int32_t dot_s8_i16x32(int8x16_t w0, int8x16_t w1, const int16_t *x) {
    const int16x8_t a = vmovl_s8(vget_low_s8(w0)), b = vmovl_high_s8(w0);
    const int16x8_t c = vmovl_s8(vget_low_s8(w1)), d = vmovl_high_s8(w1);
    const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8), x2 = vld1q_s16(x + 16), x3 = vld1q_s16(x + 24);
    int32x4_t s = vmull_s16(vget_low_s16(a), vget_low_s16(x0));
    s = vmlal_high_s16(s, a, x0);
    s = vmlal_s16(s, vget_low_s16(b), vget_low_s16(x1));
    s = vmlal_high_s16(s, b, x1);
    s = vmlal_s16(s, vget_low_s16(c), vget_low_s16(x2));
    s = vmlal_high_s16(s, c, x2);
    s = vmlal_s16(s, vget_low_s16(d), vget_low_s16(x3));
    return vaddvq_s32(vmlal_high_s16(s, d, x3));
}

/* 16 bits -> 16 bytes, byte i = 0x10 where bit i is set (the 5th bit of Q5_0 / Q5_1) */
static inline uint8x16_t bit4_from_bits16(uint32_t bits) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(0x10));
}

/* 16 values 32 t + 16 u .. 32 t + 16 u + 15 of a Q6_K half (ql: its 64 bytes of low nibbles,
 * qh: its 32 bytes of high bits) as signed bytes q - 32 */
static inline int8x16_t q6_16(const uint8_t *ql, const uint8_t *qh, int t, int u) {
    const uint8x16_t a = vld1q_u8(ql + 32 * (t & 1) + 16 * u);
    const uint8x16_t lo = t < 2 ? vandq_u8(a, vdupq_n_u8(0x0f)) : vshrq_n_u8(a, 4);
    /* bits 2t, 2t + 1 of qh to bits 4, 5 */
    const uint8x16_t h = vandq_u8(vshlq_u8(vld1q_u8(qh + 16 * u), vdupq_n_s8((int8_t)(4 - 2 * t))), vdupq_n_u8(0x30));
    return vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, h)), vdupq_n_s8(32));
}
#endif

/* ---------------------------------------------------------------- row dot products */

static float dot_f32(const float *w, const float *x, int k) {
    int i = 0;
    float s = 0.0f;
#ifdef CB_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    s = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#elif defined(CB_NEON)
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 16 <= k; i += 16) {
        a0 = vfmaq_f32(a0, vld1q_f32(w + i), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, vld1q_f32(w + i + 4), vld1q_f32(x + i + 4));
        a2 = vfmaq_f32(a2, vld1q_f32(w + i + 8), vld1q_f32(x + i + 8));
        a3 = vfmaq_f32(a3, vld1q_f32(w + i + 12), vld1q_f32(x + i + 12));
    }
    for (; i + 4 <= k; i += 4) a0 = vfmaq_f32(a0, vld1q_f32(w + i), vld1q_f32(x + i));
    s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
#endif
    for (; i < k; i++) s += w[i] * x[i];
    return s;
}

static float dot_bf16(const uint16_t *w, const float *x, int k) {
    int i = 0;
    float s = 0.0f;
#ifdef CB_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v));
        __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)), _mm256_loadu_ps(x + i + 8), a1);
    }
    s = hsum256(_mm256_add_ps(a0, a1));
#elif defined(CB_NEON)
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
    for (; i + 8 <= k; i += 8) {
        const uint16x8_t v = vld1q_u16(w + i);
        a0 = vfmaq_f32(a0, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, vreinterpretq_f32_u32(vshll_high_n_u16(v, 16)), vld1q_f32(x + i + 4));
    }
    s = vaddvq_f32(vaddq_f32(a0, a1));
#endif
    for (; i < k; i++) s += bf16_to_f32(w[i]) * x[i];
    return s;
}

static float dot_q8_0(const block_q8_0 *b, const float *x, int k) {
    const int nb = k / QK;
    float s = 0.0f;
#ifdef CB_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++, x += QK) {
        __m128i lo = _mm_loadu_si128((const __m128i *)b[j].qs);
        __m128i hi = _mm_loadu_si128((const __m128i *)(b[j].qs + 16));
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
        p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), p);
        p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), p);
        p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), p);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(b[j].d)), p, acc);
    }
    s = hsum256(acc);
#elif defined(CB_NEON)
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int j = 0; j < nb; j++, x += QK) {
        float32x4_t p = fma_s8x16(vdupq_n_f32(0.0f), vld1q_s8(b[j].qs), x);
        p = fma_s8x16(p, vld1q_s8(b[j].qs + 16), x + 16);
        acc = vfmaq_n_f32(acc, p, fp16_to_f32(b[j].d));
    }
    s = vaddvq_f32(acc);
#else
    for (int j = 0; j < nb; j++, x += QK) {
        float p = 0.0f;
        for (int i = 0; i < QK; i++) p += (float)b[j].qs[i] * x[i];
        s += fp16_to_f32(b[j].d) * p;
    }
#endif
    return s;
}

/* xsum[j]: the sum of x over block j, for the min term of Q4_1. */
static float dot_q4_1(const block_q4_1 *b, const float *x, const float *xsum, int k) {
    const int nb = k / QK;
    float s = 0.0f, ms = 0.0f;
#ifdef CB_AVX2
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++, x += QK) {
        __m128i v = _mm_loadu_si128((const __m128i *)b[j].qs);
        __m128i lo = _mm_and_si128(v, m4);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
        p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), p);
        p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), p);
        p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), p);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(b[j].d)), p, acc);
        ms += fp16_to_f32(b[j].m) * xsum[j];
    }
    s = hsum256(acc);
#elif defined(CB_NEON)
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int j = 0; j < nb; j++, x += QK) {
        const uint8x16_t raw = vld1q_u8(b[j].qs);
        float32x4_t p = fma_u8x16(vdupq_n_f32(0.0f), vandq_u8(raw, vdupq_n_u8(0x0f)), x);
        p = fma_u8x16(p, vshrq_n_u8(raw, 4), x + 16);
        acc = vfmaq_n_f32(acc, p, fp16_to_f32(b[j].d));
        ms += fp16_to_f32(b[j].m) * xsum[j];
    }
    s = vaddvq_f32(acc);
#else
    for (int j = 0; j < nb; j++, x += QK) {
        float p = 0.0f;
        for (int i = 0; i < QK / 2; i++)
            p += (float)(b[j].qs[i] & 0x0f) * x[i] + (float)(b[j].qs[i] >> 4) * x[i + 16];
        s += fp16_to_f32(b[j].d) * p;
        ms += fp16_to_f32(b[j].m) * xsum[j];
    }
#endif
    return s + ms;
}

/* ---------------------------------------------------------------- the other ggml formats
 *
 * Each decoded as ggml's dequantize_row_* defines it (and gguf-py's `quants.dequantize`):
 *   F16   IEEE half [N, K]
 *   Q4_0  32: fp16 d, 16 bytes of nibbles                  w = d (q - 8)
 *   Q5_0  32: fp16 d, 32 high bits, 16 bytes of nibbles     w = d (q - 16)
 *   Q5_1  32: fp16 d, fp16 m, 32 high bits, 16 bytes        w = d q + m
 *   Q2_K..Q6_K  super-blocks of 256 in sub-blocks of 16 or 32 with their own 4- to 8-bit
 *         scales (and mins); byte layouts in dequant_block below.
 * Byte j of a 32-block's nibbles holds q[j] (low) and q[j + 16] (high), as for Q4_1.
 */

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float rdh(const uint8_t *p) { return fp16_to_f32(rd16(p)); }

/* weights per block and bytes per block of each format */
static int block_len(int fmt) {
    switch (fmt) {
    case FMT_F32: case FMT_BF16: case FMT_F16: return 1;
    case FMT_Q2_K: case FMT_Q3_K: case FMT_Q4_K: case FMT_Q5_K: case FMT_Q6_K: return QK_K;
    default: return QK;
    }
}

static int block_bytes(int fmt) {
    switch (fmt) {
    case FMT_F32: return 4;
    case FMT_BF16: case FMT_F16: return 2;
    case FMT_Q8_0: return 34;
    case FMT_Q4_1: return 20;
    case FMT_Q4_0: return 18;
    case FMT_Q5_0: return 22;
    case FMT_Q5_1: return 24;
    case FMT_Q2_K: return 84;
    case FMT_Q3_K: return 110;
    case FMT_Q4_K: return 144;
    case FMT_Q5_K: return 176;
    case FMT_Q6_K: return 210;
    default: return 0;
    }
}

/* the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block of a block format as float32 (block_len(fmt) values). */
static void dequant_block(int fmt, const uint8_t *restrict b, float *restrict y) {
    switch (fmt) {
    case FMT_Q8_0: {
        const float d = rdh(b);
        for (int i = 0; i < QK; i++) y[i] = d * (float)(int8_t)b[2 + i];
        break;
    }
    case FMT_Q4_1: {
        const float d = rdh(b), m = rdh(b + 2);
        for (int i = 0; i < QK / 2; i++) {
            y[i] = d * (float)(b[4 + i] & 0x0f) + m;
            y[i + 16] = d * (float)(b[4 + i] >> 4) + m;
        }
        break;
    }
    case FMT_Q4_0: {
        const float d = rdh(b);
        for (int i = 0; i < QK / 2; i++) {
            y[i] = d * (float)((b[2 + i] & 0x0f) - 8);
            y[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
        }
        break;
    }
    case FMT_Q5_0: case FMT_Q5_1: {
        const int one = fmt == FMT_Q5_1;
        const float d = rdh(b), m = one ? rdh(b + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * one, 4);
        const uint8_t *qs = b + 6 + 2 * one;
        for (int i = 0; i < QK / 2; i++) {
            const int h0 = ((qh >> i) << 4) & 0x10, h1 = (qh >> (i + 12)) & 0x10;
            const int q0 = (qs[i] & 0x0f) | h0, q1 = (qs[i] >> 4) | h1;
            if (one) {
                y[i] = d * (float)q0 + m;
                y[i + 16] = d * (float)q1 + m;
            } else {
                y[i] = d * (float)(q0 - 16);
                y[i + 16] = d * (float)(q1 - 16);
            }
        }
        break;
    }
    case FMT_Q2_K: { /* scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin */
        const float d = rdh(b + 80), dmin = rdh(b + 82);
        const uint8_t *q = b + 16;
        int is = 0;
        for (int n = 0; n < QK_K; n += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; half++) {
                    const uint8_t sc = b[is++];
                    const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                    for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
                }
            }
        }
        break;
    }
    case FMT_Q3_K: { /* hmask[32], qs[64], scales[12] (16 6-bit), d */
        const float d = rdh(b + 108);
        const uint8_t *hm = b, *q = b + 32;
        uint32_t aux[4];
        memcpy(aux, b + 96, 12);
        const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
        const int8_t *sc = (const int8_t *)aux;
        int is = 0;
        uint8_t m = 1;
        for (int n = 0; n < QK_K; n += 128, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
                for (int half = 0; half < 2; half++) {
                    const float dl = d * (float)(sc[is++] - 32);
                    for (int l = 16 * half; l < 16 * half + 16; l++)
                        *y++ = dl * (float)(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                }
            }
        }
        break;
    }
    case FMT_Q4_K: case FMT_Q5_K: { /* d, dmin, scales[12], (Q5_K: qh[32]), qs[128] */
        const int five = fmt == FMT_Q5_K;
        const float d = rdh(b), dmin = rdh(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 16 + 32 * five;
        for (int j = 0; j < 4; j++, q += 32) {
            uint8_t s0, m0, s1, m1;
            scale_min_k4(2 * j, scales, &s0, &m0);
            scale_min_k4(2 * j + 1, scales, &s1, &m1);
            const float d0 = d * (float)s0, mm0 = dmin * (float)m0;
            const float d1 = d * (float)s1, mm1 = dmin * (float)m1;
            for (int l = 0; l < 32; l++) {
                const int h = five ? ((qh[l] >> (2 * j)) & 1) << 4 : 0;
                *y++ = d0 * (float)((q[l] & 0xF) + h) - mm0;
            }
            for (int l = 0; l < 32; l++) {
                const int h = five ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0;
                *y++ = d1 * (float)((q[l] >> 4) + h) - mm1;
            }
        }
        break;
    }
    case FMT_Q6_K: { /* ql[128], qh[64], scales[16] int8, d */
        const float d = rdh(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            /* in halves of 16 with their scales hoisted, so the compiler vectorizes the loop
             * (a scale picked per element kept it scalar: 1.4 G weights/s, now ~5) */
            for (int is = 0; is < 2; is++) {
                const float s1 = d * (float)sc[is], s2 = d * (float)sc[is + 2];
                const float s3 = d * (float)sc[is + 4], s4 = d * (float)sc[is + 6];
                for (int l = 16 * is; l < 16 * is + 16; l++) {
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = s1 * (float)q1;
                    y[l + 32] = s2 * (float)q2;
                    y[l + 64] = s3 * (float)q3;
                    y[l + 96] = s4 * (float)q4;
                }
            }
        }
        break;
    }
    default: break;
    }
}

/* Any block format . float32 x: each block decoded to float32, then multiplied (the
 * reference path; also every format's dot product where no AVX2 kernel exists). */
static float dot_generic(int fmt, const uint8_t *row, const float *x, int k) {
    const int bl = block_len(fmt), bb = block_bytes(fmt);
    float w[QK_K];
    float s = 0.0f;
#ifdef CB_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < k / bl; j++, row += bb, x += bl) {
        dequant_block(fmt, row, w);
        for (int i = 0; i < bl; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
    }
    s = hsum256(acc);
#elif defined(CB_NEON)
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int j = 0; j < k / bl; j++, row += bb, x += bl) {
        dequant_block(fmt, row, w);
        for (int i = 0; i < bl; i += 4) acc = vfmaq_f32(acc, vld1q_f32(w + i), vld1q_f32(x + i));
    }
    s = vaddvq_f32(acc);
#else
    for (int j = 0; j < k / bl; j++, row += bb, x += bl) {
        dequant_block(fmt, row, w);
        for (int i = 0; i < bl; i++) s += w[i] * x[i];
    }
#endif
    return s;
}

static float dot_f16(const uint16_t *w, const float *x, int k) {
    int i = 0;
    float s = 0.0f;
#ifdef CB_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8))),
                             _mm256_loadu_ps(x + i + 8), a1);
    }
    s = hsum256(_mm256_add_ps(a0, a1));
#elif defined(CB_NEON)
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0;
    for (; i + 8 <= k; i += 8) {
        a0 = vfmaq_f32(a0, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(w + i))), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(w + i + 4))), vld1q_f32(x + i + 4));
    }
    s = vaddvq_f32(vaddq_f32(a0, a1));
#endif
    for (; i < k; i++) s += fp16_to_f32(w[i]) * x[i];
    return s;
}

#ifdef CB_AVX2
/* Q4_K / Q5_K . float32 x: per sub-block of 32, d*sc * sum(q x) - dmin*m * sum(x) (the
 * block sums of x come with the Vec), so the weights are never scaled one by one. */
static float dot_q45_k(int five, const uint8_t *row, const float *x, const float *xsum, int k) {
    const int nb = k / QK_K, bb = five ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
    __m256 acc = _mm256_setzero_ps();
    float ms = 0.0f;
    for (int i = 0; i < nb; i++, row += bb, x += QK_K, xsum += 8) {
        const float d = rdh(row), dmin = rdh(row + 2);
        const uint8_t *scales = row + 4, *qh = row + 16, *q = row + 16 + 32 * five;
        for (int j = 0; j < 4; j++, q += 32) {
            __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
            for (int l = 0; l < 32; l += 8) {
                const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + l)));
                __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_srli_epi32(w, 4);
                if (five) {
                    const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * j), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * j + 1), one), 4));
                }
                p0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_loadu_ps(x + 64 * j + l), p0);
                p1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_loadu_ps(x + 64 * j + 32 + l), p1);
            }
            uint8_t s0, m0, s1, m1;
            scale_min_k4(2 * j, scales, &s0, &m0);
            scale_min_k4(2 * j + 1, scales, &s1, &m1);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)s0), p0, acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)s1), p1, acc);
            ms += dmin * ((float)m0 * xsum[2 * j] + (float)m1 * xsum[2 * j + 1]);
        }
    }
    return hsum256(acc) - ms;
}

/* Q4_0 / Q5_0 / Q5_1 . float32 x: per block d * sum(q x) + (the offset term) * sum(x), with
 * the offset -8 d (Q4_0), -16 d (Q5_0) or m (Q5_1); the 5th bits spread over lanes by srlv. */
static float dot_q45_0(int fmt, const uint8_t *row, const float *x, const float *xsum, int k) {
    const int nb = k / QK, bb = block_bytes(fmt), five = fmt != FMT_Q4_0, with_m = fmt == FMT_Q5_1;
    const int qs_at = five ? 6 + 2 * with_m : 2;
    const float off = fmt == FMT_Q4_0 ? -8.0f : -16.0f;
    const __m256i m4 = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc = _mm256_setzero_ps();
    float ms = 0.0f;
    for (int j = 0; j < nb; j++, row += bb, x += QK) {
        const float d = rdh(row);
        uint32_t qh = 0;
        if (five) memcpy(&qh, row + 2 + 2 * with_m, 4);
        const uint8_t *qs = row + qs_at;
        __m256 p = _mm256_setzero_ps();
        for (int o = 0; o < 16; o += 8) {
            const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + o)));
            __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_srli_epi32(w, 4);
            if (five) {
                const __m256i h0 = _mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> o)), lanes);
                const __m256i h1 = _mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> (o + 16))), lanes);
                lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(h0, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(h1, one), 4));
            }
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_loadu_ps(x + o), p);
            p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_loadu_ps(x + 16 + o), p);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), p, acc);
        ms += (with_m ? rdh(row + 2) : off * d) * xsum[j];
    }
    return hsum256(acc) + ms;
}

/* Q6_K . float32 x: per sub-block of 16, d*sc * sum((q - 32) x). */
static float dot_q6_k(const uint8_t *row, const float *x, int k) {
    const int nb = k / QK_K;
    const __m256i m4 = _mm256_set1_epi32(0x0f), m2 = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, row += 210) {
        const float d = rdh(row + 208);
        const uint8_t *ql = row, *qh = row + 128;
        const int8_t *sc = (const int8_t *)(row + 192);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, x += 128) {
            for (int is = 0; is < 2; is++) {
                __m256 p1 = _mm256_setzero_ps(), p2 = p1, p3 = p1, p4 = p1;
                for (int l = 16 * is; l < 16 * is + 16; l += 8) {
                    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + l)));
                    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + l + 32)));
                    const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
#define CB_Q6(lo4, sh) _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo4, \
        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, sh), m2), 4)), off))
                    p1 = _mm256_fmadd_ps(CB_Q6(_mm256_and_si256(a, m4), 0), _mm256_loadu_ps(x + l), p1);
                    p2 = _mm256_fmadd_ps(CB_Q6(_mm256_and_si256(b, m4), 2), _mm256_loadu_ps(x + l + 32), p2);
                    p3 = _mm256_fmadd_ps(CB_Q6(_mm256_srli_epi32(a, 4), 4), _mm256_loadu_ps(x + l + 64), p3);
                    p4 = _mm256_fmadd_ps(CB_Q6(_mm256_srli_epi32(b, 4), 6), _mm256_loadu_ps(x + l + 96), p4);
#undef CB_Q6
                }
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[is]), p1, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[is + 2]), p2, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[is + 4]), p3, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[is + 6]), p4, acc);
            }
        }
    }
    return hsum256(acc);
}
#elif defined(CB_NEON)
/* The AVX2 products above on NEON, in the same terms: per (sub-)block the weights' integers
 * times x, then the float scale once. */
static float dot_q45_k(int five, const uint8_t *row, const float *x, const float *xsum, int k) {
    const int nb = k / QK_K, bb = five ? 176 : 144;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), b4 = vdupq_n_u8(0x10);
    float32x4_t acc = vdupq_n_f32(0.0f);
    float ms = 0.0f;
    for (int i = 0; i < nb; i++, row += bb, x += QK_K, xsum += 8) {
        const float d = rdh(row), dmin = rdh(row + 2);
        const uint8_t *scales = row + 4, *qh = row + 16, *q = row + 16 + 32 * five;
        for (int j = 0; j < 4; j++, q += 32) {
            float32x4_t p0 = vdupq_n_f32(0.0f), p1 = p0;
            for (int l = 0; l < 32; l += 16) {
                const uint8x16_t w = vld1q_u8(q + l);
                uint8x16_t lo = vandq_u8(w, m4), hi = vshrq_n_u8(w, 4);
                if (five) { /* bit 2j of qh[l] to bit 4 for the low nibble, 2j + 1 for the high */
                    const uint8x16_t h = vld1q_u8(qh + l);
                    lo = vorrq_u8(lo, vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(4 - 2 * j))), b4));
                    hi = vorrq_u8(hi, vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(3 - 2 * j))), b4));
                }
                p0 = fma_u8x16(p0, lo, x + 64 * j + l);
                p1 = fma_u8x16(p1, hi, x + 64 * j + 32 + l);
            }
            uint8_t s0, m0, s1, m1;
            scale_min_k4(2 * j, scales, &s0, &m0);
            scale_min_k4(2 * j + 1, scales, &s1, &m1);
            acc = vfmaq_n_f32(acc, p0, d * (float)s0);
            acc = vfmaq_n_f32(acc, p1, d * (float)s1);
            ms += dmin * ((float)m0 * xsum[2 * j] + (float)m1 * xsum[2 * j + 1]);
        }
    }
    return vaddvq_f32(acc) - ms;
}

static float dot_q45_0(int fmt, const uint8_t *row, const float *x, const float *xsum, int k) {
    const int nb = k / QK, bb = block_bytes(fmt), five = fmt != FMT_Q4_0, with_m = fmt == FMT_Q5_1;
    const int qs_at = five ? 6 + 2 * with_m : 2;
    const float off = fmt == FMT_Q4_0 ? -8.0f : -16.0f;
    float32x4_t acc = vdupq_n_f32(0.0f);
    float ms = 0.0f;
    for (int j = 0; j < nb; j++, row += bb, x += QK) {
        const float d = rdh(row);
        const uint8x16_t raw = vld1q_u8(row + qs_at);
        uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(raw, 4);
        if (five) {
            uint32_t qh;
            memcpy(&qh, row + 2 + 2 * with_m, 4);
            lo = vorrq_u8(lo, bit4_from_bits16(qh));
            hi = vorrq_u8(hi, bit4_from_bits16(qh >> 16));
        }
        const float32x4_t p = fma_u8x16(fma_u8x16(vdupq_n_f32(0.0f), lo, x), hi, x + 16);
        acc = vfmaq_n_f32(acc, p, d);
        ms += (with_m ? rdh(row + 2) : off * d) * xsum[j];
    }
    return vaddvq_f32(acc) + ms;
}

static float dot_q6_k(const uint8_t *row, const float *x, int k) {
    const int nb = k / QK_K;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int i = 0; i < nb; i++, row += 210) {
        const float d = rdh(row + 208);
        const int8_t *sc = (const int8_t *)(row + 192);
        for (int n = 0; n < 2; n++, x += 128) {
            for (int t = 0; t < 4; t++) {
                for (int u = 0; u < 2; u++) { /* values 32 t + 16 u.., scale 8 n + 2 t + u */
                    const int8x16_t q = q6_16(row + 64 * n, row + 128 + 32 * n, t, u);
                    const float32x4_t p = fma_s8x16(vdupq_n_f32(0.0f), q, x + 32 * t + 16 * u);
                    acc = vfmaq_n_f32(acc, p, d * (float)sc[8 * n + 2 * t + u]);
                }
            }
        }
    }
    return vaddvq_f32(acc);
}
#endif

static size_t row_bytes(const Mat *m) {
    return (size_t)(m->cols / block_len(m->fmt)) * (size_t)block_bytes(m->fmt);
}

/* An input vector of a matrix product, with what the block formats need of it: block sums
 * (the min term of Q4_1), and for integer dot products an integer copy: ACT_Q8: int8 per
 * block of 32 in `q`, a scale `qd` and the scale times the block's integer sum `qs` (as
 * ggml's Q8_1); ACT_I16: int16 in `q16`, `qd` and `qs` as for ACT_Q8, and for the K-quants
 * (made on first use, `prepare_k`) int16 per super-block of 256 in `k16`, its scale `kd`
 * and the integer sum of each block of 32 in `kbs` (exact as a float: |sum| <= 32 x 32767). */
typedef struct {
    const float *x;
    float *xsum; /* [k / 32] */
    int8_t *q;   /* [k] */
    int16_t *q16; /* [k] */
    float *qd;   /* [k / 32] */
    float *qs;   /* [k / 32] */
    int16_t *k16; /* [k] */
    float *kd;    /* [k / 256] */
    float *kbs;   /* [k / 32] */
    uint8_t *kl;  /* [k] with AVX-512 VNNI (prepare_k): the bytes of k16 = 256 kh + kl, the */
    int8_t *kh;   /* [k] blocks of 32 of a super-block in the order 0 2 1 3 4 6 5 7 (dot_q45_k_b8_) */
    int8_t *khe;  /* [8 k] int16 inputs' bytes for the 8-row tiles (prepare_x8): every 4 of kh */
    uint8_t *kle; /* [8 k] and of kl (x = 256 kh + kl, kl unsigned) 8 times over, 32 bytes a 4 */
    int32_t *ks16; /* [k / 16] the integer sum of each 16 of k16 (Q6_K tiles) */
    int8_t *kc;    /* [k] int8 inputs (ACT_Q8) for the tiles (prepare_x8): k16 as bytes, in khe's
                    * place (a vector is int8 or int16, and so has one form or the other) */
    int act;
    int k;
    int kready, bready, xready; /* the K-quant form, the per-block form, the tiles' form made */
} Vec;

/* The arrays of a Vec of up to w values, in floats, in the order vec_place lays them out. */
#define VEC_PARTS 13
static void vec_parts(int w, long parts[VEC_PARTS]) {
    const long nb = w / QK + 1;
    const long n[VEC_PARTS] = {nb, nb, nb, w / 4 + 1, w / 2 + 1, w / 2 + 1, w / QK_K + 1, nb, w / 4 + 1, w / 4 + 1,
                               2L * w + 8, 2L * w + 8, w / 16 + 1};
    for (int i = 0; i < VEC_PARTS; i++) parts[i] = (n[i] + 15) / 16 * 16; /* whole 64-byte lines */
}

/* Floats of scratch a Vec of up to w values takes. */
static long vec_floats(int w) {
    long parts[VEC_PARTS], n = 0;
    vec_parts(w, parts);
    for (int i = 0; i < VEC_PARTS; i++) n += parts[i];
    return n;
}

/* Point the arrays of `v` into `base` (vec_floats(w) floats). */
static void vec_place(Vec *v, float *base, int w) {
    long parts[VEC_PARTS];
    float *p[VEC_PARTS];
    vec_parts(w, parts);
    for (int i = 0; i < VEC_PARTS; i++) {
        p[i] = base;
        base += parts[i];
    }
    v->xsum = p[0];
    v->qd = p[1];
    v->qs = p[2];
    v->q = (int8_t *)p[3];
    v->q16 = (int16_t *)p[4];
    v->k16 = (int16_t *)p[5];
    v->kd = p[6];
    v->kbs = p[7];
    v->kl = (uint8_t *)p[8];
    v->kh = (int8_t *)p[9];
    v->khe = (int8_t *)p[10];
    v->kle = (uint8_t *)p[11];
    v->ks16 = (int32_t *)p[12];
    v->kc = v->khe;
}

/* Take x as the input of the next products; its forms are made as they are needed
 * (`ready_for`). */
static void prepare_vec(Vec *v, const float *x, int k, int act) {
    v->x = x;
    v->k = k;
    v->kready = v->bready = v->xready = 0;
    v->act = k % QK == 0 ? act : ACT_F32;
}

/* The per-block form: block sums, and the int8 or int16 values of ACT_Q8 / ACT_I16. */
static void prepare_blocks(Vec *v) {
    if (v->bready) return;
    v->bready = 1;
    const float *x = v->x;
    for (int j = 0; j < v->k / QK; j++) {
        const float *b = x + j * QK;
        float s = 0.0f, amax = 0.0f;
        for (int i = 0; i < QK; i++) {
            s += b[i];
            amax = fabsf(b[i]) > amax ? fabsf(b[i]) : amax;
        }
        v->xsum[j] = s;
        if (v->act == ACT_Q8) {
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                const int q = (int)nearbyintf(b[i] * id);
                v->q[j * QK + i] = (int8_t)q;
                v->q16[j * QK + i] = (int16_t)q; /* the int16 products of Q4_0/Q5_0/Q5_1 read these */
                sum += q;
            }
            v->qd[j] = d;
            v->qs[j] = d * (float)sum;
        } else if (v->act == ACT_I16) {
            const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                const int q = (int)nearbyintf(b[i] * id);
                v->q16[j * QK + i] = (int16_t)q;
                sum += q;
            }
            v->qd[j] = d;
            v->qs[j] = d * (float)sum;
        }
    }
}

/* The largest integer of the K-quant form: int16 inputs, or int8 ones (ACT_Q8, ggml's Q8_K) */
static inline float k_top(const Vec *v) { return v->act == ACT_Q8 ? 127.0f : 32767.0f; }

#ifdef CB_AVX2
/* The K-quant form of an ACT_I16 or ACT_Q8 vector (once per vector, before its first K-quant product;
 * a vector shared by threads must be made ready before they start). One scale per
 * super-block lets a whole super-block's products add up in int32 before one conversion to
 * float, as the K-quants' own integer sub-block scales allow; int16 is still 128x finer than
 * llama.cpp's int8 per 256 (ggml's Q8_K), which ACT_Q8 is. */
static void prepare_k(Vec *v) {
    if (v->kready) return; /* ready_for calls it for int16 inputs of whole super-blocks only */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < v->k / QK_K; i++) {
        const float *b = v->x + i * QK_K;
        __m256 mx = _mm256_setzero_ps();
        for (int t = 0; t < QK_K; t += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(b + t)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / k_top(v), id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        for (int j = 0; j < QK_K / QK; j++) {
            __m256i sum = _mm256_setzero_si256();
            for (int t = j * QK; t < (j + 1) * QK; t += 16) {
                /* round to nearest even, as nearbyintf */
                const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(b + t), vid));
                const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(b + t + 8), vid));
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(q0, q1));
                /* packs works per 128-bit lane: put the quads back in order */
                const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);
                _mm256_storeu_si256((__m256i *)(v->k16 + i * QK_K + t), q16);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                /* the bytes of block j of 8 in place j with bits 0 and 1 swapped (kl, kh) */
                const int at = i * QK_K + QK * ((j & 4) | ((j & 1) << 1) | ((j >> 1) & 1)) + t - j * QK;
                _mm_storeu_si128((__m128i *)(v->kl + at), _mm256_cvtepi16_epi8(_mm256_and_si256(q16, _mm256_set1_epi16(0xff))));
                _mm_storeu_si128((__m128i *)(v->kh + at), _mm256_cvtepi16_epi8(_mm256_srai_epi16(q16, 8)));
#endif
            }
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            v->kbs[i * (QK_K / QK) + j] = (float)_mm_cvtsi128_si32(s4);
        }
        v->kd[i] = d;
    }
    v->kready = 1;
}
#elif defined(CB_NEON)
/* prepare_k above on NEON: the same int16 values (round to nearest even) and sums */
static void prepare_k(Vec *v) {
    if (v->kready) return;
    for (int i = 0; i < v->k / QK_K; i++) {
        const float *b = v->x + i * QK_K;
        float32x4_t mx = vdupq_n_f32(0.0f);
        for (int t = 0; t < QK_K; t += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(b + t)));
        const float amax = vmaxvq_f32(mx);
        const float d = amax / k_top(v), id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK_K / QK; j++) {
            int32x4_t sum = vdupq_n_s32(0);
            for (int t = j * QK; t < (j + 1) * QK; t += 8) {
                const int32x4_t q0 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(b + t), id));
                const int32x4_t q1 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(b + t + 4), id));
                sum = vaddq_s32(sum, vaddq_s32(q0, q1));
                vst1q_s16(v->k16 + i * QK_K + t, vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1)));
            }
            v->kbs[i * (QK_K / QK) + j] = (float)vaddvq_s32(sum);
        }
        v->kd[i] = d;
    }
    v->kready = 1;
}
#endif

static inline int is_k_quant(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K; }

#ifdef CB_AVX2
static inline __m256 sum_i16_pairs_ps(__m256i x) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(x, _mm256_set1_epi16(1)));
}
#endif

/* Q8_0 weights . Q8 activations */
static float dot_q8_0_q8(const block_q8_0 *b, const Vec *v, int k) {
    const int nb = k / QK;
#ifdef CB_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)b[j].qs);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(v->q + j * QK));
        /* maddubs wants unsigned x signed: move the sign of w onto x */
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(b[j].d) * v->qd[j]), sum_i16_pairs_ps(p), acc);
    }
    return hsum256(acc);
#elif defined(CB_NEON)
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        const int8_t *x = v->q + j * QK;
        const int d = dot_i8x32(vld1q_s8(b[j].qs), vld1q_s8(x), vld1q_s8(b[j].qs + 16), vld1q_s8(x + 16));
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
    }
    return s;
#else
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        int d = 0;
        for (int i = 0; i < QK; i++) d += b[j].qs[i] * v->q[j * QK + i];
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
    }
    return s;
#endif
}

/* Q4_1 weights . Q8 activations: sum over blocks of d dx sum(q qx) + m (dx sum(qx)) */
static float dot_q4_1_q8(const block_q4_1 *b, const Vec *v, int k) {
    const int nb = k / QK;
    float ms = 0.0f;
#ifdef CB_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)b[j].qs);
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(v->q + j * QK));
        const __m256i p = _mm256_maddubs_epi16(w, x);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(b[j].d) * v->qd[j]), sum_i16_pairs_ps(p), acc);
        ms += fp16_to_f32(b[j].m) * v->qs[j];
    }
    return hsum256(acc) + ms;
#elif defined(CB_NEON)
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        const uint8x16_t raw = vld1q_u8(b[j].qs);
        const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0f)));
        const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
        const int8_t *x = v->q + j * QK;
        const int d = dot_i8x32(lo, vld1q_s8(x), hi, vld1q_s8(x + 16));
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
        ms += fp16_to_f32(b[j].m) * v->qs[j];
    }
    return s + ms;
#else
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        int d = 0;
        for (int i = 0; i < QK / 2; i++)
            d += (b[j].qs[i] & 0x0f) * v->q[j * QK + i] + (b[j].qs[i] >> 4) * v->q[j * QK + i + 16];
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
        ms += fp16_to_f32(b[j].m) * v->qs[j];
    }
    return s + ms;
#endif
}

#ifdef CB_AVX2
/* sum(w x) over one block of 32 as 8 float partial sums: w widened to int16 (w0: the first
 * 16, w1: the last 16), x int16, products summed in pairs (madd) */
static inline __m256 i16_block_sums(__m256i w0, __m256i w1, const int16_t *x) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x);
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)));
}

/* acc + d dx sum(q qx) for block j */
static inline __m256 q8_0_i16_block(const block_q8_0 *b, const Vec *v, int j, __m256 acc) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[j].qs));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b[j].qs + 16)));
    const __m256 scale = _mm256_set1_ps(fp16_to_f32(b[j].d) * v->qd[j]);
    return _mm256_fmadd_ps(scale, i16_block_sums(w0, w1, v->q16 + j * QK), acc);
}

static inline __m256 q4_1_i16_block(const block_q4_1 *b, const Vec *v, int j, __m256 acc) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i raw = _mm_loadu_si128((const __m128i *)b[j].qs);
    const __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
    const __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    const __m256 scale = _mm256_set1_ps(fp16_to_f32(b[j].d) * v->qd[j]);
    return _mm256_fmadd_ps(scale, i16_block_sums(w0, w1, v->q16 + j * QK), acc);
}
#endif

/* Q8_0 weights . I16 activations, per block. Two blocks per step into two accumulators:
 * one chain of dependent FMAs would leave the core waiting on their latency. */
static float dot_q8_0_i16(const block_q8_0 *b, const Vec *v, int k) {
    const int nb = k / QK;
#if defined(__AVX512BW__) && defined(CB_AVX2)
    __m512 acc = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int j = 0;
    for (; j + 2 <= nb; j += 2) {
        _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);
#define Q8_BLOCK(J, ACC)                                                                                        \
        ACC = _mm512_fmadd_ps(_mm512_set1_ps(fp16_to_f32(b[J].d) * v->qd[J]),                                   \
                              _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(     \
                                  (const __m256i *)b[J].qs)), _mm512_loadu_si512(v->q16 + (J) * QK))), ACC)
        Q8_BLOCK(j, acc);
        Q8_BLOCK(j + 1, acc1);
    }
    if (j < nb) Q8_BLOCK(j, acc);
#undef Q8_BLOCK
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc1));
#elif defined(CB_AVX2)
    __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 2 <= nb; j += 2) {
        _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);
        acc = q8_0_i16_block(b, v, j, acc);
        acc1 = q8_0_i16_block(b, v, j + 1, acc1);
    }
    if (j < nb) acc = q8_0_i16_block(b, v, j, acc);
    return hsum256(_mm256_add_ps(acc, acc1));
#elif defined(CB_NEON)
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        const int d = dot_s8_i16x32(vld1q_s8(b[j].qs), vld1q_s8(b[j].qs + 16), v->q16 + j * QK);
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
    }
    return s;
#else
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        int d = 0;
        for (int i = 0; i < QK; i++) d += b[j].qs[i] * v->q16[j * QK + i];
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
    }
    return s;
#endif
}

/* Q4_1 weights . I16 activations: d dx sum(q qx) + m dx sum(qx), per block (the min term
 * from the quantized x too, so the error is that of one consistent x). */
static float dot_q4_1_i16(const block_q4_1 *b, const Vec *v, int k) {
    const int nb = k / QK;
    float ms = 0.0f;
#if defined(__AVX512BW__) && defined(CB_AVX2)
    __m512 acc = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    const __m128i m4 = _mm_set1_epi8(0x0f);
    int j = 0;
    for (; j + 2 <= nb; j += 2) { /* two chains, as in dot_q8_0_i16 */
        _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);
#define Q41_BLOCK(J, ACC)                                                                                      \
        {                                                                                                      \
            const __m128i raw = _mm_loadu_si128((const __m128i *)b[J].qs);                                    \
            const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4)); \
            const __m512i p = _mm512_madd_epi16(_mm512_cvtepu8_epi16(w), _mm512_loadu_si512(v->q16 + (J) * QK)); \
            ACC = _mm512_fmadd_ps(_mm512_set1_ps(fp16_to_f32(b[J].d) * v->qd[J]), _mm512_cvtepi32_ps(p), ACC); \
        }
        Q41_BLOCK(j, acc)
        Q41_BLOCK(j + 1, acc1)
    }
    if (j < nb) Q41_BLOCK(j, acc)
#undef Q41_BLOCK
    for (j = 0; j < nb; j++) ms = fmaf(fp16_to_f32(b[j].m), v->qs[j], ms); /* fused, as the batched one */
    return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc1)) + ms;
#elif defined(CB_AVX2)
    __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 2 <= nb; j += 2) { /* two chains, as in dot_q8_0_i16 */
        _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);
        acc = q4_1_i16_block(b, v, j, acc);
        acc1 = q4_1_i16_block(b, v, j + 1, acc1);
    }
    if (j < nb) acc = q4_1_i16_block(b, v, j, acc);
    for (j = 0; j < nb; j++) ms += fp16_to_f32(b[j].m) * v->qs[j];
    return hsum256(_mm256_add_ps(acc, acc1)) + ms;
#elif defined(CB_NEON)
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        const uint8x16_t raw = vld1q_u8(b[j].qs);
        const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0f)));
        const int d = dot_s8_i16x32(lo, vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), v->q16 + j * QK);
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
        ms += fp16_to_f32(b[j].m) * v->qs[j];
    }
    return s + ms;
#else
    float s = 0.0f;
    for (int j = 0; j < nb; j++) {
        int d = 0;
        for (int i = 0; i < QK / 2; i++)
            d += (b[j].qs[i] & 0x0f) * v->q16[j * QK + i] + (b[j].qs[i] >> 4) * v->q16[j * QK + i + 16];
        s += fp16_to_f32(b[j].d) * v->qd[j] * (float)d;
        ms += fp16_to_f32(b[j].m) * v->qs[j];
    }
    return s + ms;
#endif
}

#ifdef CB_AVX2
/* The other block formats . I16 activations (the `auto` form): the weights' small integers
 * widen to int16, products with the int16 activations are exact integer sums (madd), and
 * each block's or sub-block's float scale multiplies them once. */

/* 32 unsigned bytes -> 8 float partial sums of (w - zero) x over one block of 32 */
static inline __m256 u8_block_sums(__m256i w, int zero, const int16_t *x) {
    const __m256i z = _mm256_set1_epi16((short)zero);
    const __m256i w0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), z);
    const __m256i w1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1)), z);
    return i16_block_sums(w0, w1, x);
}

/* 16 nibble bytes -> 32 bytes: the low nibbles (elements 0-15), then the high ones (16-31) */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

/* 32 bits -> 32 bytes, byte i = 0x10 where bit i is set (the 5th bit of Q5_0 / Q5_1) */
static inline __m256i bit4_from_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* The per-block products with 512-bit registers: one block of 32 int16 per register, and the
 * 5th bits of Q5_0 / Q5_1 set through a mask register: about 15 instructions per block where
 * the 256-bit forms take 25. The sums stay exact integers per block. */
static inline __attribute__((always_inline)) float dot_q45_0_i16_512(const int fmt, const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK, five = fmt != FMT_Q4_0, with_m = fmt == FMT_Q5_1;
    const int bb = fmt == FMT_Q4_0 ? 18 : (fmt == FMT_Q5_0 ? 22 : 24);
    const __m512i zero = _mm512_set1_epi16((short)(fmt == FMT_Q4_0 ? 8 : (fmt == FMT_Q5_0 ? 16 : 0)));
    const __m256i m4 = _mm256_set1_epi8(0x0f), b4 = _mm256_set1_epi8(0x10);
    __m512 acc = _mm512_setzero_ps();
    float ms = 0.0f;
    for (int j = 0; j < nb; j++, row += bb) {
        _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(row + (five ? 6 + 2 * with_m : 2)));
        __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
        if (five) {
            uint32_t qh;
            memcpy(&qh, row + 2 + 2 * with_m, 4);
            w = _mm256_mask_add_epi8(w, _cvtu32_mask32(qh), w, b4); /* + 16 = | 16 on a nibble */
        }
        const __m512i q = _mm512_sub_epi16(_mm512_cvtepu8_epi16(w), zero);
        const __m512i p = _mm512_madd_epi16(q, _mm512_loadu_si512(v->q16 + j * QK));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(rdh(row) * v->qd[j]), _mm512_cvtepi32_ps(p), acc);
        if (with_m) ms += rdh(row + 2) * v->qs[j];
    }
    return _mm512_reduce_add_ps(acc) + ms;
}

static float dot_q45_0_i16(int fmt, const uint8_t *row, const Vec *v, int k) {
    switch (fmt) {
    case FMT_Q4_0: return dot_q45_0_i16_512(FMT_Q4_0, row, v, k);
    case FMT_Q5_0: return dot_q45_0_i16_512(FMT_Q5_0, row, v, k);
    default: return dot_q45_0_i16_512(FMT_Q5_1, row, v, k);
    }
}
#else
/* Q4_0 / Q5_0 / Q5_1: d dx sum((q - zero) qx) per block, plus m dx sum(qx) for Q5_1 */
static float dot_q45_0_i16(int fmt, const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK, bb = block_bytes(fmt), five = fmt != FMT_Q4_0, with_m = fmt == FMT_Q5_1;
    const int zero = fmt == FMT_Q4_0 ? 8 : (fmt == FMT_Q5_0 ? 16 : 0);
    __m256 acc = _mm256_setzero_ps();
    float ms = 0.0f;
    for (int j = 0; j < nb; j++, row += bb) {
        _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);
        __m256i w = nibbles32(row + (five ? 6 + 2 * with_m : 2));
        if (five) {
            uint32_t qh;
            memcpy(&qh, row + 2 + 2 * with_m, 4);
            w = _mm256_or_si256(w, bit4_from_bits(qh));
        }
        const __m256 p = u8_block_sums(w, zero, v->q16 + j * QK);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(rdh(row) * v->qd[j]), p, acc);
        if (with_m) ms += rdh(row + 2) * v->qs[j];
    }
    return hsum256(acc) + ms;
}

#endif
#elif defined(CB_NEON)
/* Q4_0 / Q5_0 / Q5_1 . I16 activations: d dx sum((q - zero) qx) per block (exact), plus
 * m dx sum(qx) for Q5_1 */
static float dot_q45_0_i16(int fmt, const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK, bb = block_bytes(fmt), five = fmt != FMT_Q4_0, with_m = fmt == FMT_Q5_1;
    const int8x16_t zero = vdupq_n_s8((int8_t)(fmt == FMT_Q4_0 ? 8 : (fmt == FMT_Q5_0 ? 16 : 0)));
    float s = 0.0f, ms = 0.0f;
    for (int j = 0; j < nb; j++, row += bb) {
        const uint8x16_t raw = vld1q_u8(row + (five ? 6 + 2 * with_m : 2));
        uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(raw, 4);
        if (five) {
            uint32_t qh;
            memcpy(&qh, row + 2 + 2 * with_m, 4);
            lo = vorrq_u8(lo, bit4_from_bits16(qh));
            hi = vorrq_u8(hi, bit4_from_bits16(qh >> 16));
        }
        const int8x16_t w0 = vsubq_s8(vreinterpretq_s8_u8(lo), zero), w1 = vsubq_s8(vreinterpretq_s8_u8(hi), zero);
        s += rdh(row) * v->qd[j] * (float)dot_s8_i16x32(w0, w1, v->q16 + j * QK);
        if (with_m) ms += rdh(row + 2) * v->qs[j];
    }
    return s + ms;
}
#endif

/* K-quants . K16 activations (int16 per super-block of 256, prepare_k). Each sub-block's
 * integer scale multiplies its 4-6 bit weights in int16 (|q sc| <= 31 x 63, or 32 x 128 for
 * Q6_K), the products with the activations add up in int32 lanes (vpdpwssd, or madd + add),
 * and a super-block (a half for Q6_K) is converted to float once. Bounds of an int32 lane,
 * |x| <= 32767: Q4_K 32 x 15 x 63 x 32767 < 2^31 at 8 lanes (AVX2), Q5_K 32 x 31 x 63 x 32767
 * < 2^31, Q6_K 16 x 32 x 128 x 32767 < 2^31 per half (128 values over 8 lanes). The sums are
 * exact, so the result is the float64 product of the weights with the rounded activations up
 * to float32 rounding of the sub-totals. */

/* the eight 6-bit scales and mins of a Q4_K / Q5_K super-block (its 12 scale bytes) */
static inline void k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t a0, a1, a2;
    memcpy(&a0, s, 4);
    memcpy(&a1, s + 4, 4);
    memcpy(&a2, s + 8, 4);
    const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
    const uint32_t t[4] = {a0 & lo6, (a2 & lo4) | (((a0 >> 6) & lo2) << 4), a1 & lo6,
                           ((a2 >> 4) & lo4) | (((a1 >> 6) & lo2) << 4)};
    memcpy(sc, t, 8);
    memcpy(mn, t + 2, 8);
}

#ifdef CB_AVX2
/* dmin dx sum over the 8 blocks of 32 of m_j sum(qx) (the mins of a Q4_K / Q5_K super-block) */
static inline __m256 k4_mins(const uint8_t mn[8], float dmin_dx, const float *kbs, __m256 acc) {
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    return _mm256_fmadd_ps(_mm256_set1_ps(dmin_dx), _mm256_mul_ps(m, _mm256_loadu_ps(kbs)), acc);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#ifdef __AVX512VNNI__
/* acc + pairwise products, in place: with the intrinsic, GCC copies accumulators at each step
 * (vpdpwssd's destination is also its first source) and spills some of a tile's sixteen to the
 * stack; the batched product ran at 131 GMAC/s that way, 186 like this (one core). */
static inline __attribute__((always_inline)) __m512i dpwt(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
#define DPW512(acc, a, b) dpwt(acc, a, b)
#else
#define DPW512(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

static inline __attribute__((always_inline)) float dot_q45_k_k16_(const int five, const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK_K, bb = five ? 176 : 144;
    const __m512i m4 = _mm512_set1_epi16(0x0f), b4 = _mm512_set1_epi16(0x10);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, row += bb) {
        uint8_t sc[8], mn[8];
        _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)row + PREFETCH + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)row + PREFETCH + 128, _MM_HINT_T0);
        k4_scales(row + 4, sc, mn);
        /* the 8 scales as int16, each spread over a register by vpermw below */
        const __m512i scv = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        const uint8_t *q = row + 16 + 32 * five;
        const int16_t *x = v->k16 + i * QK_K;
        const __m512i hb = five ? _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 16))), 4)
                                : _mm512_setzero_si512();
        __m512i s = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            /* byte l of the 32 holds value l of block 2j (low nibble) and of block 2j+1 (high) */
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * j)));
            __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_srli_epi16(w, 4);
            if (five) { /* the 5th bits: bit 2j of qh[l] for block 2j, bit 2j+1 for 2j+1 */
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_srli_epi16(hb, 2 * j), b4));
                hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(hb, 2 * j + 1), b4));
            }
            lo = _mm512_mullo_epi16(lo, _mm512_permutexvar_epi16(_mm512_set1_epi16((short)(2 * j)), scv));
            hi = _mm512_mullo_epi16(hi, _mm512_permutexvar_epi16(_mm512_set1_epi16((short)(2 * j + 1)), scv));
            s = DPW512(s, lo, _mm512_loadu_si512(x + 64 * j));
            s1 = DPW512(s1, hi, _mm512_loadu_si512(x + 64 * j + 32));
        }
        const float dx = v->kd[i];
        acc = _mm512_fmadd_ps(_mm512_set1_ps(rdh(row) * dx), _mm512_cvtepi32_ps(_mm512_add_epi32(s, s1)), acc);
        accm = k4_mins(mn, rdh(row + 2) * dx, v->kbs + 8 * i, accm);
    }
    return _mm512_reduce_add_ps(acc) - hsum256(accm);
}

#ifdef __AVX512VNNI__
static inline __attribute__((always_inline)) __m512i dpbt(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* Q4_K / Q5_K . K16 activations as their bytes (kl unsigned, kh signed: x = 256 kh + kl), with
 * vpdpbusd: 64 weight bytes an instruction, no widening of the weights and no int16 scale
 * multiply (dot_q45_k_k16_ does both). A 64-byte load of the weights holds in its low nibbles
 * blocks 4h and 4h + 2 and in its high nibbles 4h + 1 and 4h + 3: the order kl and kh are kept
 * in. Each int32 lane sums 4 products of one block (exact: |256 sum(q kh) + sum(q kl)|
 * <= 4 x 31 x 32768); times the block's scale (vpmulld) they add up over the super-block
 * (16 products a lane, < 2^31 as above) to the same integer as dot_q45_k_k16_ makes. */
static inline __attribute__((always_inline)) float dot_q45_k_b8_(const int five, const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK_K, bb = five ? 176 : 144;
    const __m512i m4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
    /* int32 lanes 0-7 take the scale of block 4h + 2u + 0, lanes 8-15 that of 4h + 2u + 2
     * (u = 0: low nibbles, 1: high) */
    const __m512i pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, row += bb) {
        uint8_t sc[8], mn[8];
        _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)row + PREFETCH + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)row + PREFETCH + 128, _MM_HINT_T0);
        k4_scales(row + 4, sc, mn);
        const __m512i scv = _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc));
        const uint8_t *q = row + 16 + 32 * five, *xl = v->kl + i * QK_K;
        const int8_t *xh = v->kh + i * QK_K;
        /* qh[l] twice: bit b of byte l (of 64) is the 5th bit of value l % 32 of block b */
        const __m512i qh = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 16))) : _mm512_setzero_si512();
        __m512i s = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i w = _mm512_loadu_si512(q + 64 * h);
            __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
            if (five) { /* bytes 0-31 test bit 4h (+1 for hi), bytes 32-63 bit 4h + 2 (+1) */
                const __m512i bl = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h))), _mm256_set1_epi8((char)(4 << (4 * h))), 1);
                lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bl), lo, b4);
                hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, _mm512_add_epi8(bl, bl)), hi, b4);
            }
            __m512i tl = dpbt(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xh + 128 * h));
            __m512i th = dpbt(_mm512_setzero_si512(), hi, _mm512_loadu_si512(xh + 128 * h + 64));
            tl = dpbt(_mm512_slli_epi32(tl, 8), _mm512_loadu_si512(xl + 128 * h), lo);
            th = dpbt(_mm512_slli_epi32(th, 8), _mm512_loadu_si512(xl + 128 * h + 64), hi);
            const __m512i pl = _mm512_add_epi32(pick, _mm512_set1_epi32(4 * h));
            s = _mm512_add_epi32(s, _mm512_mullo_epi32(tl, _mm512_permutexvar_epi32(pl, scv)));
            s = _mm512_add_epi32(s, _mm512_mullo_epi32(th, _mm512_permutexvar_epi32(_mm512_add_epi32(pl, _mm512_set1_epi32(1)), scv)));
        }
        const float dx = v->kd[i];
        acc = _mm512_fmadd_ps(_mm512_set1_ps(rdh(row) * dx), _mm512_cvtepi32_ps(s), acc);
        accm = k4_mins(mn, rdh(row + 2) * dx, v->kbs + 8 * i, accm);
    }
    return _mm512_reduce_add_ps(acc) - hsum256(accm);
}

/* one function per format, the format's constant folded in */
static float dot_q45_k_k16(int five, const uint8_t *row, const Vec *v, int k) {
    return five ? dot_q45_k_b8_(1, row, v, k) : dot_q45_k_b8_(0, row, v, k);
}
#else
/* one function per format, the format's constant folded in */
static float dot_q45_k_k16(int five, const uint8_t *row, const Vec *v, int k) {
    return five ? dot_q45_k_k16_(1, row, v, k) : dot_q45_k_k16_(0, row, v, k);
}
#endif

static float dot_q6_k_k16(const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    /* lanes 0-15 of value register r (values 32r..32r+31) take scale 2r, lanes 16-31 2r+1 */
    const __m512i pick = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < nb; i++, row += 210) {
        for (int c = 0; c < 210; c += 64) _mm_prefetch((const char *)row + PREFETCH + c, _MM_HINT_T0);
        const float dd = rdh(row + 208) * v->kd[i];
        const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 192))));
        const int16_t *x = v->k16 + i * QK_K;
        for (int n = 0; n < 2; n++) {
            const __m512i a = _mm512_loadu_si512(row + 64 * n);
            const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 128 + 32 * n));
            const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            /* bytes 0-31: values 0-31 (low nibbles of ql[0..31], bits 0-1 of qh), 32-63: values
             * 32-63 (ql[32..63], bits 2-3); then the high nibbles with bits 4-5 and 6-7 */
            const __m512i A = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(a, m4),
                                              _mm512_and_si512(_mm512_slli_epi16(h01, 4), m30)), off);
            const __m512i B = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4),
                                              _mm512_and_si512(h01, m30)), off);
            const __m512i w[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(A)),
                                  _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(A, 1)),
                                  _mm512_cvtepi8_epi16(_mm512_castsi512_si256(B)),
                                  _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(B, 1))};
            __m512i s = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                const int r = 4 * n + t;
                const __m512i sc = _mm512_permutexvar_epi16(_mm512_add_epi16(pick, _mm512_set1_epi16((short)(2 * r))), scales);
                s = DPW512(s, _mm512_mullo_epi16(w[t], sc), _mm512_loadu_si512(x + 32 * r));
            }
            acc = _mm512_fmadd_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(s), acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}
#else
#ifdef __AVXVNNI__
#define DPW256(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define DPW256(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif

static float dot_q45_k_k16(int five, const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK_K, bb = five ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi16(0x0f), b4 = _mm256_set1_epi16(0x10);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, row += bb) {
        uint8_t sc[8], mn[8];
        k4_scales(row + 4, sc, mn);
        const uint8_t *q = row + 16 + 32 * five;
        const int16_t *x = v->k16 + i * QK_K;
        __m256i s = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i scl = _mm256_set1_epi16((short)sc[2 * j]), sch = _mm256_set1_epi16((short)sc[2 * j + 1]);
            for (int half = 0; half < 2; half++) { /* bytes 16 half .. 16 half + 15 of the 32 */
                const int l = 16 * half;
                const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * j + l)));
                __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_srli_epi16(w, 4);
                if (five) {
                    const __m256i hb = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + 16 + l))), 4);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), b4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), b4));
                }
                s = DPW256(s, _mm256_mullo_epi16(lo, scl), _mm256_loadu_si256((const __m256i *)(x + 64 * j + l)));
                s = DPW256(s, _mm256_mullo_epi16(hi, sch), _mm256_loadu_si256((const __m256i *)(x + 64 * j + 32 + l)));
            }
        }
        const float dx = v->kd[i];
        acc = _mm256_fmadd_ps(_mm256_set1_ps(rdh(row) * dx), _mm256_cvtepi32_ps(s), acc);
        accm = k4_mins(mn, rdh(row + 2) * dx, v->kbs + 8 * i, accm);
    }
    return hsum256(acc) - hsum256(accm);
}

static float dot_q6_k_k16(const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, row += 210) {
        const float dd = rdh(row + 208) * v->kd[i];
        const int8_t *scales = (const int8_t *)(row + 192);
        const int16_t *x = v->k16 + i * QK_K;
        for (int n = 0; n < 2; n++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(row + 64 * n));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(row + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 128 + 32 * n));
            /* values 0-31, 32-63, 64-95, 96-127 of this half, as signed bytes */
            const __m256i q[4] = {
                _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)), off),
                _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)), off),
                _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(h, m30)), off),
                _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                                                _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)), off)};
            __m256i s = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                const int r = 4 * n + t; /* values 32r..32r+31: scales 2r (first 16), 2r+1 */
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q[t]));
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q[t], 1));
                s = DPW256(s, _mm256_mullo_epi16(w0, _mm256_set1_epi16(scales[2 * r])),
                           _mm256_loadu_si256((const __m256i *)(x + 32 * r)));
                s = DPW256(s, _mm256_mullo_epi16(w1, _mm256_set1_epi16(scales[2 * r + 1])),
                           _mm256_loadu_si256((const __m256i *)(x + 32 * r + 16)));
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(s), acc);
        }
    }
    return hsum256(acc);
}
#endif
#endif

#ifdef CB_NEON
/* dmin dx sum over the 8 blocks of 32 of m_j sum(qx), as k4_mins */
static inline float32x4_t k4_mins4(const uint8_t mn[8], float dmin_dx, const float *kbs, float32x4_t acc) {
    const uint16x8_t m = vmovl_u8(vld1_u8(mn));
    const float32x4_t m0 = vcvtq_f32_u32(vmovl_u16(vget_low_u16(m))), m1 = vcvtq_f32_u32(vmovl_high_u16(m));
    acc = vfmaq_n_f32(acc, vmulq_f32(m0, vld1q_f32(kbs)), dmin_dx);
    return vfmaq_n_f32(acc, vmulq_f32(m1, vld1q_f32(kbs + 4)), dmin_dx);
}

/* acc + the products of 16 int16 weights (w0, w1) with x[0..15]: the first four of each
 * eight into lo, the last four into hi, so that a super-block's 256 products spread over 8
 * int32 lanes as on AVX2 (32 per lane: the bounds above hold) */
static inline void mla_i16x16(int32x4_t *lo, int32x4_t *hi, int16x8_t w0, int16x8_t w1, const int16_t *x) {
    const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
    *lo = vmlal_s16(*lo, vget_low_s16(w0), vget_low_s16(x0));
    *hi = vmlal_high_s16(*hi, w0, x0);
    *lo = vmlal_s16(*lo, vget_low_s16(w1), vget_low_s16(x1));
    *hi = vmlal_high_s16(*hi, w1, x1);
}

static float dot_q45_k_k16(int five, const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK_K, bb = five ? 176 : 144;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), b4 = vdupq_n_u8(0x10);
    float32x4_t acc = vdupq_n_f32(0.0f), accm = acc;
    for (int i = 0; i < nb; i++, row += bb) {
        uint8_t sc[8], mn[8];
        k4_scales(row + 4, sc, mn);
        const uint8_t *q = row + 16 + 32 * five, *qh = row + 16;
        const int16_t *x = v->k16 + i * QK_K;
        int32x4_t s0 = vdupq_n_s32(0), s1 = s0;
        for (int j = 0; j < 4; j++) {
            const int16x8_t scl = vdupq_n_s16((int16_t)sc[2 * j]), sch = vdupq_n_s16((int16_t)sc[2 * j + 1]);
            for (int l = 0; l < 32; l += 16) {
                const uint8x16_t w = vld1q_u8(q + 32 * j + l);
                uint8x16_t lo = vandq_u8(w, m4), hi = vshrq_n_u8(w, 4);
                if (five) { /* bit 2j of qh[l] to bit 4 for the low nibble, 2j + 1 for the high */
                    const uint8x16_t h = vld1q_u8(qh + l);
                    lo = vorrq_u8(lo, vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(4 - 2 * j))), b4));
                    hi = vorrq_u8(hi, vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(3 - 2 * j))), b4));
                }
                mla_i16x16(&s0, &s1, vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(lo))), scl),
                           vmulq_s16(vreinterpretq_s16_u16(vmovl_high_u8(lo)), scl), x + 64 * j + l);
                mla_i16x16(&s0, &s1, vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(hi))), sch),
                           vmulq_s16(vreinterpretq_s16_u16(vmovl_high_u8(hi)), sch), x + 64 * j + 32 + l);
            }
        }
        const float dx = v->kd[i];
        acc = vfmaq_n_f32(acc, vaddq_f32(vcvtq_f32_s32(s0), vcvtq_f32_s32(s1)), rdh(row) * dx);
        accm = k4_mins4(mn, rdh(row + 2) * dx, v->kbs + 8 * i, accm);
    }
    return vaddvq_f32(acc) - vaddvq_f32(accm);
}

static float dot_q6_k_k16(const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK_K;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int i = 0; i < nb; i++, row += 210) {
        const float dd = rdh(row + 208) * v->kd[i];
        const int8_t *scales = (const int8_t *)(row + 192);
        const int16_t *x = v->k16 + i * QK_K;
        for (int n = 0; n < 2; n++) {
            int32x4_t s0 = vdupq_n_s32(0), s1 = s0; /* 16 products per lane */
            for (int t = 0; t < 4; t++) {
                for (int u = 0; u < 2; u++) { /* values 32 t + 16 u.. of this half, scale 8 n + 2 t + u */
                    const int8x16_t q = q6_16(row + 64 * n, row + 128 + 32 * n, t, u);
                    const int16x8_t sc = vdupq_n_s16(scales[8 * n + 2 * t + u]);
                    mla_i16x16(&s0, &s1, vmulq_s16(vmovl_s8(vget_low_s8(q)), sc), vmulq_s16(vmovl_high_s8(q), sc),
                               x + 128 * n + 32 * t + 16 * u);
                }
            }
            acc = vfmaq_n_f32(acc, vaddq_f32(vcvtq_f32_s32(s0), vcvtq_f32_s32(s1)), dd);
        }
    }
    return vaddvq_f32(acc);
}
#endif

/* ---------------------------------------------------------------- 8-row tiles (Q4_K, Q6_K)
 *
 * A row's product does the same integer work per weight as any other row's, but its
 * super-blocks also each decode their scales, convert and scale a sum, and the row ends in
 * horizontal sums; at one thread the K-quant products were bound by these, not by memory.
 * chatbot_repack lays a matrix's rows out in tiles of 8 rows: for each super-block, the
 * 8 rows' scales side by side and then their quants 4 bytes at a time, row after row. One
 * vector then holds the same 4 bytes of 8 rows, and everything per super-block (scales, mins,
 * float conversion) is done once for 8 rows in the lanes of one register. The inputs are the
 * int16 of prepare_k as bytes (x = 256 kh + kl), each 4 of them repeated across a vector
 * (prepare_x8): the products are the same integers as the one-row kernels', summed in
 * another order. Same bytes in all; `block_at` gives back any block as ggml lays it out.
 *
 * Tiles (i: super-block; r: row in the tile):
 *   Q4_K (1152 bytes): d[8] fp16, dmin[8] fp16, the 12 scale bytes of each row as three
 *     u32 (a0[8], a1[8], a2[8]), then for each u32 u of the 128 quant bytes (u = 8 j + g:
 *     bytes 32 j + 4 g..) the 8 rows' u (32 bytes).
 *   Q6_K (1680 bytes): d[8] fp16, scales [16][8] (int8), the 32 u32 of ql, the 16 of qh,
 *     each as 8 rows' u32 side by side. */

#define X8 8

static inline int has_tiles(int fmt) { return fmt == FMT_Q4_K || fmt == FMT_Q6_K; }

/* copies between super-block `blk` (ggml's layout) of row r and its tile, either way: the
 * scales, and with `quants` the quants too */
static void tile_move(int fmt, uint8_t *tile, int r, uint8_t *blk, int to_tile, int quants) {
#define TM(b_at, t_at, len) (to_tile ? memcpy(tile + (t_at), blk + (b_at), len) : memcpy(blk + (b_at), tile + (t_at), len))
    if (fmt == FMT_Q4_K) {
        TM(0, 2 * r, 2);
        TM(2, 16 + 2 * r, 2);
        for (int a = 0; a < 3; a++) TM(4 + 4 * a, 32 + 32 * a + 4 * r, 4);
        for (int u = 0; u < 32 * quants; u++) TM(16 + 4 * u, 128 + 32 * u + 4 * r, 4);
    } else { /* ql's 32 u32 and qh's 16, consecutive in both */
        TM(208, 2 * r, 2);
        for (int b = 0; b < 16; b++) TM(192 + b, 16 + 8 * b + r, 1);
        for (int u = 0; u < 48 * quants; u++) TM(4 * u, 144 + 32 * u + 4 * r, 4);
    }
#undef TM
}

/* Block `blk` of row n as ggml lays it out: in place, or gathered from its tile into tmp
 * (block_bytes(m->fmt)). */
static inline const uint8_t *block_at(const Mat *m, int n, int blk, uint8_t *tmp) {
    const size_t rb = row_bytes(m), bb = (size_t)block_bytes(m->fmt);
    if (!m->x8) return (const uint8_t *)m->data + (size_t)n * rb + (size_t)blk * bb;
    uint8_t *tile = (uint8_t *)m->data + (size_t)(n / X8) * X8 * rb + (size_t)blk * X8 * bb;
    tile_move(m->fmt, tile, n % X8, tmp, 0, 1);
    return tmp;
}

/* Row n as ggml lays it out (into tmp, row_bytes(m), where it is in tiles). */
static const uint8_t *row_at(const Mat *m, int n, uint8_t *tmp) {
    if (!m->x8) return (const uint8_t *)m->data + (size_t)n * row_bytes(m);
    const int bb = block_bytes(m->fmt);
    for (int i = 0; i < m->cols / block_len(m->fmt); i++) block_at(m, n, i, tmp + (size_t)i * bb);
    return tmp;
}

/* A buffer of this thread for a row gathered from tiles; grows, never freed (one per thread). */
static uint8_t *row_buffer(size_t bytes) {
    static _Thread_local uint8_t *buf;
    static _Thread_local size_t cap;
    if (bytes > cap) {
        uint8_t *p = realloc(buf, bytes);
        if (!p) return NULL;
        buf = p;
        cap = bytes;
    }
    return buf;
}

#ifdef CB_AVX2
/* v[r] lane c -> v[c] lane r */
static inline void transpose8x8_epi32(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}
#endif

/* Lay `src` (ggml's rows) out in 8-row tiles at `dst` (as many bytes). Returns 0, or -1 where
 * this build has no tile kernels for the format or shape (then nothing is written). */
int chatbot_repack(const Mat *src, void *dst) {
#ifdef CB_AVX2
    if (!has_tiles(src->fmt) || src->x8 || src->rows % X8 || src->cols % QK_K || src->rows < X8) return -1;
    const size_t rb = row_bytes(src), bb = (size_t)block_bytes(src->fmt);
    const int nb = src->cols / QK_K;
    /* the u32 of the quants, 8 rows at a time as an 8 x 8 transpose; the rest by tile_move */
    const int q_at = src->fmt == FMT_Q4_K ? 16 : 0, t_at = src->fmt == FMT_Q4_K ? 128 : 144;
    const int nq = src->fmt == FMT_Q4_K ? 32 : 48; /* Q6_K: ql and qh, consecutive in both */
    for (int g = 0; g < src->rows / X8; g++)
        for (int i = 0; i < nb; i++) {
            uint8_t *tile = (uint8_t *)dst + (size_t)g * X8 * rb + (size_t)i * X8 * bb;
            const uint8_t *blk = (const uint8_t *)src->data + (size_t)g * X8 * rb + (size_t)i * bb;
            for (int r = 0; r < X8; r++) tile_move(src->fmt, tile, r, (uint8_t *)blk + (size_t)r * rb, 1, 0);
            for (int u = 0; u < nq; u += 8) {
                __m256i v[8];
                for (int r = 0; r < X8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(blk + (size_t)r * rb + q_at + 4 * u));
                transpose8x8_epi32(v);
                for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)(tile + t_at + 32 * (u + c)), v[c]);
            }
        }
    return 0;
#else
    (void)src, (void)dst;
    return -1;
#endif
}

#ifdef CB_AVX2
/* The tiles' form of the K-quant form (after prepare_k): int8 inputs (ACT_Q8) as bytes in
 * order (kc), int16 ones as their bytes 8 times over (khe / kle); and the sums of 16. */
static void prepare_x8(Vec *v) {
    if (v->xready) return;
    if (v->act == ACT_Q8) /* |x| <= 127: packs keeps them; it works per 128-bit lane */
        for (int i = 0; i < v->k; i += 32) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(v->k16 + i)), b = _mm256_loadu_si256((const __m256i *)(v->k16 + i + 16));
            _mm256_storeu_si256((__m256i *)(v->kc + i), _mm256_permute4x64_epi64(_mm256_packs_epi16(a, b), 0xD8));
        }
    else
        for (int u = 0; u < v->k / 4; u++) {
            uint32_t h = 0, l = 0;
            for (int t = 0; t < 4; t++) {
                const int x = v->k16[4 * u + t];
                h |= (uint32_t)((x >> 8) & 0xff) << (8 * t); /* arithmetic shift: kh signed */
                l |= (uint32_t)(x & 0xff) << (8 * t);
            }
            _mm256_storeu_si256((__m256i *)(v->khe + 32 * u), _mm256_set1_epi32((int)h));
            _mm256_storeu_si256((__m256i *)(v->kle + 32 * u), _mm256_set1_epi32((int)l));
        }
    for (int b = 0; b < v->k / 16; b++) {
        int s = 0;
        for (int t = 0; t < 16; t++) s += v->k16[16 * b + t];
        v->ks16[b] = s;
    }
    v->xready = 1;
}

/* the prefetch of tile data: to L2 (to L1 it evicts the inputs, which are 16 bytes a value) */
#define TILE_PREFETCH(t, bytes) \
    for (int c_ = 0; c_ < (bytes); c_ += 64) _mm_prefetch((const char *)(t) + PREFETCH + c_, _MM_HINT_T1)

/* Q4_K / Q6_K scales: the four 6-bit scales and mins of each row of a Q4_K tile (byte b of
 * lane r: sub-block b or 4 + b of row r) */
typedef struct {
    __m256i sc03, sc47, mn03, mn47;
} K4Scales;

static inline K4Scales k4_tile_scales(const uint8_t *t) {
    const __m256i l6 = _mm256_set1_epi32(0x3f3f3f3f), l4 = _mm256_set1_epi32(0x0f0f0f0f), l2 = _mm256_set1_epi32(0x03030303);
    const __m256i a0 = _mm256_loadu_si256((const __m256i *)(t + 32)), a1 = _mm256_loadu_si256((const __m256i *)(t + 64)),
                  a2 = _mm256_loadu_si256((const __m256i *)(t + 96));
    K4Scales s;
    s.sc03 = _mm256_and_si256(a0, l6);
    s.sc47 = _mm256_or_si256(_mm256_and_si256(a2, l4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a0, 6), l2), 4));
    s.mn03 = _mm256_and_si256(a1, l6);
    s.mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a2, 4), l4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(a1, 6), l2), 4));
    return s;
}

/* byte b (0..7) of each lane of the scales (sc03 / sc47 as one 8-byte array per lane) */
static inline __m256i k4_lane_byte(__m256i lo4, __m256i hi4, int b) {
    return _mm256_and_si256(_mm256_srli_epi32(b < 4 ? lo4 : hi4, 8 * (b & 3)), _mm256_set1_epi32(0xff));
}

/* sum over the 8 sub-blocks of min_b x block sum_b, per row (float: the sums are exact) */
static inline __m256 k4_tile_mins(const K4Scales *s, const float *kbs) {
    __m256 m = _mm256_mul_ps(_mm256_cvtepi32_ps(k4_lane_byte(s->mn03, s->mn47, 0)), _mm256_set1_ps(kbs[0]));
    for (int b = 1; b < 8; b++) m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(k4_lane_byte(s->mn03, s->mn47, b)), _mm256_set1_ps(kbs[b]), m);
    return m;
}

/* a Q4_K tile's super-block into the 8 rows' sums: d dx sf, and dmin dx times the mins */
static inline void k4_tile_close(const uint8_t *tile, float dx, __m256 sf, const K4Scales *s, const float *kbs,
                                 __m256 *acc, __m256 *accm) {
    const __m256 x = _mm256_set1_ps(dx);
    *acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile)), x), sf, *acc);
    *accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16))), x),
                            k4_tile_mins(s, kbs), *accm);
}

/* the scales of Q6_K sub-block b of the 8 rows, as floats */
static inline __m256 k6_tile_scale(const uint8_t *t, int b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t + 16 + 8 * b))));
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define X8_DPB256 1
#define DPB256(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define X8_DPB256 1
#define DPB256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#endif

/* AVX2: vpmaddubsw pairs (weight byte x input byte, exact in int16: Q4_K 2 x 15 x 255,
 * Q6_K 2 x 63 x 255 for kl, 2 x 15 x 128 and 2 x 63 x 128 for kh) added up in int16 as far as
 * they stay exact (8 kh or 4 kl pairs of Q4_K, 2 kh pairs of Q6_K), then vpmaddwd by the
 * scale (Q4_K) or by 1 / 256. Q4_K's scaled sums of 2 sub-blocks: < 2 x 32 x 15 x 63 x 32767 < 2^31. */
static inline __attribute__((always_inline)) void dot_q4_k_x8_256(const uint8_t *tile, const Vec *v, int k, float *out) {
    const int nb = k / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, tile += 1152) {
        TILE_PREFETCH(tile, 1152);
        const K4Scales s = k4_tile_scales(tile);
        const int8_t *xh = v->khe + (size_t)i * QK_K * 8;
        const uint8_t *xl = v->kle + (size_t)i * QK_K * 8, *q = tile + 128;
        __m256 sf = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            __m256i hA = _mm256_setzero_si256(), hB = hA, lA[2] = {hA, hA}, lB[2] = {hA, hA};
            for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * (8 * j + g)));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                const size_t uA = 32 * (16 * j + g), uB = uA + 32 * 8;
                hA = _mm256_add_epi16(hA, _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xh + uA))));
                hB = _mm256_add_epi16(hB, _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xh + uB))));
                lA[g >> 2] = _mm256_add_epi16(lA[g >> 2], _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(xl + uA)), lo));
                lB[g >> 2] = _mm256_add_epi16(lB[g >> 2], _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(xl + uB)), hi));
            }
            /* each lane's scale as two int16, x 256 for the kh sums */
            const __m256i a = k4_lane_byte(s.sc03, s.sc47, 2 * j), b = k4_lane_byte(s.sc03, s.sc47, 2 * j + 1);
            const __m256i pa = _mm256_or_si256(a, _mm256_slli_epi32(a, 16)), pb = _mm256_or_si256(b, _mm256_slli_epi32(b, 16));
            __m256i S = _mm256_add_epi32(_mm256_madd_epi16(hA, _mm256_slli_epi16(pa, 8)), _mm256_madd_epi16(hB, _mm256_slli_epi16(pb, 8)));
            S = _mm256_add_epi32(S, _mm256_add_epi32(_mm256_madd_epi16(lA[0], pa), _mm256_madd_epi16(lA[1], pa)));
            S = _mm256_add_epi32(S, _mm256_add_epi32(_mm256_madd_epi16(lB[0], pb), _mm256_madd_epi16(lB[1], pb)));
            sf = _mm256_add_ps(sf, _mm256_cvtepi32_ps(S));
        }
        k4_tile_close(tile, v->kd[i], sf, &s, v->kbs + 8 * i, &acc, &accm);
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
}

/* The same with int8 inputs (ACT_Q8: --opt fast, and auto's int8 sites), each step's 4 inputs
 * broadcast from kc: one product per pair of weights where int16 inputs take two. With
 * AVX-VNNI or AVX-512 VNNI, vpdpbusd sums a sub-block in int32 (< 32 x 15 x 127), times its
 * scale with vpmulld; on AVX2, vpmaddubsw pairs add up in int16 (8 x 2 x 15 x 127 < 2^15),
 * then vpmaddwd by the scale. The same integers either way. All builds with AVX2 take this
 * 256-bit one: on AVX-512 VNNI it read a Zen 5 core's memory at 1.2-1.3x the rate of a 512-bit
 * vpdpbusd form (docs/benchmarks.md). */
static void dot_q4_k_x8_i8(const uint8_t *tile, const Vec *v, int k, float *out) {
    const int nb = k / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, tile += 1152) {
        TILE_PREFETCH(tile, 1152);
        const K4Scales s = k4_tile_scales(tile);
        const int8_t *x = v->kc + (size_t)i * QK_K;
        const uint8_t *q = tile + 128;
        __m256 sf = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) { /* sub-blocks 2 j (low nibbles) and 2 j + 1 (high) */
            __m256i hA = _mm256_setzero_si256(), hB = hA;
            for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * (8 * j + g)));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                const __m256i xa = bcast4(x + 4 * (16 * j + g)), xb = bcast4(x + 4 * (16 * j + g + 8));
#ifdef X8_DPB256
                hA = DPB256(hA, lo, xa);
                hB = DPB256(hB, hi, xb);
#else
                hA = _mm256_add_epi16(hA, _mm256_maddubs_epi16(lo, xa));
                hB = _mm256_add_epi16(hB, _mm256_maddubs_epi16(hi, xb));
#endif
            }
            const __m256i a = k4_lane_byte(s.sc03, s.sc47, 2 * j), b = k4_lane_byte(s.sc03, s.sc47, 2 * j + 1);
#ifdef X8_DPB256
            const __m256i S = _mm256_add_epi32(_mm256_mullo_epi32(hA, a), _mm256_mullo_epi32(hB, b));
#else
            const __m256i pa = _mm256_or_si256(a, _mm256_slli_epi32(a, 16)), pb = _mm256_or_si256(b, _mm256_slli_epi32(b, 16));
            const __m256i S = _mm256_add_epi32(_mm256_madd_epi16(hA, pa), _mm256_madd_epi16(hB, pb));
#endif
            sf = _mm256_add_ps(sf, _mm256_cvtepi32_ps(S));
        }
        k4_tile_close(tile, v->kd[i], sf, &s, v->kbs + 8 * i, &acc, &accm);
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* One 512-bit register holds 2 u32 of the tile (u, u + 1: 8 rows each), the inputs' expanded
 * bytes 64 at a time match them. Sums of 32 values per lane pair stay below 2^31:
 * 32 x 15 x 32767 (Q4_K; times a scale of 63: < 2^30), 16 x 63 x 32767 (Q6_K). */
static inline __m256i fold8(__m512i x) { return _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1)); }

/* The 6-bit quants (0..63) of a Q6_K tile's values 128 n + 32 s + 16 h + (0..15) in q[s], two
 * u32 of 8 rows at u32 g and g + 1 (h = g / 4), for the tile products below */
static inline void k6_tile_quants(const uint8_t *tile, int n, int g, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i a = _mm512_loadu_si512(tile + 144 + 32 * (16 * n + g));
    const __m512i b = _mm512_loadu_si512(tile + 144 + 32 * (16 * n + 8 + g));
    const __m512i qh = _mm512_loadu_si512(tile + 1168 + 32 * (8 * n + g));
    q[0] = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30));
    q[1] = _mm512_or_si512(_mm512_and_si512(b, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), m30));
    q[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), _mm512_and_si512(qh, m30));
    q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), m4), _mm512_and_si512(_mm512_srli_epi16(qh, 2), m30));
}

/* The 512-bit form for int16 inputs (its int8 one was slower than dot_q4_k_x8_i8 above): one
 * vpdpbusd per 4 weights and input byte, kh and kl. */
static void dot_q4_k_x8(const uint8_t *tile, const Vec *v, int k, float *out) {
    const int nb = k / QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, tile += 1152) {
        TILE_PREFETCH(tile, 1152);
        const K4Scales s = k4_tile_scales(tile);
        const int8_t *xh = v->khe + (size_t)i * QK_K * 8;
        const uint8_t *xl = v->kle + (size_t)i * QK_K * 8, *q = tile + 128;
        __m256 sf = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) { /* sub-blocks 2j (low nibbles) and 2j + 1 (high) */
            __m512i hA = _mm512_setzero_si512(), lA = hA, hB = hA, lB = hA;
            for (int g = 0; g < 8; g += 2) {
                const __m512i w = _mm512_loadu_si512(q + 32 * (8 * j + g));
                const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
                const size_t uA = 32 * (16 * j + g), uB = uA + 32 * 8;
                hA = dpbt(hA, lo, _mm512_loadu_si512(xh + uA));
                hB = dpbt(hB, hi, _mm512_loadu_si512(xh + uB));
                lA = dpbt(lA, _mm512_loadu_si512(xl + uA), lo);
                lB = dpbt(lB, _mm512_loadu_si512(xl + uB), hi);
            }
            const __m256i A = fold8(_mm512_add_epi32(_mm512_slli_epi32(hA, 8), lA));
            const __m256i B = fold8(_mm512_add_epi32(_mm512_slli_epi32(hB, 8), lB));
            const __m256i S = _mm256_add_epi32(_mm256_mullo_epi32(A, k4_lane_byte(s.sc03, s.sc47, 2 * j)),
                                               _mm256_mullo_epi32(B, k4_lane_byte(s.sc03, s.sc47, 2 * j + 1)));
            sf = _mm256_add_ps(sf, _mm256_cvtepi32_ps(S));
        }
        k4_tile_close(tile, v->kd[i], sf, &s, v->kbs + 8 * i, &acc, &accm);
    }
    _mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));
}

/* u32 0 of p in the low 8 lanes, u32 1 in the high 8: the int8 inputs of a tile's u32 pair
 * (halves: the index vector, made once) */
static inline __m512i x8_halves(const int8_t *p, __m512i halves) {
    return _mm512_permutexvar_epi32(halves, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)p)));
}

/* i8: int8 inputs from kc (u32 pairs spread over the halves, x8_halves), else int16 ones' bytes
 * (khe, kle) */
static inline __attribute__((always_inline)) void dot_q6_k_x8_(const int i8, const uint8_t *tile, const Vec *v, int k, float *out) {
    const int nb = k / QK_K;
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, tile += 1680) {
        TILE_PREFETCH(tile, 1680);
        const int8_t *xh = v->khe + (size_t)i * QK_K * 8;
        const uint8_t *xl = v->kle + (size_t)i * QK_K * 8;
        const int32_t *xs = v->ks16 + 16 * i;
        const int8_t *xc = v->kc + (size_t)i * QK_K;
        __m256 sf = _mm256_setzero_ps();
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) { /* values 128 n + 32 s + 16 h + (0..15): sub-block 8 n + 2 s + h */
                __m512i th[4], tl[4];
                for (int s = 0; s < 4; s++) th[s] = tl[s] = _mm512_setzero_si512();
                for (int g = 4 * h; g < 4 * h + 4; g += 2) {
                    __m512i q[4];
                    k6_tile_quants(tile, n, g, q);
                    for (int s = 0; s < 4; s++) { /* q unsigned (0..63): less 32 x the inputs' sum below */
                        const size_t u = 32 * (32 * n + 8 * s + g);
                        if (i8) {
                            th[s] = dpbt(th[s], q[s], x8_halves(xc + 4 * (32 * n + 8 * s + g), halves));
                        } else {
                            th[s] = dpbt(th[s], q[s], _mm512_loadu_si512(xh + u));
                            tl[s] = dpbt(tl[s], _mm512_loadu_si512(xl + u), q[s]);
                        }
                    }
                }
                for (int s = 0; s < 4; s++) {
                    const int b = 8 * n + 2 * s + h;
                    const __m512i t = i8 ? th[s] : _mm512_add_epi32(_mm512_slli_epi32(th[s], 8), tl[s]);
                    const __m256i T = _mm256_sub_epi32(fold8(t), _mm256_set1_epi32(32 * xs[b]));
                    sf = _mm256_fmadd_ps(k6_tile_scale(tile, b), _mm256_cvtepi32_ps(T), sf);
                }
            }
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile)), _mm256_set1_ps(v->kd[i])), sf, acc);
    }
    _mm256_storeu_ps(out, acc);
}

#else
/* The 6-bit quants (0..63) of a Q6_K tile's values 128 n + 32 s + 16 h + (0..15) in q[s], one
 * u32 of 8 rows at u32 g (h = g / 4), for the tile products below */
static inline void k6_tile_quants(const uint8_t *tile, int n, int g, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256((const __m256i *)(tile + 144 + 32 * (16 * n + g)));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(tile + 144 + 32 * (16 * n + 8 + g)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(tile + 1168 + 32 * (8 * n + g)));
    q[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(qh, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}


static inline __attribute__((always_inline)) void dot_q6_k_x8_(const int i8, const uint8_t *tile, const Vec *v, int k, float *out) {
    const int nb = k / QK_K;
    const __m256i one = _mm256_set1_epi16(1), kh = i8 ? one : _mm256_set1_epi16(256);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, tile += 1680) {
        TILE_PREFETCH(tile, 1680);
        const int8_t *xh = v->khe + (size_t)i * QK_K * 8, *xc = v->kc + (size_t)i * QK_K;
        const uint8_t *xl = v->kle + (size_t)i * QK_K * 8;
        const int32_t *xs = v->ks16 + 16 * i;
        __m256 sf = _mm256_setzero_ps();
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) {
                __m256i T[4], th[4];
                for (int s = 0; s < 4; s++) T[s] = th[s] = _mm256_setzero_si256();
                for (int g = 4 * h; g < 4 * h + 4; g++) {
                    __m256i q[4];
                    k6_tile_quants(tile, n, g, q);
                    for (int s = 0; s < 4; s++) {
                        const size_t u = 32 * (32 * n + 8 * s + g);
                        if (i8) {
                            const __m256i x = bcast4(xc + 4 * (32 * n + 8 * s + g));
#ifdef X8_DPB256
                            T[s] = DPB256(T[s], q[s], x); /* < 16 x 63 x 127 a sub-block */
                            continue;
#else
                            th[s] = _mm256_add_epi16(th[s], _mm256_maddubs_epi16(q[s], x));
#endif
                        } else {
                            th[s] = _mm256_add_epi16(th[s], _mm256_maddubs_epi16(q[s], _mm256_loadu_si256((const __m256i *)(xh + u))));
                        }
                        if (!i8)
                            T[s] = _mm256_add_epi32(T[s], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(xl + u)), q[s]), one));
                        if (g & 1) { /* two kh pairs a lane: < 2^15 */
                            T[s] = _mm256_add_epi32(T[s], _mm256_madd_epi16(th[s], kh));
                            th[s] = _mm256_setzero_si256();
                        }
                    }
                }
                for (int s = 0; s < 4; s++) {
                    const int bk = 8 * n + 2 * s + h;
                    const __m256i D = _mm256_sub_epi32(T[s], _mm256_set1_epi32(32 * xs[bk]));
                    sf = _mm256_fmadd_ps(k6_tile_scale(tile, bk), _mm256_cvtepi32_ps(D), sf);
                }
            }
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile)), _mm256_set1_ps(v->kd[i])), sf, acc);
    }
    _mm256_storeu_ps(out, acc);
}

#endif

/* Each tile product for int16 inputs and for int8 ones (ACT_Q8): Q6_K two copies of one body,
 * Q4_K two bodies (dot_q4_k_x8_i8 above) */
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
static void dot_q4_k_x8(const uint8_t *tile, const Vec *v, int k, float *out) { dot_q4_k_x8_256(tile, v, k, out); }
#endif
static void dot_q6_k_x8(const uint8_t *tile, const Vec *v, int k, float *out) { dot_q6_k_x8_(0, tile, v, k, out); }
static void dot_q6_k_x8_i8(const uint8_t *tile, const Vec *v, int k, float *out) { dot_q6_k_x8_(1, tile, v, k, out); }

/* rows 8 g .. 8 g + 7 of m (in tiles) . v (made ready by ready_for) */
static inline void dot_tile(const Mat *m, int g, const Vec *v, float *out) {
    const uint8_t *tile = (const uint8_t *)m->data + (size_t)g * X8 * row_bytes(m);
    const int i8 = v->act == ACT_Q8;
    if (m->fmt == FMT_Q4_K)
        (i8 ? dot_q4_k_x8_i8 : dot_q4_k_x8)(tile, v, m->cols, out);
    else
        (i8 ? dot_q6_k_x8_i8 : dot_q6_k_x8)(tile, v, m->cols, out);
}
#endif

/* 1 where this build's product of `fmt` (its 8-row tiles with `x8`) takes int8 inputs
 * (ACT_Q8) in fewer instructions than int16 ones: the AVX2 products of Q4_1 and the tile
 * products of Q4_K and Q6_K. Elsewhere int8 inputs run through the int16 products (Q4_0,
 * Q5_0, Q5_1, Q5_K, untiled K-quants, NEON) or are no faster (Q8_0): measured,
 * docs/benchmarks.md. `--opt auto` takes int8 inputs only where this says so. */
int chatbot_int8_faster(int fmt, int x8) {
#ifdef CB_AVX2
    return fmt == FMT_Q4_1 || (x8 && (fmt == FMT_Q4_K || fmt == FMT_Q6_K));
#else
    (void)fmt, (void)x8;
    return 0;
#endif
}

/* Whether the products of m with v run 8 rows at a time (dot_tile) */
static inline int tiled(const Mat *m, const Vec *v) {
#ifdef CB_AVX2
    return m->x8 && (v->act == ACT_I16 || v->act == ACT_Q8) && v->k % QK_K == 0;
#else
    (void)m, (void)v;
    return 0;
#endif
}

static inline float dot_vec(const Mat *m, int n, const Vec *v) {
    const char *row = (const char *)m->data + (size_t)n * row_bytes(m);
    if (m->x8) { /* a row of a tiled matrix alone (other input forms): gathered first */
        uint8_t *buf = row_buffer(row_bytes(m));
        if (!buf) return NAN;
        row = (const char *)row_at(m, n, buf);
    }
    switch (m->fmt) {
    case FMT_F32: return dot_f32((const float *)row, v->x, m->cols);
    case FMT_BF16: return dot_bf16((const uint16_t *)row, v->x, m->cols);
    case FMT_F16: return dot_f16((const uint16_t *)row, v->x, m->cols);
    case FMT_Q8_0:
        switch (v->act) {
        case ACT_Q8: return dot_q8_0_q8((const block_q8_0 *)row, v, m->cols);
        case ACT_I16: return dot_q8_0_i16((const block_q8_0 *)row, v, m->cols);
        default: return dot_q8_0((const block_q8_0 *)row, v->x, m->cols);
        }
    case FMT_Q4_1:
        switch (v->act) {
        case ACT_Q8: return dot_q4_1_q8((const block_q4_1 *)row, v, m->cols);
        case ACT_I16: return dot_q4_1_i16((const block_q4_1 *)row, v, m->cols);
        default: return dot_q4_1((const block_q4_1 *)row, v->x, v->xsum, m->cols);
        }
#if defined(CB_AVX2) || defined(CB_NEON)
    case FMT_Q4_K: case FMT_Q5_K:
        if (v->kready) return dot_q45_k_k16(m->fmt == FMT_Q5_K, (const uint8_t *)row, v, m->cols);
        return dot_q45_k(m->fmt == FMT_Q5_K, (const uint8_t *)row, v->x, v->xsum, m->cols);
    case FMT_Q6_K:
        if (v->kready) return dot_q6_k_k16((const uint8_t *)row, v, m->cols);
        return dot_q6_k((const uint8_t *)row, v->x, m->cols);
    case FMT_Q4_0: case FMT_Q5_0: case FMT_Q5_1:
        /* int8 inputs (ACT_Q8) through the int16 products: exact, and no int8 form of these */
        if (v->act == ACT_I16 || v->act == ACT_Q8) return dot_q45_0_i16(m->fmt, (const uint8_t *)row, v, m->cols);
        return dot_q45_0(m->fmt, (const uint8_t *)row, v->x, v->xsum, m->cols);
#endif
    default: return dot_generic(m->fmt, (const uint8_t *)row, v->x, m->cols);
    }
}

/* Make the form of `v` that products with `m` read: the K-quant form (int16 inputs on AVX2
 * and up, or NEON), else the per-block form. */
static inline void ready_for(Vec *v, const Mat *m) {
#if defined(CB_AVX2) || defined(CB_NEON)
    if (is_k_quant(m->fmt) && (v->act == ACT_I16 || v->act == ACT_Q8) && v->k % QK_K == 0) {
        prepare_k(v);
#ifdef CB_AVX2
        if (m->x8) prepare_x8(v);
#endif
        return;
    }
#endif
    (void)m;
    prepare_blocks(v);
}

/* ---------------------------------------------------------------- threads
 *
 * The parallel code is written against a few calls, so that it builds with OpenMP and
 * without it (clang without libomp, as on macOS), with the same work on the same threads:
 *   team_run(n, fn, arg)  fn(arg) on n threads, the caller one of them; returns when all
 *                         have finished (OpenMP: a parallel region)
 *   team_id(), team_size()  this thread's number in the team, and the team's size
 *   team_share(n)         this thread's iterations of n: OpenMP's schedule(static), the first
 *                         n % size threads taking one more
 *   team_barrier()        no thread goes on before all have come here (an `omp for` ends so)
 *   team_next(&next)      the next iteration of a dynamic schedule (an atomic counter)
 * With OpenMP they are its constructs; without, a pool of our own pthreads (below). Outside
 * team_run the caller is a team of one, as in OpenMP. Which thread computes a row never
 * changes its arithmetic, so the two builds give the same bits. */

typedef struct {
    int lo, hi;
} Span;

static inline int team_id(void);
static inline int team_size(void);

static inline Span team_share(int n) {
    const int size = team_size(), id = team_id(), q = n / size, r = n % size;
    const int lo = q * id + (id < r ? id : r);
    return (Span){lo, lo + q + (id < r)};
}

static inline int team_next(atomic_int *next) {
    return atomic_fetch_add_explicit(next, 1, memory_order_relaxed);
}

/* *to = max(*to, v) for v >= 0 (a reduction): non-negative floats order as their bits do */
static inline void team_max(atomic_uint *to, float v) {
    unsigned bits, old = atomic_load_explicit(to, memory_order_relaxed);
    memcpy(&bits, &v, 4);
    while (bits > old && !atomic_compare_exchange_weak(to, &old, bits)) {
    }
}

static inline float bits_float(unsigned bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef _OPENMP
static inline int team_id(void) { return omp_get_thread_num(); }
static inline int team_size(void) { return omp_get_num_threads(); }
static inline void team_barrier(void) {
#pragma omp barrier
}

static void team_run(int n, void (*fn)(void *), void *arg) {
#pragma omp parallel num_threads(n)
    fn(arg);
}

int chatbot_openmp(void) { return _OPENMP; }
#else
/* The pool: worker i (1..) sleeps on its own word `pool_go[i - 1]` until the caller of a
 * region bumps it; the team then meets at barriers on one word, `pool.phase`, bumped by
 * the last to arrive. A waiting thread spins POOL_SPIN pause-loop iterations, then sleeps on
 * a condition variable: libgomp's wait as engine/threads.py sets it (GOMP_SPINCOUNT), cheap
 * when partners arrive together, and giving the CPU away when one of them is parked. With
 * more threads than CPUs a partner is likely parked: a short spin. Workers stay for the
 * next region; a team larger than any before starts the threads it lacks. */
#define POOL_MAX 256         /* threads in a team at most (more asked for: this many) */
#define POOL_SPIN 10000      /* = engine/threads.py SPIN_COUNT */
#define POOL_SPIN_CROWDED 100
#define POOL_STACK (8 << 20) /* bytes of stack per worker (macOS gives threads 512 KB) */

typedef struct {
    _Alignas(64) atomic_uint word; /* waiters wait for it to change; a cache line each */
    atomic_int sleepers;
    pthread_mutex_t lock;
    pthread_cond_t cond;
} Signal;

static struct {
    pthread_mutex_t run; /* one region at a time: two Python threads may call in at once */
    int started;         /* workers running */
    int size;            /* this region's team */
    void (*fn)(void *);
    void *arg;
    atomic_int spin;
    atomic_int arrived; /* at the current barrier */
    int cpus;
    Signal phase;
} pool = {.run = PTHREAD_MUTEX_INITIALIZER};
static Signal pool_go[POOL_MAX];
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static _Thread_local int pool_id = 0, pool_size = 1;

static inline int team_id(void) { return pool_id; }
static inline int team_size(void) { return pool_size; }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void signal_init(Signal *s) {
    atomic_init(&s->word, 0);
    atomic_init(&s->sleepers, 0);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
}

/* Wait for s->word to differ from `seen`. A sleeper counts itself (seq_cst) before it looks
 * at the word again; signal_bump changes the word (seq_cst) before it looks at the count:
 * one of the two sees the other, so no sleeper misses its wake-up. */
static void signal_wait(Signal *s, unsigned seen) {
    const int spin = atomic_load_explicit(&pool.spin, memory_order_relaxed);
    for (int i = 0; i < spin; i++) {
        if (atomic_load_explicit(&s->word, memory_order_acquire) != seen) return;
        cpu_relax();
    }
    pthread_mutex_lock(&s->lock);
    atomic_fetch_add(&s->sleepers, 1);
    while (atomic_load(&s->word) == seen) pthread_cond_wait(&s->cond, &s->lock);
    atomic_fetch_sub(&s->sleepers, 1);
    pthread_mutex_unlock(&s->lock);
}

static void signal_bump(Signal *s) {
    atomic_fetch_add(&s->word, 1);
    if (atomic_load(&s->sleepers)) {
        pthread_mutex_lock(&s->lock);
        pthread_cond_broadcast(&s->cond);
        pthread_mutex_unlock(&s->lock);
    }
}

static void team_barrier(void) {
    if (pool_size < 2) return;
    /* the phase cannot move on before this thread arrives */
    const unsigned seen = atomic_load_explicit(&pool.phase.word, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == pool_size - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        signal_bump(&pool.phase); /* releases what every thread wrote before it arrived */
    } else {
        signal_wait(&pool.phase, seen);
    }
}

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    Signal *go = &pool_go[id - 1];
    /* one bump per region, and the next one comes after this thread ends the region */
    for (unsigned seen = 0;; seen++) {
        signal_wait(go, seen);
        pool_id = id;
        pool_size = pool.size;
        pool.fn(pool.arg);
        team_barrier();
    }
    return NULL;
}

/* A fork copies only the thread that forks: the child starts its own workers. */
static void pool_fork_prepare(void) { pthread_mutex_lock(&pool.run); }
static void pool_fork_parent(void) { pthread_mutex_unlock(&pool.run); }
static void pool_fork_child(void) {
    pool.started = 0;
    atomic_store(&pool.arrived, 0);
    signal_init(&pool.phase); /* a worker may have held its lock */
    pthread_mutex_unlock(&pool.run);
}

static void pool_setup(void) {
    signal_init(&pool.phase);
    atomic_init(&pool.spin, POOL_SPIN);
    long cpus = 0;
#ifdef _SC_NPROCESSORS_ONLN
    cpus = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    pool.cpus = cpus > 0 ? (int)cpus : POOL_MAX;
    pthread_atfork(pool_fork_prepare, pool_fork_parent, pool_fork_child);
}

/* Start worker `id`; 0 on success. */
static int pool_start(int id) {
    signal_init(&pool_go[id - 1]);
    pthread_attr_t attr;
    if (pthread_attr_init(&attr)) return -1;
    size_t stack = 0;
    pthread_attr_getstacksize(&attr, &stack);
    if (stack < POOL_STACK) pthread_attr_setstacksize(&attr, POOL_STACK);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t thread;
    const int failed = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)id);
    pthread_attr_destroy(&attr);
    return failed;
}

static void team_run(int n, void (*fn)(void *), void *arg) {
    if (n > 1) {
        pthread_once(&pool_once, pool_setup);
        pthread_mutex_lock(&pool.run);
        n = n < POOL_MAX ? n : POOL_MAX;
        while (pool.started < n - 1 && pool_start(pool.started + 1) == 0) pool.started++;
        n = n < pool.started + 1 ? n : pool.started + 1; /* fewer where threads cannot start */
        if (n > 1) {
            pool.size = n;
            pool.fn = fn;
            pool.arg = arg;
            atomic_store_explicit(&pool.spin, n > pool.cpus ? POOL_SPIN_CROWDED : POOL_SPIN, memory_order_relaxed);
            for (int i = 0; i < n - 1; i++) signal_bump(&pool_go[i]);
            pool_id = 0;
            pool_size = n;
            fn(arg);
            team_barrier(); /* the region's end: everyone is done with `arg` */
            pool_size = 1;
            pthread_mutex_unlock(&pool.run);
            return;
        }
        pthread_mutex_unlock(&pool.run);
    }
    fn(arg); /* a team of one */
}

int chatbot_openmp(void) { return 0; }
#endif

/* y = W x; to be called by every thread of a parallel region (rows are shared out), each with
 * its own `v`, or with one shared `v` made ready before the region. */
static void matvec_par(const Mat *m, Vec *v, float *y) {
    ready_for(v, m);
#ifdef CB_AVX2
    if (tiled(m, v)) {
        const Span tiles = team_share(m->rows / X8);
        for (int g = tiles.lo; g < tiles.hi; g++) dot_tile(m, g, v, y + (size_t)g * X8);
        team_barrier();
        return;
    }
#endif
    const Span rows = team_share(m->rows);
    for (int n = rows.lo; n < rows.hi; n++) y[n] = dot_vec(m, n, v);
    team_barrier();
}

/* The rows of a group are shared out 8 at a time where a part is in tiles and every part
 * has whole tiles of rows; else one at a time (a part in tiles then runs row by row). */
static inline int group_unit(const Group *g, const Vec *v) {
    int any = 0;
    for (int p = 0; p < g->n_parts; p++) {
        if (g->part[p].rows % X8) return 1;
        any |= tiled(&g->part[p], v);
    }
    return any ? X8 : 1;
}

/* rows n .. n + unit - 1 of the group (in one part) . v[0..B-1] into s[t * unit + i] */
static void group_rows(const Group *g, int n, int unit, const Vec *v, int B, float *s) {
    int p = 0, r = n;
    while (p + 1 < g->n_parts && r >= g->part[p].rows) r -= g->part[p++].rows;
    const Mat *m = &g->part[p];
#ifdef CB_AVX2
    if (unit == X8 && tiled(m, v)) {
        for (int t = 0; t < B; t++) dot_tile(m, r / X8, &v[t], s + t * X8);
        return;
    }
#endif
    for (int t = 0; t < B; t++)
        for (int i = 0; i < unit; i++) s[t * unit + i] = dot_vec(m, r + i, &v[t]);
}

/* y = W x + bias for a group of row blocks; called by every thread of a parallel region. */
static void group_matvec_par(const Group *g, Vec *v, float *y) {
    for (int p = 0; p < g->n_parts; p++) ready_for(v, &g->part[p]);
    const int unit = group_unit(g, v);
    if (unit > 1) {
        const Span units = team_share(g->rows / unit);
        for (int u = units.lo; u < units.hi; u++) {
            const int n = u * unit;
            group_rows(g, n, unit, v, 1, y + n);
            if (g->bias)
                for (int i = 0; i < unit; i++) y[n + i] += g->bias[n + i];
        }
        team_barrier();
        return;
    }
    const Span rows = team_share(g->rows);
    for (int n = rows.lo; n < rows.hi; n++) {
        int p = 0, r = n;
        while (p + 1 < g->n_parts && r >= g->part[p].rows) r -= g->part[p++].rows;
        const float s = dot_vec(&g->part[p], r, v);
        y[n] = g->bias ? s + g->bias[n] : s;
    }
    team_barrier();
}

static void embed_row(const Mat *m, int token, float *out) {
    const char *row = (const char *)m->data + (size_t)token * row_bytes(m);
    if (m->x8) { /* block by block from the tiles */
        uint8_t tmp[256];
        const int bl = block_len(m->fmt);
        for (int j = 0; j < m->cols / bl; j++) dequant_block(m->fmt, block_at(m, token, j, tmp), out + j * bl);
        return;
    }
    const int k = m->cols;
    switch (m->fmt) {
    case FMT_F32: memcpy(out, row, (size_t)k * 4); break;
    case FMT_BF16:
        for (int i = 0; i < k; i++) out[i] = bf16_to_f32(((const uint16_t *)row)[i]);
        break;
    case FMT_F16:
        for (int i = 0; i < k; i++) out[i] = fp16_to_f32(((const uint16_t *)row)[i]);
        break;
    default: {
        const int bl = block_len(m->fmt), bb = block_bytes(m->fmt);
        for (int j = 0; j < k / bl; j++) dequant_block(m->fmt, (const uint8_t *)row + (size_t)j * bb, out + j * bl);
    }
    }
}

/* transformers' LlamaRMSNorm in float32: w * (x * rsqrt(mean(x^2) + eps)). */
static void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* rotate_half RoPE on one head, in place. */
static void rope(float *v, const float *cs, const float *sn, int d) {
    const int h = d / 2;
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i] + a * sn[i];
    }
}

/* x -> cap * tanh(x / cap) over n floats, in place (Gemma 2's soft-capping), with
 * tanh(y) = 1 - 2 / (1 + exp(2y)): near 0 that loses the relative precision of tanh but not
 * its absolute one (~1e-7 of cap). */
static void softcap(float *x, int n, float cap) {
    const float inv = 1.0f / cap;
    int i = 0;
#ifdef CB_AVX2
    const __m256 vinv2 = _mm256_set1_ps(2.0f * inv), vcap = _mm256_set1_ps(cap);
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv2));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, e)));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(t, vcap));
    }
#elif defined(CB_NEON)
    const float32x4_t one = vdupq_n_f32(1.0f), two = vdupq_n_f32(2.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = exp4(vmulq_n_f32(vld1q_f32(x + i), 2.0f * inv));
        vst1q_f32(x + i, vmulq_n_f32(vsubq_f32(one, vdivq_f32(two, vaddq_f32(one, e))), cap));
    }
#endif
    for (; i < n; i++) x[i] = cap * tanhf(x[i] * inv);
}

/* One head of attention over the cached positions [0, n) and the new one:
 * softmax(q.K^T * scale) V, with the new key and value in `k_new`, `v_new`; `cap` > 0
 * soft-caps the scores first. */
static void attend(const float *q, const float *kc, const float *vc, const float *k_new, const float *v_new,
                   int n, int d, float scale, float cap, float *sc, float *out) {
    for (int t = 0; t < n; t++) sc[t] = dot_f32(kc + (size_t)t * d, q, d) * scale;
    sc[n] = dot_f32(k_new, q, d) * scale;
    const int total = n + 1;
    if (cap > 0.0f) softcap(sc, total, cap);
    float mx = -INFINITY;
    for (int t = 0; t < total; t++) mx = sc[t] > mx ? sc[t] : mx;
    float sum = 0.0f;
    int t = 0;
#ifdef CB_AVX2
    __m256 vmx = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
    for (; t + 8 <= total; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vmx));
        _mm256_storeu_ps(sc + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum256(vs);
#elif defined(CB_NEON)
    const float32x4_t vmx = vdupq_n_f32(mx);
    float32x4_t vs = vdupq_n_f32(0.0f);
    for (; t + 4 <= total; t += 4) {
        const float32x4_t e = exp4(vsubq_f32(vld1q_f32(sc + t), vmx));
        vst1q_f32(sc + t, e);
        vs = vaddq_f32(vs, e);
    }
    sum = vaddvq_f32(vs);
#endif
    for (; t < total; t++) {
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (t = 0; t < total; t++) {
        const float p = sc[t] * inv;
        const float *v = t < n ? vc + (size_t)t * d : v_new;
        int i = 0;
#ifdef CB_AVX2
        const __m256 vp = _mm256_set1_ps(p);
        for (; i + 8 <= d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
#elif defined(CB_NEON)
        for (; i + 4 <= d; i += 4) vst1q_f32(out + i, vfmaq_n_f32(vld1q_f32(out + i), vld1q_f32(v + i), p));
#endif
        for (; i < d; i++) out[i] += p * v[i];
    }
}

/* out = silu(g) * u over n floats (transformers' SiLU: x * sigmoid(x)). */
static void silu_mul(const float *g, const float *u, int n, float *out) {
    int i = 0;
#ifdef CB_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_sub_ps(zero, x));
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
#elif defined(CB_NEON)
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(g + i);
        const float32x4_t sig = vdivq_f32(one, vaddq_f32(one, exp4(vnegq_f32(x))));
        vst1q_f32(out + i, vmulq_f32(vmulq_f32(x, sig), vld1q_f32(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* out = gelu_tanh(g) * u over n floats: transformers' gelu_pytorch_tanh,
 * 0.5 x (1 + tanh(c (x + 0.044715 x^3))), written as x * sigmoid(2 c (x + 0.044715 x^3)). */
static void gelu_tanh_mul(const float *g, const float *u, int n, float *out) {
    const float c2 = 2.0f * 0.7978845608028654f, a = 0.044715f;
    int i = 0;
#ifdef CB_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), vc = _mm256_set1_ps(-c2), va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(va, x), _mm256_mul_ps(x, x), x);
        const __m256 e = exp256(_mm256_mul_ps(vc, inner));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#elif defined(CB_NEON)
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(g + i);
        const float32x4_t inner = vfmaq_f32(x, vmulq_n_f32(x, a), vmulq_f32(x, x));
        const float32x4_t e = exp4(vmulq_n_f32(inner, -c2));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(x, vaddq_f32(one, e)), vld1q_f32(u + i)));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i];
        out[i] = x / (1.0f + expf(-c2 * (x + a * x * x * x))) * u[i];
    }
}

static inline int widest_input(const Model *m) {
    const int hd = m->n_heads * m->head_dim;
    int w = m->ffn_dim > m->dim ? m->ffn_dim : m->dim;
    return hd > w ? hd : w;
}

/* Floats of shared scratch, then of each thread's private scratch. */
static long shared_floats(const Model *m) {
    const long qkv = (long)(m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    return qkv + (long)m->n_heads * m->head_dim + 2L * m->dim + 2L * m->ffn_dim + (long)m->n_heads * m->cap;
}

static long private_floats(const Model *m) {
    /* x, xn, hid, roped q, roped k, then a Vec; rounded up to whole cache lines */
    const long n = 2L * m->dim + m->ffn_dim + 2L * m->head_dim + vec_floats(widest_input(m));
    return (n + 15) / 16 * 16;
}

/* Sizes of the structs as this compiler lays them out: kernels.py compares them with its
 * ctypes mirrors at load and refuses a mismatch (a field added on one side only would
 * otherwise shift every later field and read garbage pointers). */
long chatbot_sizeof_mat(void) { return (long)sizeof(Mat); }
long chatbot_sizeof_group(void) { return (long)sizeof(Group); }
long chatbot_sizeof_model(void) { return (long)sizeof(Model); }

/* Floats of scratch space `chatbot_decode` needs with up to `max_threads` threads. */
long chatbot_scratch_floats(const Model *m, int max_threads) {
    return shared_floats(m) + (long)max_threads * private_floats(m) + 16;
}

/* Write kv head g's rotated key and its value for position p of layer l's cache (as
 * attend_head does), so that rows of one batch sharing a cache see each other's. */
static void store_kv_head(const Model *m, int l, int g, const float *qkv, const float *lcs, const float *lsn,
                          float *kc, float *vc, int cap, int p) {
    const int D = m->head_dim, H = m->n_heads, HKV = m->n_kv_heads;
    const size_t off = (size_t)g * cap * D + (size_t)p * D;
    float *k = kc + off;
    memcpy(k, qkv + (H + g) * D, (size_t)D * 4);
    if (m->k_norm) rmsnorm(k, m->k_norm[l], D, m->eps, k);
    rope(k, lcs, lsn, D);
    memcpy(vc + off, qkv + (H + HKV + g) * D, (size_t)D * 4);
}

/* Head h of a position whose key and value store_kv_head wrote: its query against the
 * cache's positions [first, p] (the same arithmetic as attend_head). */
static void attend_stored(const Model *m, int l, int h, const float *qkv, const float *lcs, const float *lsn,
                          const float *kc, const float *vc, int cap, int p, int first, float *qr, float *scores,
                          float *out) {
    const int D = m->head_dim, H = m->n_heads, HKV = m->n_kv_heads, g = h / (H / HKV);
    const size_t off = (size_t)g * cap * D;
    memcpy(qr, qkv + h * D, (size_t)D * 4);
    if (m->q_norm) rmsnorm(qr, m->q_norm[l], D, m->eps, qr);
    rope(qr, lcs, lsn, D);
    attend(qr, kc + off + (size_t)first * D, vc + off + (size_t)first * D, kc + off + (size_t)p * D,
           vc + off + (size_t)p * D, p - first, D, m->attn_scale, m->attn_softcap, scores, out);
}

/* Head h of layer l at position p, by one thread: its query and the group's key from `qkv`
 * (RMSNorm per head for qwen3, then the rotation), the key and value stored at position p of
 * the group's cache rows (kc, vc: [Hkv, cap, D]; the first head of each group stores them:
 * nobody reads position p before the next call, attention takes the new key and value from
 * kr and v, so no barrier), then attention over the positions [first, p] into `out`. qr, kr:
 * D floats of the thread's own; scores: p - first + 1 floats. */
static void attend_head(const Model *m, int l, int h, const float *qkv, const float *lcs, const float *lsn,
                        float *kc, float *vc, int cap, int p, int first, float *qr, float *kr, float *scores,
                        float *out) {
    const int D = m->head_dim, H = m->n_heads, HKV = m->n_kv_heads, group = H / HKV, g = h / group;
    const size_t off = (size_t)g * cap * D;
    const float *v = qkv + (H + HKV + g) * D;
    memcpy(qr, qkv + h * D, (size_t)D * 4);
    memcpy(kr, qkv + (H + g) * D, (size_t)D * 4);
    if (m->q_norm) { /* qwen3: RMSNorm per head before the rotation */
        rmsnorm(qr, m->q_norm[l], D, m->eps, qr);
        rmsnorm(kr, m->k_norm[l], D, m->eps, kr);
    }
    rope(qr, lcs, lsn, D);
    rope(kr, lcs, lsn, D);
    if (h % group == 0) {
        memcpy(kc + off + (size_t)p * D, kr, (size_t)D * 4);
        memcpy(vc + off + (size_t)p * D, v, (size_t)D * 4);
    }
    attend(qr, kc + off + (size_t)first * D, vc + off + (size_t)first * D, kr, v, p - first, D, m->attn_scale,
           m->attn_softcap, scores, out);
}

typedef struct {
    const Model *m;
    int token, pos;
    float *logits;
} DecodeJob;

static void decode_team(void *arg) {
    const DecodeJob *job = arg;
    const Model *m = job->m;
    const int token = job->token, pos = job->pos;
    float *logits = job->logits;
    const int D = m->head_dim, H = m->n_heads, HKV = m->n_kv_heads, F = m->ffn_dim, E = m->dim;
    const int half = D / 2;
    float *qkv = m->scratch; /* shared */
    float *att = qkv + (H + 2 * HKV) * D;
    float *o = att + H * D;
    float *gu = o + E;
    float *dn = gu + 2 * F;
    float *scores = dn + E;
    float *priv = m->scratch + shared_floats(m);
    const float *cs = m->rope_cos + (size_t)pos * half;
    const float *sn = m->rope_sin + (size_t)pos * half;
    float *x = priv + (size_t)team_id() * private_floats(m);
    float *xn = x + E;
    float *hid = xn + E;
    float *qr = hid + F;
    float *kr = qr + D;
    Vec vec = {0};
    vec_place(&vec, kr + D, widest_input(m));
    embed_row(m->embed, token, x);
    if (m->embed_scale != 0.0f)
        for (int i = 0; i < E; i++) x[i] *= m->embed_scale;
    for (int l = 0; l < m->n_layers; l++) {
        float *kc = m->kcache[l], *vc = m->vcache[l];
        const int second = m->rope_sel && m->rope_sel[l];
        const float *lcs = second ? m->rope_cos2 + (size_t)pos * half : cs;
        const float *lsn = second ? m->rope_sin2 + (size_t)pos * half : sn;
        /* a sliding-window layer sees the positions (pos - window, pos] */
        const int w = m->window ? m->window[l] : 0;
        const int first = w > 0 && pos + 1 > w ? pos + 1 - w : 0;
        rmsnorm(x, m->attn_norm[l], E, m->eps, xn);
        prepare_vec(&vec, xn, E, site_act(m, SITE_QKV));
        group_matvec_par(&m->wqkv[l], &vec, qkv);
        const Span heads = team_share(H);
        for (int h = heads.lo; h < heads.hi; h++)
            attend_head(m, l, h, qkv, lcs, lsn, kc, vc, m->cap, pos, first, qr, kr, scores + (size_t)h * m->cap,
                        att + h * D);
        team_barrier();
        prepare_vec(&vec, att, H * D, site_act(m, SITE_O));
        group_matvec_par(&m->wo[l], &vec, o);
        if (m->post_attn_norm) {
            rmsnorm(o, m->post_attn_norm[l], E, m->eps, xn);
            for (int i = 0; i < E; i++) x[i] += xn[i];
        } else {
            for (int i = 0; i < E; i++) x[i] += o[i];
        }
        rmsnorm(x, m->ffn_norm[l], E, m->eps, xn);
        prepare_vec(&vec, xn, E, site_act(m, SITE_GU));
        group_matvec_par(&m->wgu[l], &vec, gu);
        if (m->act_fn == ACT_FN_GELU_TANH)
            gelu_tanh_mul(gu, gu + F, F, hid);
        else
            silu_mul(gu, gu + F, F, hid);
        prepare_vec(&vec, hid, F, site_act(m, SITE_DOWN));
        group_matvec_par(&m->wdown[l], &vec, dn);
        if (m->post_ffn_norm) {
            rmsnorm(dn, m->post_ffn_norm[l], E, m->eps, xn);
            for (int i = 0; i < E; i++) x[i] += xn[i];
        } else {
            for (int i = 0; i < E; i++) x[i] += dn[i];
        }
    }
    rmsnorm(x, m->final_norm, E, m->eps, xn);
    prepare_vec(&vec, xn, E, site_act(m, SITE_HEAD));
    matvec_par(m->lm_head, &vec, logits);
    if (m->final_softcap > 0.0f) {
        const int V = m->lm_head->rows, chunk = 4096;
        const Span chunks = team_share((V + chunk - 1) / chunk);
        for (int c = chunks.lo; c < chunks.hi; c++)
            softcap(logits + (size_t)c * chunk, V - c * chunk < chunk ? V - c * chunk : chunk, m->final_softcap);
        team_barrier();
    }
}

/* Forward one token at position `pos` (keys/values written to the caches at `pos`; the
 * caches must hold positions [0, pos) already and have cap > pos). Logits go to `logits`
 * [vocab]. Returns 0, or -1 for a position outside the cache or the rope table.
 *
 * Every thread keeps its own copy of the residual stream and of the small vectors derived
 * from it (norms, block sums, SiLU): computing them twice costs less than making a thread
 * wait for another, so a layer has only the five barriers its matrix products need.
 * Scratch must have room for m->n_threads threads (chatbot_scratch_floats). */
int chatbot_decode(const Model *m, int token, int pos, float *logits) {
    if (pos < 0 || pos >= m->cap || pos >= m->rope_len || token < 0 || token >= m->embed->rows) return -1;
    DecodeJob job = {m, token, pos, logits};
    team_run(m->n_threads, decode_team, &job);
    return 0;
}

/* ---------------------------------------------------------------- batched decode (serving)
 *
 * One token for each of B conversations in one pass over the weights: every weight row is read
 * (and, for Q4_1 / Q8_0 with int16 inputs, unpacked) once and multiplied with the B inputs
 * while it is in L1, each conversation attending to its own cache. The arithmetic of each row
 * is that of chatbot_decode, so a batched answer equals the one decoded alone. */

#define MAX_BATCH 16

#if defined(__AVX512BW__) && defined(CB_AVX2)
/* The B inputs' per-block numbers side by side, for the batched products: tq[j B + t] is
 * v[t].qd[j] and tq[(nb + j) B + t] is v[t].qs[j] (nb = cols / 32). Made once per matrix, so
 * the products multiply a block's weight scale with all B input scales in one instruction,
 * and each input's sum takes its scale from memory (a broadcast the FMA does itself). */
static void transpose_scales(const Vec *v, int B, int nb, float *tq) {
    for (int t = 0; t < B; t++)
        for (int j = 0; j < nb; j++) {
            tq[j * B + t] = v[t].qd[j];
            tq[(nb + j) * B + t] = v[t].qs[j];
        }
}

/* s[t] = row . v[t] for Q4_1 (Q8_0) weights and int16 inputs: dot_q4_1_i16's (dot_q8_0_i16's)
 * arithmetic in its order (even blocks in one sum, odd ones in another, Q4_1's min term in
 * one fused chain), so each result equals it exactly. One function per batch size 2..8, the
 * inputs' sums named variables (CB_ROWS repeats a statement for each input): arrays of them,
 * even indexed by constants, stayed in memory, each block storing every sum. */
#define CB_ROWS2(M, J, A) M(0, J, A) M(1, J, A)
#define CB_ROWS3(M, J, A) CB_ROWS2(M, J, A) M(2, J, A)
#define CB_ROWS4(M, J, A) CB_ROWS3(M, J, A) M(3, J, A)
#define CB_ROWS5(M, J, A) CB_ROWS4(M, J, A) M(4, J, A)
#define CB_ROWS6(M, J, A) CB_ROWS5(M, J, A) M(5, J, A)
#define CB_ROWS7(M, J, A) CB_ROWS6(M, J, A) M(6, J, A)
#define CB_ROWS8(M, J, A) CB_ROWS7(M, J, A) M(7, J, A)
#define CB_DECLARE(T, J, A) __m512 a0_##T = _mm512_setzero_ps(), a1_##T = _mm512_setzero_ps();
#define CB_ROW_STEP(T, J, A)                                                                                     \
    A##_##T = _mm512_fmadd_ps(_mm512_set1_ps(scs[T]),                                                          \
                              _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(v[T].q16 + (J) * QK))), \
                              A##_##T);
#define CB_ROW_SUM(T, J, A) s[T] = _mm512_reduce_add_ps(_mm512_add_ps(a0_##T, a1_##T)) + A[T];

/* the shared part of a block: the weights as int16 (w) and the scale products (scs) */
#define Q41_UNPACK(J)                                                                                            \
    const __m128i raw = _mm_loadu_si128((const __m128i *)b[J].qs);                                              \
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4))); \
    const float *scs = scall + (J) * B;                                                                          \
    ms = _mm512_fmadd_ps(_mm512_set1_ps(fp16_to_f32(b[J].m)), _mm512_maskz_loadu_ps(bmask, tq + (nb + (J)) * B), ms);
#define Q80_UNPACK(J)                                                                                            \
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)b[J].qs));                      \
    const float *scs = scall + (J) * B;

/* what both kinds of function below begin with: the masks, and the scale products of the
 * row's blocks (block j's weight scale times each input's), made ahead: made per block, each
 * block's FMAs waited on them */
#define CB_MULTI_PREAMBLE                                                                                        \
    const __mmask16 bmask = (__mmask16)((1u << B) - 1u);                                                         \
    const __m128i m4 = _mm_set1_epi8(0x0f);                                                                      \
    float scall[nb * B + 1], mins[16] __attribute__((aligned(64)));                                              \
    for (int jj = 0; jj < nb; jj++) {                                                                            \
        const float dj = fp16_to_f32(b[jj].d);                                                                   \
        for (int t = 0; t < B; t++) scall[jj * B + t] = dj * tq[jj * B + t];                                     \
    }

#define CB_MULTI_SIZE(NAME, BLOCK, UNPACK, N)                                                                     \
    static void dot_##NAME##_multi_##N(const BLOCK *b, const Vec *v, int k, const float *tq, float *s) {           \
        const int B = N, nb = k / QK;                                                                            \
        CB_MULTI_PREAMBLE                                                                                        \
        __m512 ms = _mm512_setzero_ps();                                                                         \
        (void)bmask, (void)m4, (void)ms;                                                                         \
        CB_ROWS##N(CB_DECLARE, 0, 0)                                                                             \
        int j = 0;                                                                                               \
        for (; j + 2 <= nb; j += 2) {                                                                            \
            _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);                                         \
            {                                                                                                    \
                UNPACK(j)                                                                                        \
                CB_ROWS##N(CB_ROW_STEP, j, a0)                                                                   \
            }                                                                                                    \
            {                                                                                                    \
                UNPACK(j + 1)                                                                                    \
                CB_ROWS##N(CB_ROW_STEP, j + 1, a1)                                                               \
            }                                                                                                    \
        }                                                                                                        \
        if (j < nb) {                                                                                            \
            UNPACK(j)                                                                                            \
            CB_ROWS##N(CB_ROW_STEP, j, a0)                                                                       \
        }                                                                                                        \
        _mm512_store_ps(mins, ms);                                                                               \
        CB_ROWS##N(CB_ROW_SUM, 0, mins)                                                                          \
    }

/* any B up to MAX_BATCH: the same arithmetic, the sums in arrays */
#define CB_MULTI_ANY(NAME, BLOCK, UNPACK)                                                                         \
    static void dot_##NAME##_multi_any(const BLOCK *b, const Vec *v, const int B, int k, const float *tq, float *s) { \
        const int nb = k / QK;                                                                                   \
        CB_MULTI_PREAMBLE                                                                                        \
        __m512 ms = _mm512_setzero_ps(), acc0[MAX_BATCH], acc1[MAX_BATCH];                                       \
        (void)bmask, (void)m4;                                                                                   \
        for (int t = 0; t < B; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();                                     \
        for (int j = 0; j < nb; j++) {                                                                           \
            UNPACK(j)                                                                                            \
            __m512 *acc = j & 1 ? acc1 : acc0;                                                                   \
            for (int t = 0; t < B; t++)                                                                          \
                acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(scs[t]),                                                 \
                                         _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(v[t].q16 + j * QK))), \
                                         acc[t]);                                                                \
        }                                                                                                        \
        _mm512_store_ps(mins, ms);                                                                               \
        for (int t = 0; t < B; t++) s[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t])) + mins[t];      \
    }

#define CB_MULTI_FUNCS(NAME, BLOCK, UNPACK)                                                                       \
    CB_MULTI_SIZE(NAME, BLOCK, UNPACK, 2) CB_MULTI_SIZE(NAME, BLOCK, UNPACK, 3)                                   \
    CB_MULTI_SIZE(NAME, BLOCK, UNPACK, 4) CB_MULTI_SIZE(NAME, BLOCK, UNPACK, 5)                                   \
    CB_MULTI_SIZE(NAME, BLOCK, UNPACK, 6) CB_MULTI_SIZE(NAME, BLOCK, UNPACK, 7)                                   \
    CB_MULTI_SIZE(NAME, BLOCK, UNPACK, 8) CB_MULTI_ANY(NAME, BLOCK, UNPACK)                                       \
    static void dot_##NAME##_multi(const BLOCK *b, const Vec *v, int B, int k, const float *tq, float *s) {       \
        switch (B) {                                                                                             \
        case 2: dot_##NAME##_multi_2(b, v, k, tq, s); return;                                                    \
        case 3: dot_##NAME##_multi_3(b, v, k, tq, s); return;                                                    \
        case 4: dot_##NAME##_multi_4(b, v, k, tq, s); return;                                                    \
        case 5: dot_##NAME##_multi_5(b, v, k, tq, s); return;                                                    \
        case 6: dot_##NAME##_multi_6(b, v, k, tq, s); return;                                                    \
        case 7: dot_##NAME##_multi_7(b, v, k, tq, s); return;                                                    \
        case 8: dot_##NAME##_multi_8(b, v, k, tq, s); return;                                                    \
        default: dot_##NAME##_multi_any(b, v, B, k, tq, s);                                                      \
        }                                                                                                        \
    }

CB_MULTI_FUNCS(q4_1_i16, block_q4_1, Q41_UNPACK)
CB_MULTI_FUNCS(q8_0_i16, block_q8_0, Q80_UNPACK)
#undef CB_MULTI_FUNCS
#undef CB_MULTI_ANY
#undef CB_MULTI_SIZE
#undef CB_MULTI_PREAMBLE
#undef Q41_UNPACK
#undef Q80_UNPACK
#undef CB_ROW_SUM
#undef CB_ROW_STEP
#undef CB_DECLARE
#endif

/* Whether dot_vec_multi takes m's rows in one pass for the B inputs v (then it needs
 * transpose_scales' numbers) */
static inline int multi_pass(const Mat *m, const Vec *v) {
#if defined(__AVX512BW__) && defined(CB_AVX2)
    return v[0].act == ACT_I16 && (m->fmt == FMT_Q4_1 || m->fmt == FMT_Q8_0);
#else
    (void)m, (void)v;
    return 0;
#endif
}

/* Makes v ready for m and, where dot_vec_multi needs them, the inputs' scales side by side in
 * tq (2 B cols / 32 floats). */
static void ready_multi(Vec *v, int B, const Mat *m, float *tq) {
    for (int t = 0; t < B; t++) ready_for(&v[t], m);
#if defined(__AVX512BW__) && defined(CB_AVX2)
    if (multi_pass(m, v)) transpose_scales(v, B, m->cols / QK, tq);
#else
    (void)tq;
#endif
}

/* s[t] = row n of m . v[t] for the B inputs (all of one length and form); tq from ready_multi */
static inline void dot_vec_multi(const Mat *m, int n, const Vec *v, int B, const float *tq, float *s) {
#if defined(__AVX512BW__) && defined(CB_AVX2)
    if (multi_pass(m, v)) {
        const char *row = (const char *)m->data + (size_t)n * row_bytes(m);
        if (m->fmt == FMT_Q4_1)
            dot_q4_1_i16_multi((const block_q4_1 *)row, v, B, m->cols, tq, s);
        else
            dot_q8_0_i16_multi((const block_q8_0 *)row, v, B, m->cols, tq, s);
        return;
    }
#else
    (void)tq;
#endif
    for (int t = 0; t < B; t++) s[t] = dot_vec(m, n, &v[t]);
}

/* y[t][n] (row stride ys) = (W v[t])[n] + bias for a group of row blocks; called by every
 * thread of a parallel region. */
static void group_matmul_par(const Group *g, Vec *v, int B, float *tq, float *y, int ys) {
    for (int p = 0; p < g->n_parts; p++) ready_multi(v, B, &g->part[p], tq); /* parts share cols and form */
    const int unit = group_unit(g, v);
    if (unit > 1) {
        const Span units = team_share(g->rows / unit);
        for (int u = units.lo; u < units.hi; u++) {
            const int n = u * unit;
            float s[MAX_BATCH * X8];
            group_rows(g, n, unit, v, B, s);
            for (int t = 0; t < B; t++)
                for (int i = 0; i < unit; i++)
                    y[(size_t)t * ys + n + i] = g->bias ? s[t * unit + i] + g->bias[n + i] : s[t * unit + i];
        }
        team_barrier();
        return;
    }
    const Span rows = team_share(g->rows);
    for (int n = rows.lo; n < rows.hi; n++) {
        int p = 0, r = n;
        while (p + 1 < g->n_parts && r >= g->part[p].rows) r -= g->part[p++].rows;
        float s[MAX_BATCH];
        dot_vec_multi(&g->part[p], r, v, B, tq, s);
        for (int t = 0; t < B; t++) y[(size_t)t * ys + n] = g->bias ? s[t] + g->bias[n] : s[t];
    }
    team_barrier();
}

static long batch_shared_floats(const Model *m, int B, int cap) {
    const long qkv = (long)(m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    const long row = qkv + (long)m->n_heads * m->head_dim + 2L * m->dim + 2L * m->ffn_dim;
    return ((long)B * row + (long)B * m->n_heads * cap + 15) / 16 * 16;
}

static long batch_private_floats(const Model *m, int B) {
    const long n = (long)B * (2L * m->dim + m->ffn_dim) + 2L * m->head_dim + (long)B * vec_floats(widest_input(m)) +
                   2L * B * (widest_input(m) / QK + 1); /* transpose_scales */
    return (n + 15) / 16 * 16;
}

/* Floats of scratch chatbot_decode_batch needs for B rows whose caches hold up to `cap`
 * positions each, with up to `max_threads` threads; 0 for B out of [1, MAX_BATCH]. */
long chatbot_batch_scratch_floats(const Model *m, int B, int cap, int max_threads) {
    if (B < 1 || B > MAX_BATCH) return 0;
    return batch_shared_floats(m, B, cap) + (long)max_threads * batch_private_floats(m, B) + 16;
}

long chatbot_max_batch(void) { return MAX_BATCH; }

typedef struct {
    const Model *m;
    int B, maxcap, last_only;
    const int *tokens, *pos, *caps;
    float *const *kcache, *const *vcache;
    float *scratch, *logits;
} BatchJob;

static void decode_batch_team(void *arg) {
    const BatchJob *job = arg;
    const Model *m = job->m;
    const int B = job->B, maxcap = job->maxcap, *tokens = job->tokens, *pos = job->pos, *caps = job->caps;
    float *const *kcache = job->kcache, *const *vcache = job->vcache;
    float *scratch = job->scratch, *logits = job->logits;
    const int D = m->head_dim, H = m->n_heads, HKV = m->n_kv_heads, F = m->ffn_dim, E = m->dim, L = m->n_layers;
    const int half = D / 2, QKV = (H + 2 * HKV) * D, V = m->lm_head->rows;
    float *qkv = scratch; /* shared: [B][QKV], then att [B][H D], o [B][E], gu [B][2F], dn [B][E], scores */
    float *att = qkv + (size_t)B * QKV;
    float *o = att + (size_t)B * H * D;
    float *gu = o + (size_t)B * E;
    float *dn = gu + (size_t)B * 2 * F;
    float *scores = dn + (size_t)B * E; /* [B][H][maxcap] */
    float *priv = scratch + batch_shared_floats(m, B, maxcap);
    const long pf = batch_private_floats(m, B);
    const long vf = vec_floats(widest_input(m));
    float *x = priv + (size_t)team_id() * pf; /* [B][E] */
    float *xn = x + (size_t)B * E;                         /* [B][E] */
    float *hid = xn + (size_t)B * E;                       /* [B][F] */
    float *qr = hid + (size_t)B * F;
    float *kr = qr + D;
    float *tq = kr + D + B * vf;
    Vec vec[MAX_BATCH];
    memset(vec, 0, sizeof vec);
    for (int t = 0; t < B; t++) {
        vec_place(&vec[t], kr + D + t * vf, widest_input(m));
        float *xt = x + (size_t)t * E;
        embed_row(m->embed, tokens[t], xt);
        if (m->embed_scale != 0.0f)
            for (int i = 0; i < E; i++) xt[i] *= m->embed_scale;
    }
    for (int l = 0; l < L; l++) {
        for (int t = 0; t < B; t++) {
            rmsnorm(x + (size_t)t * E, m->attn_norm[l], E, m->eps, xn + (size_t)t * E);
            prepare_vec(&vec[t], xn + (size_t)t * E, E, site_act(m, SITE_QKV));
        }
        group_matmul_par(&m->wqkv[l], vec, B, tq, qkv, QKV);
        const int second = m->rope_sel && m->rope_sel[l];
        const int w = m->window ? m->window[l] : 0;
        const float *cos_l = second ? m->rope_cos2 : m->rope_cos, *sin_l = second ? m->rope_sin2 : m->rope_sin;
        /* every row's key and value first, then the attention: a row may share its cache with
         * the rows before it (a prompt's tokens, chatbot_prefill_rows) and must see theirs */
        const Span kvh = team_share(B * HKV);
        for (int tg = kvh.lo; tg < kvh.hi; tg++) {
            const int t = tg / HKV, p = pos[t];
            store_kv_head(m, l, tg % HKV, qkv + (size_t)t * QKV, cos_l + (size_t)p * half, sin_l + (size_t)p * half,
                          kcache[(size_t)t * L + l], vcache[(size_t)t * L + l], caps[t], p);
        }
        team_barrier();
        const Span heads = team_share(B * H);
        for (int th = heads.lo; th < heads.hi; th++) {
            const int t = th / H, h = th % H, p = pos[t];
            const int first = w > 0 && p + 1 > w ? p + 1 - w : 0;
            float qh[512]; /* head_dim <= 512 (checked by kernels.py) */
            attend_stored(m, l, h, qkv + (size_t)t * QKV, cos_l + (size_t)p * half, sin_l + (size_t)p * half,
                          kcache[(size_t)t * L + l], vcache[(size_t)t * L + l], caps[t], p, first, qh,
                          scores + ((size_t)t * H + h) * maxcap, att + ((size_t)t * H + h) * D);
        }
        team_barrier();
        for (int t = 0; t < B; t++) prepare_vec(&vec[t], att + (size_t)t * H * D, H * D, site_act(m, SITE_O));
        group_matmul_par(&m->wo[l], vec, B, tq, o, E);
        for (int t = 0; t < B; t++) {
            float *xt = x + (size_t)t * E, *xnt = xn + (size_t)t * E;
            if (m->post_attn_norm) {
                rmsnorm(o + (size_t)t * E, m->post_attn_norm[l], E, m->eps, xnt);
                for (int i = 0; i < E; i++) xt[i] += xnt[i];
            } else {
                for (int i = 0; i < E; i++) xt[i] += o[(size_t)t * E + i];
            }
            rmsnorm(xt, m->ffn_norm[l], E, m->eps, xnt);
            prepare_vec(&vec[t], xnt, E, site_act(m, SITE_GU));
        }
        group_matmul_par(&m->wgu[l], vec, B, tq, gu, 2 * F);
        for (int t = 0; t < B; t++) {
            const float *g = gu + (size_t)t * 2 * F;
            float *ht = hid + (size_t)t * F;
            if (m->act_fn == ACT_FN_GELU_TANH)
                gelu_tanh_mul(g, g + F, F, ht);
            else
                silu_mul(g, g + F, F, ht);
            prepare_vec(&vec[t], ht, F, site_act(m, SITE_DOWN));
        }
        group_matmul_par(&m->wdown[l], vec, B, tq, dn, E);
        for (int t = 0; t < B; t++) {
            float *xt = x + (size_t)t * E, *xnt = xn + (size_t)t * E;
            if (m->post_ffn_norm) {
                rmsnorm(dn + (size_t)t * E, m->post_ffn_norm[l], E, m->eps, xnt);
                for (int i = 0; i < E; i++) xt[i] += xnt[i];
            } else {
                for (int i = 0; i < E; i++) xt[i] += dn[(size_t)t * E + i];
            }
        }
    }
    const int lo = job->last_only ? B - 1 : 0, NL = B - lo; /* the rows that get logits */
    for (int t = lo; t < B; t++) {
        rmsnorm(x + (size_t)t * E, m->final_norm, E, m->eps, xn + (size_t)t * E);
        prepare_vec(&vec[t], xn + (size_t)t * E, E, site_act(m, SITE_HEAD));
    }
    ready_multi(vec + lo, NL, m->lm_head, tq);
#ifdef CB_AVX2
    if (tiled(m->lm_head, &vec[lo])) {
        const Span tiles = team_share(V / X8);
        for (int g = tiles.lo; g < tiles.hi; g++)
            for (int t = 0; t < NL; t++) dot_tile(m->lm_head, g, &vec[lo + t], logits + (size_t)t * V + (size_t)g * X8);
    } else
#endif
    {
        const Span rows = team_share(V);
        for (int n = rows.lo; n < rows.hi; n++) {
            float s[MAX_BATCH];
            dot_vec_multi(m->lm_head, n, vec + lo, NL, tq, s);
            for (int t = 0; t < NL; t++) logits[(size_t)t * V + n] = s[t];
        }
    }
    team_barrier();
    if (m->final_softcap > 0.0f) {
        const int chunk = 4096, nc = (V + chunk - 1) / chunk;
        const Span chunks = team_share(NL * nc);
        for (int c = chunks.lo; c < chunks.hi; c++) {
            const int t = c / nc, i = c % nc;
            softcap(logits + (size_t)t * V + (size_t)i * chunk, V - i * chunk < chunk ? V - i * chunk : chunk,
                    m->final_softcap);
        }
        team_barrier();
    }
}

/* Forward B tokens, row t being `tokens[t]` at position `pos[t]` of its cache: layer l's
 * keys and values at kcache[t * n_layers + l] / vcache[...] ([Hkv, caps[t], D] each, holding
 * positions [0, pos[t]) already, caps[t] > pos[t]). Rows may share a cache at consecutive
 * positions (a prompt's tokens): each sees the keys and values of the rows before it, and
 * the cache ends as decoding them one by one leaves it. Logits go to logits [B, vocab], or
 * with `last_only` the last row's alone to logits [vocab]. m's own cache fields, scratch and
 * thread count are not used (nor written: calls from several threads at once are safe, each
 * with its own scratch): `scratch` has chatbot_batch_scratch_floats(m, B, max(caps),
 * n_threads) floats. Returns 0, or -1 (nothing written) for a row out of range. */
int chatbot_decode_batch(const Model *m, int B, const int *tokens, const int *pos, const int *caps,
                         float *const *kcache, float *const *vcache, float *scratch, float *logits, int last_only,
                         int n_threads) {
    if (B < 1 || B > MAX_BATCH || m->head_dim > 512) return -1;
    int maxcap = 0;
    for (int t = 0; t < B; t++) {
        if (pos[t] < 0 || pos[t] >= caps[t] || pos[t] >= m->rope_len || tokens[t] < 0 || tokens[t] >= m->embed->rows)
            return -1;
        maxcap = caps[t] > maxcap ? caps[t] : maxcap;
    }
    BatchJob job = {m, B, maxcap, last_only != 0, tokens, pos, caps, kcache, vcache, scratch, logits};
    team_run(n_threads < 1 ? 1 : n_threads, decode_batch_team, &job);
    return 0;
}

/* Floats of scratch chatbot_matvec needs for a matrix of `cols` columns. */
long chatbot_matvec_scratch(int cols) { return vec_floats(cols); }

/* y = W x for one matrix (tests, micro-benchmarks, a few rows of prefill); `act` as in Model;
 * `scratch`: chatbot_matvec_scratch(cols) floats. */
typedef struct {
    const Mat *m;
    Vec *v;
    float *y;
} MatvecJob;

static void matvec_team(void *arg) {
    const MatvecJob *job = arg;
    matvec_par(job->m, job->v, job->y);
}

void chatbot_matvec(const Mat *m, const float *x, float *scratch, float *y, int n_threads, int act) {
    Vec vec = {0};
    vec_place(&vec, scratch, m->cols);
    prepare_vec(&vec, x, m->cols, act);
    ready_for(&vec, m);
    MatvecJob job = {m, &vec, y};
    team_run(n_threads, matvec_team, &job);
}

/* Rows `ids[0..n)` of W as float32 into out [n, cols] (an embedding lookup); ids are
 * checked by the caller. */
void chatbot_rows(const Mat *m, const int64_t *ids, int n, float *out) {
    for (int i = 0; i < n; i++) embed_row(m, (int)ids[i], out + (size_t)i * m->cols);
}

/* Rows of W as float32 (for prefill with the same weights as decode). */
typedef struct {
    const Mat *m;
    float *out;
} DequantizeJob;

static void dequantize_team(void *arg) {
    const DequantizeJob *job = arg;
    const Span rows = team_share(job->m->rows);
    for (int n = rows.lo; n < rows.hi; n++) embed_row(job->m, n, job->out + (size_t)n * job->m->cols);
}

void chatbot_dequantize(const Mat *m, float *out, int n_threads) {
    DequantizeJob job = {m, out};
    team_run(n_threads, dequantize_team, &job);
}

/* ---------------------------------------------------------------- batched products (prefill)
 *
 * Y = X W^T for n inputs at once, as `--opt auto` decodes: each input quantized to int16 per
 * unit (the values of a weight row that share one float scale: 32, or 16 for Q6_K), products
 * exact in int32, one float scale per unit and row. The weights are unpacked once per call, 32
 * rows at a time, into small integers laid out rows-in-lanes: for each pair of values, the 32
 * rows' pairs side by side (two vectors of 16), so one vpdpwssd multiplies 16 rows by one pair
 * of an input (the pair broadcast) and its 16 int32 lanes are the 16 rows' sums. A unit's
 * float scales are then vectors over the rows, shared by all inputs, and the rows' results of
 * an input are vectors: no horizontal sums. A tile of 32 rows x 8 inputs keeps 16 integer
 * accumulators in registers; each broadcast input pair serves two products, each weight
 * vector loaded eight.
 *
 * AVX2 runs the same code on 256-bit registers: 16 rows (two vectors of 8) x 4 inputs, eight
 * accumulators, vpmaddwd + vpaddd per product (one vpdpwssd where the CPU has AVX-VNNI): 16
 * multiplies per instruction where float32 FMA does 8, and the weights 2 bytes a value where
 * float32 bands took 4. On Zen 4 cores that measured 1.2x the float32 bands for Q4_K and Q8_0,
 * 0.96-1.0x for Q6_K (units of 16): vpmaddwd seems to issue less often there than FMA. */

#if defined(CB_AVX2)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MM_512 1
#endif

/* values sharing one float scale in the batched product, or 0: no batched product for fmt */
static int mm_unit(int fmt) {
    switch (fmt) {
    case FMT_Q8_0: case FMT_Q4_0: case FMT_Q4_1: case FMT_Q5_0: case FMT_Q5_1: case FMT_Q4_K: case FMT_Q5_K:
        return 32;
    case FMT_Q6_K: return 16;
    default: return 0;
    }
}

/* 32 bytes -> 32 int16 at q */
static inline void store_i16(int16_t *q, __m256i bytes, int is_signed) {
#ifdef MM_512
    _mm512_storeu_si512(q, is_signed ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes));
#else
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    _mm256_storeu_si256((__m256i *)q, is_signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo));
    _mm256_storeu_si256((__m256i *)(q + 16), is_signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi));
#endif
}

/* One block as small integers q (block_len values) and, per unit, a scale s and an offset o:
 * the weights are s q + o, as dequant_block computes them. */
static void mm_unpack_block(int fmt, const uint8_t *b, int16_t *q, float *s, float *o) {
    switch (fmt) {
    case FMT_Q8_0:
        store_i16(q, _mm256_loadu_si256((const __m256i *)(b + 2)), 1);
        s[0] = rdh(b), o[0] = 0.0f;
        break;
    case FMT_Q4_0: case FMT_Q4_1: case FMT_Q5_0: case FMT_Q5_1: {
        const int one = fmt == FMT_Q4_1 || fmt == FMT_Q5_1, five = fmt == FMT_Q5_0 || fmt == FMT_Q5_1;
        const int zero = one ? 0 : (five ? 16 : 8);
        __m256i w = nibbles32(b + 2 + 2 * one + 4 * five);
        if (five) {
            uint32_t qh;
            memcpy(&qh, b + 2 + 2 * one, 4);
            w = _mm256_or_si256(w, bit4_from_bits(qh));
        }
        store_i16(q, _mm256_sub_epi8(w, _mm256_set1_epi8((char)zero)), 1);
        s[0] = rdh(b), o[0] = one ? rdh(b + 2) : 0.0f;
        break;
    }
    case FMT_Q4_K: case FMT_Q5_K: {
        const int five = fmt == FMT_Q5_K;
        const float d = rdh(b), dmin = rdh(b + 2);
        const uint8_t *qs = b + 16 + 32 * five;
        /* quants as bytes: 64 j + i the low nibble of byte i of the j-th 32, 64 j + 32 + i the
         * high one; Q5_K's 5th bits are bits 2 j and 2 j + 1 of the 32 bytes before them */
        const __m256i m4 = _mm256_set1_epi8(0x0f), bit = _mm256_set1_epi8(1);
        const __m256i h = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        uint8_t sc[8], mn[8];
        k4_scales(b + 4, sc, mn);
        for (int j = 0; j < 4; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), bit), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j + 1), bit), 4));
            }
            store_i16(q + 64 * j, lo, 0);
            store_i16(q + 64 * j + 32, hi, 0);
        }
        for (int u = 0; u < 8; u++) s[u] = d * (float)sc[u], o[u] = -dmin * (float)mn[u];
        break;
    }
    case FMT_Q6_K: {
        const float d = rdh(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
        for (int n = 0; n < 2; n++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(b + 64 * n));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            int16_t *y = q + 128 * n;
            store_i16(y, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)), off), 1);
            store_i16(y + 32, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)), off), 1);
            store_i16(y + 64, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(h, m30)), off), 1);
            store_i16(y + 96, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                                               _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)), off), 1);
        }
        for (int u = 0; u < 16; u++) s[u] = d * (float)sc[u], o[u] = 0.0f;
        break;
    }
    }
}

/* The tile of the product: MM_ROWS rows (two vectors of MM_LANES) x MM_TOK inputs, one named
 * integer accumulator per input and vector (sixteen on AVX-512; eight on AVX2, whose sixteen
 * registers also hold the weights, the broadcast and vpmaddwd's products), each broadcast
 * input pair serving two products and each weight vector loaded once for all MM_TOK inputs.
 *
 * The rows' results (two vectors each) of inputs t0..t0+MM_TOK-1 over all units go to f[2 t]
 * and f[2 t + 1]. w: the unpacked group, [unit][pair][MM_ROWS rows][2]; ws, wo: [unit][MM_ROWS
 * rows]; xq: the inputs' int16 values (row stride k); xd, xs: per input and unit, the scale
 * and scale x integer sum (stride nu). Written out for each unit length so that the compiler
 * keeps the accumulators in registers. */
#ifdef MM_512
#define MM_LANES 16
#define MM_TOK 8
typedef __m512 mm_f;
typedef __m512i mm_i;
#define MM_ZERO_I _mm512_setzero_si512()
#define MM_ZERO_F _mm512_setzero_ps()
#define MM_LOAD_I(p) _mm512_load_si512(p)
#define MM_LOAD_F(p) _mm512_load_ps(p)
#define MM_SET1_I(v) _mm512_set1_epi32(v)
#define MM_SET1_F(v) _mm512_set1_ps(v)
#define MM_DPW(acc, a, b) DPW512(acc, a, b)
#define MM_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define MM_MUL(a, b) _mm512_mul_ps(a, b)
#define MM_CVT(a) _mm512_cvtepi32_ps(a)
#define MM_STORE_F(p, v) _mm512_storeu_ps(p, v)
#define MM_ACCS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define MM_UNROLL
#else
#define MM_LANES 8
#define MM_TOK 4
typedef __m256 mm_f;
typedef __m256i mm_i;
#define MM_ZERO_I _mm256_setzero_si256()
#define MM_ZERO_F _mm256_setzero_ps()
#define MM_LOAD_I(p) _mm256_load_si256((const __m256i *)(p))
#define MM_LOAD_F(p) _mm256_load_ps(p)
#define MM_SET1_I(v) _mm256_set1_epi32(v)
#define MM_SET1_F(v) _mm256_set1_ps(v)
#define MM_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define MM_MUL(a, b) _mm256_mul_ps(a, b)
#define MM_CVT(a) _mm256_cvtepi32_ps(a)
#define MM_STORE_F(p, v) _mm256_storeu_ps(p, v)
#define MM_ACCS(X) X(0) X(1) X(2) X(3)
/* the pairs' loop kept a loop: with the intrinsics, unrolled, gcc summed a unit's products in
 * a tree that spilled them to the stack (1.3-1.8x slower); with the asm step (mm_dp256)
 * unrolling by 4 gained 0-3% */
#define MM_UNROLL _Pragma("GCC unroll 1")
#endif
#define MM_ROWS (2 * MM_LANES)

#define MM_ACC(t) mm_i a##t = MM_ZERO_I, b##t = MM_ZERO_I;
#ifdef MM_512
static inline int32_t xpair(const int16_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}
#define MM_DP(t)                                                                 \
    {                                                                            \
        const mm_i xv = MM_SET1_I(xpair(xu + (size_t)(t) * k + 2 * p));          \
        a##t = MM_DPW(a##t, w0, xv);                                             \
        b##t = MM_DPW(b##t, w1, xv);                                             \
    }
#else
/* One input's step on 256-bit registers, as asm: for the intrinsics gcc 12 loaded each weight
 * vector again for every input (12 loads a step) or kept an accumulator on the stack, and the
 * product ran at 62 GMAC/s on a Zen 5 core where clang's code for the same source ran at 84. */
static inline __attribute__((always_inline)) void mm_dp256(__m256i *a, __m256i *b, __m256i w0, __m256i w1,
                                                            const int16_t *x) {
    __m256i xv;
#ifdef __AVXVNNI__
    __asm__("vpbroadcastd %4, %2\n\t"
            "%{vex%} vpdpwssd %2, %3, %0\n\t"
            "%{vex%} vpdpwssd %2, %5, %1"
            : "+x"(*a), "+x"(*b), "=&x"(xv)
            : "x"(w0), "m"(*(const int32_t *)x), "x"(w1));
#else
    __m256i pr;
    __asm__("vpbroadcastd %5, %2\n\t"
            "vpmaddwd %2, %4, %3\n\t"
            "vpaddd %3, %0, %0\n\t"
            "vpmaddwd %2, %6, %2\n\t"
            "vpaddd %2, %1, %1"
            : "+x"(*a), "+x"(*b), "=&x"(xv), "=&x"(pr)
            : "x"(w0), "m"(*(const int32_t *)x), "x"(w1));
#endif
}
#define MM_DP(t) mm_dp256(&a##t, &b##t, w0, w1, xu + (size_t)(t) * k + 2 * p);
#endif
#define MM_F(t)                                                                                 \
    {                                                                                           \
        const mm_f d = MM_SET1_F(xd[(t) * nu + u]), o = MM_SET1_F(xs[(t) * nu + u]);            \
        f[2 * (t)] = MM_FMADD(MM_CVT(a##t), MM_MUL(s0, d), f[2 * (t)]);                          \
        f[2 * (t)] = MM_FMADD(o0, o, f[2 * (t)]);                                               \
        f[2 * (t) + 1] = MM_FMADD(MM_CVT(b##t), MM_MUL(s1, d), f[2 * (t) + 1]);                  \
        f[2 * (t) + 1] = MM_FMADD(o1, o, f[2 * (t) + 1]);                                       \
    }
#define MM_TILE(NAME, UNIT)                                                                                  \
    static void NAME(const int16_t *w, const float *ws, const float *wo, const int16_t *xq, const float *xd, \
                     const float *xs, int k, int nu, mm_f f[2 * MM_TOK]) {                                  \
        for (int t = 0; t < 2 * MM_TOK; t++) f[t] = MM_ZERO_F;                                               \
        for (int u = 0; u < nu; u++) {                                                                       \
            MM_ACCS(MM_ACC)                                                                                  \
            const int16_t *wu = w + (size_t)u * (UNIT) * MM_ROWS, *xu = xq + u * (UNIT);                     \
            MM_UNROLL for (int p = 0; p < (UNIT) / 2; p++) {                                                 \
                const mm_i w0 = MM_LOAD_I(wu + p * 2 * MM_ROWS);                                             \
                const mm_i w1 = MM_LOAD_I(wu + p * 2 * MM_ROWS + MM_ROWS);                                   \
                MM_ACCS(MM_DP)                                                                               \
            }                                                                                                \
            const mm_f s0 = MM_LOAD_F(ws + u * MM_ROWS), s1 = MM_LOAD_F(ws + u * MM_ROWS + MM_LANES);        \
            const mm_f o0 = MM_LOAD_F(wo + u * MM_ROWS), o1 = MM_LOAD_F(wo + u * MM_ROWS + MM_LANES);        \
            MM_ACCS(MM_F)                                                                                    \
        }                                                                                                    \
    }

MM_TILE(mm_tile32, 32)
MM_TILE(mm_tile16, 16)

#ifdef MM_512
/* out[c][r] = in[r][c] for a 16 x 16 block of int32 (in: row stride `stride`; out: 16 rows of
 * 16, contiguous): unpack pairs, then quads, then 128-bit lanes twice. */
static void transpose16(const int32_t *in, int stride, int32_t *out, int ostride) {
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(in + (size_t)i * stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + k], lane L: column 4 L + k of rows i..i+3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
        _mm512_storeu_si512(out + (size_t)k * ostride, _mm512_shuffle_i32x4(a, c, 0x88));
        _mm512_storeu_si512(out + (size_t)(4 + k) * ostride, _mm512_shuffle_i32x4(b, d, 0x88));
        _mm512_storeu_si512(out + (size_t)(8 + k) * ostride, _mm512_shuffle_i32x4(a, c, 0xdd));
        _mm512_storeu_si512(out + (size_t)(12 + k) * ostride, _mm512_shuffle_i32x4(b, d, 0xdd));
    }
}
#endif

/* A block of the group (stage: [MM_ROWS rows][QK_K] int16, bl used) into w's layout: pairs
 * of values as int32, [rows][bl / 2] -> [bl / 2][rows], 16 (AVX-512) or 8 rows at a time. */
static void mm_lay_out(const int16_t *stage, int16_t *w, int blk, int bl) {
#ifdef MM_512
    for (int h = 0; h < MM_ROWS; h += 16)
        for (int c = 0; c < bl / 2; c += 16)
            transpose16((const int32_t *)stage + h * QK_K / 2 + c, QK_K / 2,
                        (int32_t *)w + ((size_t)blk * bl / 2 + c) * MM_ROWS + h, MM_ROWS);
#else
    for (int h = 0; h < MM_ROWS; h += 8)
        for (int c = 0; c < bl / 2; c += 8) {
            __m256i v[8];
            for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)((const int32_t *)stage + (h + r) * QK_K / 2 + c));
            transpose8x8_epi32(v);
            for (int i = 0; i < 8; i++)
                _mm256_store_si256((__m256i *)((int32_t *)w + ((size_t)blk * bl / 2 + c + i) * MM_ROWS + h), v[i]);
        }
#endif
}

/* Round n up to a multiple of 64 (aligned_alloc wants whole alignments). */
static size_t up64(size_t n) { return (n + 63) / 64 * 64; }

typedef struct {
    const Mat *m;
    const float *x;
    int n;
    float *y;
    int16_t *xq;
    float *xd, *xs;
    atomic_int next;   /* the next group of rows (a dynamic schedule) */
    atomic_int failed; /* a thread without its buffers */
} MatmulJob;

/* chatbot_matmul on each thread of its team: a share of the inputs as int16, then groups of
 * MM_ROWS rows, each to the next thread free (a dynamic schedule). */
static void matmul_team(void *arg) {
    MatmulJob *job = arg;
    const Mat *m = job->m;
    const float *x = job->x;
    const int n = job->n;
    float *y = job->y;
    int16_t *xq = job->xq;
    float *xd = job->xd, *xs = job->xs;
    const int unit = mm_unit(m->fmt), groups = (m->rows + MM_ROWS - 1) / MM_ROWS;
    const int k = m->cols, nu = k / unit, np = (n + MM_TOK - 1) / MM_TOK * MM_TOK;
    const int bl = block_len(m->fmt), upb = bl / unit;
    const Span inputs = team_share(np);
    for (int t = inputs.lo; t < inputs.hi; t++) {
        for (int u = 0; u < nu; u++) {
            int16_t *q = xq + (size_t)t * k + u * unit;
            if (t >= n) { /* padding inputs: zero */
                memset(q, 0, (size_t)unit * 2);
                xd[t * nu + u] = xs[t * nu + u] = 0.0f;
                continue;
            }
            const float *b = x + (size_t)t * k + u * unit;
            float amax = 0.0f;
            for (int i = 0; i < unit; i++) amax = fabsf(b[i]) > amax ? fabsf(b[i]) : amax;
            const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < unit; i++) {
                q[i] = (int16_t)nearbyintf(b[i] * id);
                sum += q[i];
            }
            xd[t * nu + u] = d;
            xs[t * nu + u] = d * (float)sum;
        }
    }
    team_barrier();
    int16_t *w = aligned_alloc(64, up64((size_t)MM_ROWS * k * 2));
    float *ws = aligned_alloc(64, up64((size_t)nu * MM_ROWS * 4)), *wo = aligned_alloc(64, up64((size_t)nu * MM_ROWS * 4));
    const int ok = w && ws && wo;
    if (!ok) atomic_store(&job->failed, 1); /* the caller computes it all otherwise */
    int16_t stage[MM_ROWS * QK_K] __attribute__((aligned(64)));
    float sb[QK_K / 16], ob[QK_K / 16];
    for (int g = team_next(&job->next); g < groups; g = team_next(&job->next)) {
        if (!ok) continue;
        const int r0 = g * MM_ROWS, nr = m->rows - r0 < MM_ROWS ? m->rows - r0 : MM_ROWS;
        for (int blk = 0; blk < k / bl; blk++) {
            for (int r = 0; r < MM_ROWS; r++) {
                if (r < nr) {
                    uint8_t tmp[256];
                    mm_unpack_block(m->fmt, block_at(m, r0 + r, blk, tmp), stage + r * QK_K, sb, ob);
                } else { /* rows past the end: zero weights */
                    memset(stage + r * QK_K, 0, sizeof(int16_t) * QK_K);
                    memset(sb, 0, sizeof sb);
                    memset(ob, 0, sizeof ob);
                }
                for (int u = 0; u < upb; u++) {
                    ws[(blk * upb + u) * MM_ROWS + r] = sb[u];
                    wo[(blk * upb + u) * MM_ROWS + r] = ob[u];
                }
            }
            mm_lay_out(stage, w, blk, bl);
        }
        for (int t0 = 0; t0 < np; t0 += MM_TOK) {
            mm_f out[2 * MM_TOK];
            float row[MM_ROWS];
            (unit == 32 ? mm_tile32 : mm_tile16)(w, ws, wo, xq + (size_t)t0 * k, xd + t0 * nu, xs + t0 * nu, k, nu, out);
            for (int t = 0; t < MM_TOK && t0 + t < n; t++) {
                float *to = y + (size_t)(t0 + t) * m->rows + r0;
                if (nr == MM_ROWS) {
                    MM_STORE_F(to, out[2 * t]);
                    MM_STORE_F(to + MM_LANES, out[2 * t + 1]);
                } else { /* the last group: its rows only */
                    MM_STORE_F(row, out[2 * t]);
                    MM_STORE_F(row + MM_LANES, out[2 * t + 1]);
                    memcpy(to, row, sizeof(float) * (size_t)nr);
                }
            }
        }
    }
    free(w);
    free(ws);
    free(wo);
}

/* Y [n, rows] = X [n, cols] W^T with int16 inputs (see above). Returns 0, or -1 (nothing
 * written) for a format without a batched product or memory refused. */
int chatbot_matmul(const Mat *m, const float *x, int n, float *y, int n_threads) {
    const int unit = mm_unit(m->fmt);
    if (!unit || n < 1 || m->cols % block_len(m->fmt)) return -1;
    const int k = m->cols, nu = k / unit, np = (n + MM_TOK - 1) / MM_TOK * MM_TOK;
    int16_t *xq = aligned_alloc(64, up64((size_t)np * k * 2));
    float *xd = aligned_alloc(64, up64((size_t)np * nu * 4)), *xs = aligned_alloc(64, up64((size_t)np * nu * 4));
    if (!xq || !xd || !xs) {
        free(xq);
        free(xd);
        free(xs);
        return -1;
    }
    MatmulJob job = {m, x, n, y, xq, xd, xs, 0, 0};
    team_run(n_threads, matmul_team, &job);
    free(xq);
    free(xd);
    free(xs);
    return atomic_load(&job.failed) ? -1 : 0;
}
#else
int chatbot_matmul(const Mat *m, const float *x, int n, float *y, int n_threads) {
    (void)m, (void)x, (void)n, (void)y, (void)n_threads;
    return -1; /* the caller dequantizes and multiplies in float32 */
}
#endif

/* ---------------------------------------------------------------- batched int8 products (prefill)
 *
 * Y = X W^T for n inputs at once with int8 inputs (ACT_Q8: per super-block of 256, ggml's
 * Q8_K, as the one-token tile products take them and llama.cpp prefills), on matrices in 8-row
 * tiles (Q4_K, Q6_K; chatbot_repack). The tile's lanes are its rows, 4 weights each, so one
 * vpmaddubsw multiplies 8 rows by 4 inputs' values (a broadcast u32) and its pairs stay exact
 * in int16 for several steps: 32 multiplies an instruction where the batched int16 product's
 * vpmaddwd does 16, and the weights read as stored (4 or 6 bits), not unpacked to int16 per
 * call. Each tile's weights, loaded once, serve X8_TOK inputs; a sub-block's nibbles are split
 * once for them all. A tile's integer sums over a super-block stay exact in int32: Q4_K 8 x 32
 * x 15 x 127 x 63 < 2^28, Q6_K 16 x 16 x 63 x 127 x 127 < 2^29. */
#if defined(CB_AVX2)
#define X8_TOK 4
/* loops of the weights kept as loops: unrolled, gcc computes every product of a loop before
 * adding them up and spills them to the stack (as MM_UNROLL) */
#define X8_NO_UNROLL _Pragma("GCC unroll 1")

/* An input's int8 form for the tile products: values, the scale per 256, sums per 32 and 16 */
typedef struct {
    int8_t *q;
    float *d;
    int16_t *s32, *s16;
} X8Inputs;

/* input x (k values) into row t of `in`: as prepare_k rounds for ACT_Q8 (amax / 127, round
 * to nearest even) */
static void x8_quantize(const float *x, int k, X8Inputs *in, int t) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int8_t *q = in->q + (size_t)t * k;
    for (int i = 0; i < k / QK_K; i++) {
        const float *b = x + i * QK_K;
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(b + j)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        for (int j = 0; j < QK_K; j += 16) {
            const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(b + j), vid));
            const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(b + j + 8), vid));
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8); /* 16 int16 in order */
            const __m128i b8 = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(q + i * QK_K + j), b8);
            __m128i s = _mm_add_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            s = _mm_add_epi16(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi16(s, _mm_shuffle_epi32(s, 0xb1));
            s = _mm_add_epi16(s, _mm_srli_epi32(s, 16));
            in->s16[(size_t)t * (k / 16) + (i * QK_K + j) / 16] = (int16_t)_mm_cvtsi128_si32(s);
        }
        in->d[(size_t)t * (k / QK_K) + i] = d;
    }
    for (int u = 0; u < k / QK; u++) {
        const int16_t *s = in->s16 + (size_t)t * (k / 16) + 2 * u;
        in->s32[(size_t)t * (k / QK) + u] = (int16_t)(s[0] + s[1]);
    }
}

/* Q4_K tile (8 rows) x X8_TOK inputs (nt of them real): out[t][r] += the rows' sums. */
static __attribute__((unused)) void x8_q4_k(const uint8_t *tile, int k, const X8Inputs *in, int t0, int nt, float out[X8_TOK][8]) {
    const int nb = k / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[X8_TOK], accm[X8_TOK];
    for (int t = 0; t < X8_TOK; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    const int8_t *x[X8_TOK];
    int row[X8_TOK]; /* the inputs; past the nt real ones, the first again */
    for (int t = 0; t < X8_TOK; t++) {
        row[t] = t0 + (t < nt ? t : 0);
        x[t] = in->q + (size_t)row[t] * k;
    }
    for (int i = 0; i < nb; i++, tile += 1152) {
        TILE_PREFETCH(tile, 1152);
        const K4Scales s = k4_tile_scales(tile);
        const uint8_t *q = tile + 128;
        __m256i S[X8_TOK];
        for (int t = 0; t < X8_TOK; t++) S[t] = _mm256_setzero_si256();
        X8_NO_UNROLL for (int b = 0; b < 8; b++) { /* sub-block b: the low nibbles of chunk b / 2, or the high */
            const int j = b >> 1, sh = 4 * (b & 1), at = i * QK_K + 64 * j + 32 * (b & 1);
            __m256i h[X8_TOK];
            for (int t = 0; t < X8_TOK; t++) h[t] = _mm256_setzero_si256();
            X8_NO_UNROLL for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * (8 * j + g))), sh), m4);
                for (int t = 0; t < X8_TOK; t++) h[t] = _mm256_add_epi16(h[t], _mm256_maddubs_epi16(w, bcast4(x[t] + at + 4 * g)));
            }
            const __m256i a = k4_lane_byte(s.sc03, s.sc47, b), pa = _mm256_or_si256(a, _mm256_slli_epi32(a, 16));
            for (int t = 0; t < X8_TOK; t++) S[t] = _mm256_add_epi32(S[t], _mm256_madd_epi16(h[t], pa));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16)));
        /* the mins' term in int32: pairs of (min, the inputs' sum of 32), |.| < 63 x 4064 x 8 */
        __m256i M[X8_TOK];
        for (int t = 0; t < X8_TOK; t++) M[t] = _mm256_setzero_si256();
        for (int b = 0; b < 8; b += 2) {
            const __m256i pr = _mm256_or_si256(k4_lane_byte(s.mn03, s.mn47, b), _mm256_slli_epi32(k4_lane_byte(s.mn03, s.mn47, b + 1), 16));
            for (int t = 0; t < X8_TOK; t++) {
                int32_t xs;
                memcpy(&xs, in->s32 + (size_t)row[t] * (k / QK) + 8 * i + b, 4);
                M[t] = _mm256_add_epi32(M[t], _mm256_madd_epi16(pr, _mm256_set1_epi32(xs)));
            }
        }
        for (int t = 0; t < X8_TOK; t++) {
            const float dx = in->d[(size_t)row[t] * nb + i];
            const __m256 vx = _mm256_set1_ps(dx);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, vx), _mm256_cvtepi32_ps(S[t]), acc[t]);
            accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(dm, vx), _mm256_cvtepi32_ps(M[t]), accm[t]);
        }
    }
    for (int t = 0; t < X8_TOK; t++) _mm256_storeu_ps(out[t], _mm256_sub_ps(acc[t], accm[t]));
}

/* The 6-bit quants (0..63) of a Q6_K tile's values 128 n + 32 s + 4 g + (0..3), a u32 of 8 rows */
static inline __m256i k6_tile_quant(const uint8_t *tile, int n, int s, int g) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256((const __m256i *)(tile + 144 + 32 * (16 * n + 8 * (s & 1) + g)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(tile + 1168 + 32 * (8 * n + g)));
    const __m256i lo = s < 2 ? _mm256_and_si256(a, m4) : _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
    const __m256i hi = s == 3 ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4 - 2 * s);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
}

/* Q6_K tile (8 rows) x X8_TOK inputs, as x8_q4_k: the quants 0..63 against the inputs, less
 * 32 x the inputs' sums of 16, scaled per sub-block in int32. */
static __attribute__((unused)) void x8_q6_k(const uint8_t *tile, int k, const X8Inputs *in, int t0, int nt, float out[X8_TOK][8]) {
    const int nb = k / QK_K;
    __m256 acc[X8_TOK];
    for (int t = 0; t < X8_TOK; t++) acc[t] = _mm256_setzero_ps();
    const int8_t *x[X8_TOK];
    int row[X8_TOK]; /* the inputs; past the nt real ones, the first again */
    for (int t = 0; t < X8_TOK; t++) {
        row[t] = t0 + (t < nt ? t : 0);
        x[t] = in->q + (size_t)row[t] * k;
    }
    for (int i = 0; i < nb; i++, tile += 1680) {
        TILE_PREFETCH(tile, 1680);
        __m256i S[X8_TOK];
        for (int t = 0; t < X8_TOK; t++) S[t] = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++)
            _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) /* unrolled: each s its own bits */
                for (int hh = 0; hh < 2; hh++) { /* sub-block 8 n + 2 s + hh: values 128 n + 32 s + 16 hh + (0..15) */
                    const int bk = 8 * n + 2 * s + hh, at = i * QK_K + 128 * n + 32 * s + 16 * hh;
                    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 16 + 8 * bk)));
                    const __m256i ps = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(sc, 16));
                    X8_NO_UNROLL for (int g = 4 * hh; g < 4 * hh + 4; g += 2) { /* two pairs a lane: < 2^15 */
                        const __m256i w0 = k6_tile_quant(tile, n, s, g), w1 = k6_tile_quant(tile, n, s, g + 1);
                        const int c = at + 4 * (g - 4 * hh);
                        for (int t = 0; t < X8_TOK; t++) {
                            const __m256i h = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(x[t] + c)), _mm256_maddubs_epi16(w1, bcast4(x[t] + c + 4)));
                            S[t] = _mm256_add_epi32(S[t], _mm256_madd_epi16(h, ps));
                        }
                    }
                }
        /* the offset: 32 x sum over sub-blocks of scale x the inputs' sum of 16, per row */
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile));
        for (int t = 0; t < X8_TOK; t++) {
            const int16_t *s16 = in->s16 + (size_t)row[t] * (k / 16) + 16 * i;
            __m256i O = _mm256_setzero_si256();
            for (int bk = 0; bk < 16; bk += 2) {
                const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 16 + 8 * bk)));
                const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 16 + 8 * bk + 8)));
                const __m256i pr = _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(b, 16));
                int32_t xs;
                memcpy(&xs, s16 + bk, 4);
                O = _mm256_add_epi32(O, _mm256_madd_epi16(pr, _mm256_set1_epi32(xs)));
            }
            const __m256i D = _mm256_sub_epi32(S[t], _mm256_slli_epi32(O, 5));
            const float dx = in->d[(size_t)row[t] * nb + i];
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(D), acc[t]);
        }
    }
    for (int t = 0; t < X8_TOK; t++) _mm256_storeu_ps(out[t], acc[t]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* With AVX-512 VNNI: two tiles at once (16 rows, a 512-bit register: tile a's 8 rows in the low
 * half, b's in the high) and X8_TOK2 inputs a pass; vpdpbusd sums each lane's 4 byte products
 * into int32 (no int16 step), times the sub-block's scale with vpmulld: one instruction per 64
 * multiplies where the AVX2 form takes two per 32. A sub-block's int32 sum per row: Q4_K
 * 32 x 15 x 127 (x 63 < 2^22), Q6_K 16 x 63 x 127 (x 128 < 2^24); 8 or 16 of them a super-block. */
#define X8_TOK2 8
/* acc + w . the 4 bytes at p in every lane: vpdpbusd with its input broadcast from memory
 * (asm: gcc's intrinsic loads the broadcast into a register of its own) */
static inline __attribute__((always_inline)) __m512i dpb_bcast(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

static inline __m512i x8_pair(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }

static inline __m512i x8_pair_load(const uint8_t *a, const uint8_t *b) {
    return x8_pair(_mm256_loadu_si256((const __m256i *)a), _mm256_loadu_si256((const __m256i *)b));
}

static inline __m512 x8_pair_halves(const uint8_t *a, const uint8_t *b) { /* 8 fp16 of each tile */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)), _mm_loadu_si128((const __m128i *)b), 1));
}

static void x8_q4_k_pair(const uint8_t *ta, const uint8_t *tb, int k, const X8Inputs *in, int t0, int nt, float out[X8_TOK2][16]) {
    const int nb = k / QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[X8_TOK2], accm[X8_TOK2];
    const int8_t *x[X8_TOK2];
    int row[X8_TOK2];
    for (int t = 0; t < X8_TOK2; t++) {
        row[t] = t0 + (t < nt ? t : 0);
        x[t] = in->q + (size_t)row[t] * k;
        acc[t] = accm[t] = _mm512_setzero_ps();
    }
    for (int i = 0; i < nb; i++, ta += 1152, tb += 1152) {
        TILE_PREFETCH(ta, 1152);
        TILE_PREFETCH(tb, 1152);
        const K4Scales sa = k4_tile_scales(ta), sb = k4_tile_scales(tb);
        __m512i S[X8_TOK2];
        for (int t = 0; t < X8_TOK2; t++) S[t] = _mm512_setzero_si512();
        X8_NO_UNROLL for (int b = 0; b < 8; b++) { /* sub-block b: the low nibbles of chunk b / 2, or the high */
            const int j = b >> 1, sh = 4 * (b & 1), at = i * QK_K + 64 * j + 32 * (b & 1);
            __m512i h[X8_TOK2];
            for (int t = 0; t < X8_TOK2; t++) h[t] = _mm512_setzero_si512();
            X8_NO_UNROLL for (int g = 0; g < 8; g++) {
                const size_t o = 128 + 32 * (8 * j + g);
                const __m512i w = _mm512_and_si512(_mm512_srli_epi16(x8_pair_load(ta + o, tb + o), sh), m4);
                for (int t = 0; t < X8_TOK2; t++) h[t] = dpb_bcast(h[t], w, x[t] + at + 4 * g);
            }
            const __m512i sc = x8_pair(k4_lane_byte(sa.sc03, sa.sc47, b), k4_lane_byte(sb.sc03, sb.sc47, b));
            for (int t = 0; t < X8_TOK2; t++) S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(h[t], sc));
        }
        const __m512 d = x8_pair_halves(ta, tb), dm = x8_pair_halves(ta + 16, tb + 16);
        /* the mins' term in int32: pairs of (min, the inputs' sum of 32), |.| < 63 x 4064 x 8 */
        __m512i M[X8_TOK2];
        for (int t = 0; t < X8_TOK2; t++) M[t] = _mm512_setzero_si512();
        for (int b = 0; b < 8; b += 2) {
            const __m512i pr = _mm512_or_si512(x8_pair(k4_lane_byte(sa.mn03, sa.mn47, b), k4_lane_byte(sb.mn03, sb.mn47, b)),
                                               _mm512_slli_epi32(x8_pair(k4_lane_byte(sa.mn03, sa.mn47, b + 1), k4_lane_byte(sb.mn03, sb.mn47, b + 1)), 16));
            for (int t = 0; t < X8_TOK2; t++) {
                int32_t xs;
                memcpy(&xs, in->s32 + (size_t)row[t] * (k / QK) + 8 * i + b, 4);
                M[t] = _mm512_add_epi32(M[t], _mm512_madd_epi16(pr, _mm512_set1_epi32(xs)));
            }
        }
        for (int t = 0; t < X8_TOK2; t++) {
            const __m512 vx = _mm512_set1_ps(in->d[(size_t)row[t] * nb + i]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, vx), _mm512_cvtepi32_ps(S[t]), acc[t]);
            accm[t] = _mm512_fmadd_ps(_mm512_mul_ps(dm, vx), _mm512_cvtepi32_ps(M[t]), accm[t]);
        }
    }
    for (int t = 0; t < X8_TOK2; t++) _mm512_storeu_ps(out[t], _mm512_sub_ps(acc[t], accm[t]));
}

static void x8_q6_k_pair(const uint8_t *ta, const uint8_t *tb, int k, const X8Inputs *in, int t0, int nt, float out[X8_TOK2][16]) {
    const int nb = k / QK_K;
    __m512 acc[X8_TOK2];
    const int8_t *x[X8_TOK2];
    int row[X8_TOK2];
    for (int t = 0; t < X8_TOK2; t++) {
        row[t] = t0 + (t < nt ? t : 0);
        x[t] = in->q + (size_t)row[t] * k;
        acc[t] = _mm512_setzero_ps();
    }
    for (int i = 0; i < nb; i++, ta += 1680, tb += 1680) {
        TILE_PREFETCH(ta, 1680);
        TILE_PREFETCH(tb, 1680);
        __m512i S[X8_TOK2];
        for (int t = 0; t < X8_TOK2; t++) S[t] = _mm512_setzero_si512();
        for (int n = 0; n < 2; n++)
            _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) /* unrolled: each s its own bits */
                for (int hh = 0; hh < 2; hh++) { /* sub-block 8 n + 2 s + hh: values 128 n + 32 s + 16 hh + (0..15) */
                    const int bk = 8 * n + 2 * s + hh, at = i * QK_K + 128 * n + 32 * s + 16 * hh;
                    __m512i h[X8_TOK2];
                    for (int t = 0; t < X8_TOK2; t++) h[t] = _mm512_setzero_si512();
                    X8_NO_UNROLL for (int g = 4 * hh; g < 4 * hh + 4; g++) {
                        const __m512i w = x8_pair(k6_tile_quant(ta, n, s, g), k6_tile_quant(tb, n, s, g));
                        for (int t = 0; t < X8_TOK2; t++) h[t] = dpb_bcast(h[t], w, x[t] + at + 4 * (g - 4 * hh));
                    }
                    const __m512i sc = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(ta + 16 + 8 * bk)),
                                                                                _mm_loadl_epi64((const __m128i *)(tb + 16 + 8 * bk))));
                    for (int t = 0; t < X8_TOK2; t++) S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(h[t], sc));
                }
        /* the offset: 32 x sum over sub-blocks of scale x the inputs' sum of 16, per row */
        __m512i O[X8_TOK2];
        for (int t = 0; t < X8_TOK2; t++) O[t] = _mm512_setzero_si512();
        for (int bk = 0; bk < 16; bk += 2) {
            const __m512i a = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(ta + 16 + 8 * bk)),
                                                                       _mm_loadl_epi64((const __m128i *)(tb + 16 + 8 * bk))));
            const __m512i c = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(ta + 24 + 8 * bk)),
                                                                       _mm_loadl_epi64((const __m128i *)(tb + 24 + 8 * bk))));
            const __m512i pr = _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(c, 16));
            for (int t = 0; t < X8_TOK2; t++) {
                int32_t xs;
                memcpy(&xs, in->s16 + (size_t)row[t] * (k / 16) + 16 * i + bk, 4);
                O[t] = _mm512_add_epi32(O[t], _mm512_madd_epi16(pr, _mm512_set1_epi32(xs)));
            }
        }
        const __m512 d = x8_pair_halves(ta, tb);
        for (int t = 0; t < X8_TOK2; t++) {
            const __m512i D = _mm512_sub_epi32(S[t], _mm512_slli_epi32(O[t], 5));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(in->d[(size_t)row[t] * nb + i])), _mm512_cvtepi32_ps(D), acc[t]);
        }
    }
    for (int t = 0; t < X8_TOK2; t++) _mm512_storeu_ps(out[t], acc[t]);
}
#endif

typedef struct {
    const Mat *m;
    const float *x;
    int n;
    float *y;
    X8Inputs in;
    atomic_int next;
} MatmulX8Job;

static void matmul_x8_team(void *arg) {
    MatmulX8Job *job = arg;
    const Mat *m = job->m;
    const int k = m->cols, n = job->n, groups = m->rows / X8;
    const Span mine = team_share(n);
    for (int t = mine.lo; t < mine.hi; t++) x8_quantize(job->x + (size_t)t * k, k, &job->in, t);
    team_barrier();
    const size_t rb = row_bytes(m);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    for (int p = team_next(&job->next); 2 * p < groups; p = team_next(&job->next)) { /* tiles 2p, 2p + 1 */
        const int two = 2 * p + 1 < groups, rows = two ? 16 : 8;
        const uint8_t *ta = (const uint8_t *)m->data + (size_t)2 * p * X8 * rb, *tb = two ? ta + X8 * rb : ta;
        for (int t0 = 0; t0 < n; t0 += X8_TOK2) {
            float out[X8_TOK2][16];
            const int nt = n - t0 < X8_TOK2 ? n - t0 : X8_TOK2;
            (m->fmt == FMT_Q4_K ? x8_q4_k_pair : x8_q6_k_pair)(ta, tb, k, &job->in, t0, nt, out);
            for (int t = 0; t < nt; t++) memcpy(job->y + (size_t)(t0 + t) * m->rows + 2 * p * X8, out[t], rows * sizeof(float));
        }
    }
#else
    for (int g = team_next(&job->next); g < groups; g = team_next(&job->next)) {
        const uint8_t *tile = (const uint8_t *)m->data + (size_t)g * X8 * rb;
        for (int t0 = 0; t0 < n; t0 += X8_TOK) {
            float out[X8_TOK][8];
            const int nt = n - t0 < X8_TOK ? n - t0 : X8_TOK;
            (m->fmt == FMT_Q4_K ? x8_q4_k : x8_q6_k)(tile, k, &job->in, t0, nt, out);
            for (int t = 0; t < nt; t++) memcpy(job->y + (size_t)(t0 + t) * m->rows + g * X8, out[t], sizeof out[t]);
        }
    }
#endif
}

/* Y [n, rows] = X [n, cols] W^T with int8 inputs (ACT_Q8, see above), for a matrix in 8-row
 * tiles. Returns 0, or -1 (nothing written) where there is no such product (not tiled, another
 * format, this CPU) or memory was refused: the caller takes the int16 product then. */
int chatbot_matmul_x8(const Mat *m, const float *x, int n, float *y, int n_threads) {
    if (!m->x8 || !has_tiles(m->fmt) || n < 1 || m->cols % QK_K || m->rows % X8) return -1;
    const int k = m->cols;
    X8Inputs in = {aligned_alloc(64, up64((size_t)n * k)), aligned_alloc(64, up64((size_t)n * (k / QK_K) * 4)),
                   aligned_alloc(64, up64((size_t)n * (k / QK) * 2)), aligned_alloc(64, up64((size_t)n * (k / 16) * 2))};
    int ok = in.q && in.d && in.s32 && in.s16;
    if (ok) {
        MatmulX8Job job = {m, x, n, y, in, 0};
        team_run(n_threads, matmul_x8_team, &job);
    }
    free(in.q);
    free(in.d);
    free(in.s32);
    free(in.s16);
    return ok ? 0 : -1;
}
#else
int chatbot_matmul_x8(const Mat *m, const float *x, int n, float *y, int n_threads) {
    (void)m, (void)x, (void)n, (void)y, (void)n_threads;
    return -1;
}
#endif

typedef struct {
    const float *w;
    int rows, cols, fmt;
    void *out;
    atomic_uint worst, biggest; /* float bits (both >= 0) */
} QuantizeJob;

static void quantize_team(void *arg) {
    QuantizeJob *job = arg;
    const float *w = job->w;
    const int cols = job->cols, fmt = job->fmt, nb = cols / QK;
    void *out = job->out;
    float worst = 0.0f, biggest = 0.0f;
    const Span share = team_share(job->rows);
    for (int n = share.lo; n < share.hi; n++) {
        const float *row = w + (size_t)n * cols;
        for (int j = 0; j < nb; j++) {
            const float *x = row + j * QK;
            if (fmt == FMT_Q8_0) {
                block_q8_0 *b = (block_q8_0 *)out + (size_t)n * nb + j;
                float amax = 0.0f;
                for (int i = 0; i < QK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
                biggest = amax > biggest ? amax : biggest;
                b->d = f32_to_fp16(amax / 127.0f);
                const float d = fp16_to_f32(b->d), id = d > 0.0f ? 1.0f / d : 0.0f;
                for (int i = 0; i < QK; i++) {
                    float q = nearbyintf(x[i] * id);
                    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                    b->qs[i] = (int8_t)q;
                    const float e = fabsf(x[i] - d * q);
                    worst = e > worst ? e : worst;
                }
            } else {
                block_q4_1 *b = (block_q4_1 *)out + (size_t)n * nb + j;
                float lo = x[0], hi = x[0];
                for (int i = 1; i < QK; i++) {
                    lo = x[i] < lo ? x[i] : lo;
                    hi = x[i] > hi ? x[i] : hi;
                }
                biggest = fabsf(lo) > biggest ? fabsf(lo) : biggest;
                biggest = fabsf(hi) > biggest ? fabsf(hi) : biggest;
                b->m = f32_to_fp16(lo);
                b->d = f32_to_fp16((hi - lo) / 15.0f);
                const float m = fp16_to_f32(b->m), d = fp16_to_f32(b->d);
                const float id = d > 0.0f ? 1.0f / d : 0.0f;
                uint8_t q[QK];
                for (int i = 0; i < QK; i++) {
                    float v = nearbyintf((x[i] - m) * id);
                    v = v > 15.0f ? 15.0f : (v < 0.0f ? 0.0f : v);
                    q[i] = (uint8_t)v;
                    const float e = fabsf(x[i] - (d * v + m));
                    worst = e > worst ? e : worst;
                }
                for (int i = 0; i < QK / 2; i++) b->qs[i] = (uint8_t)(q[i] | (q[i + 16] << 4));
            }
        }
    }
    team_max(&job->worst, worst);
    team_max(&job->biggest, biggest);
}

/* Pack float32 rows [rows, cols] into Q8_0 or Q4_1 at `out`. stats[0]: the largest
 * |w - dequantized w| (0 for a matrix that was in that format already); stats[1]: the
 * largest |w|. */
void chatbot_quantize(const float *w, int rows, int cols, int fmt, void *out, int n_threads, float *stats) {
    QuantizeJob job = {w, rows, cols, fmt, out, 0, 0};
    team_run(n_threads, quantize_team, &job);
    stats[0] = bits_float(atomic_load(&job.worst));
    stats[1] = bits_float(atomic_load(&job.biggest));
}
