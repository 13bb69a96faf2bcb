/* What every part uses: the headers, the SIMD level this build compiles to (CB_AVX2, CB_NEON),
 * the formats' and input forms' codes, the blocks of Q8_0 and Q4_1, the structs the Python side
 * mirrors (Mat, Group, Model: kernel_abi.py), and the scalar and vector helpers.
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

#ifndef CHATBOT_KERNELS_H
#define CHATBOT_KERNELS_H

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
    FMT_Q5_1 = 7, FMT_Q2_K = 8, FMT_Q3_K = 9, FMT_Q4_K = 10, FMT_Q5_K = 11, FMT_Q6_K = 12, FMT_MXFP4 = 13
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
    /* A mixture of experts (0 experts: a dense MLP). Then wgu's two parts hold every expert's
     * gate and up rows ([n_experts * expert_dim, dim] each, expert e's rows from e * expert_dim)
     * and wdown's one part every expert's down rows ([n_experts * dim, expert_dim]), as the
     * file's 3-D tensors lay them out; ffn_dim is the widest of expert_dim and the shared
     * expert's width (scratch). */
    int32_t n_experts, n_experts_used;
    int32_t norm_topk; /* the chosen experts' weights renormalised to sum to 1 (qwen3moe) */
    int32_t expert_dim;
    const Mat *router; /* per layer [n_experts, dim]: the router's logits */
    /* qwen2moe's shared expert (NULL: none): per layer its gate and up rows, its down rows,
     * and the vector [dim] whose dot with the input, through a sigmoid, scales its output */
    const Group *shexp_gu;
    const Group *shexp_down;
    const float *const *shexp_gate;
    /* gpt-oss (NULL for the others), per layer: each head's learned sink logit [n_heads] (a
     * term exp(sink) in the head's softmax denominator), the router's bias [n_experts], the
     * experts' gate/up biases [n_experts, 2 * expert_dim] (expert e's gate's, then its up's)
     * and their down biases [n_experts, dim] */
    const float *const *sinks;
    const float *const *router_bias;
    const float *const *exp_gu_bias;
    const float *const *exp_down_bias;
} Model;

/* ACT_FN_SWIGLU_OAI: gpt-oss's clamped SwiGLU (swiglu_oai_mul) */
enum { ACT_FN_SILU = 0, ACT_FN_GELU_TANH = 1, ACT_FN_SWIGLU_OAI = 2 };
/* The most experts a token goes to (Model.n_experts_used) */
#define MAX_EXPERTS_USED 64

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

#endif
