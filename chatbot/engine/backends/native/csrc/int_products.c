/* An input vector's integer forms (Vec: int8 or int16 per block of 32, and per super-block of
 * 256 for the K-quants) and each format's row products on them (ACT_Q8, ACT_I16).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

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
/* the largest |x| of a super-block's 256 values */
static inline float amax_super(const float *b) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int t = 0; t < QK_K; t += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(b + t)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* A super-block's 256 values b as int8 (ggml's Q8_K, ACT_Q8's K-quant form: scale amax / 127,
 * rounded to nearest even as nearbyintf, as prepare_k) into q in order, and the sums of its
 * 16 runs of 16 values into s16 (|.| <= 16 x 127); returns the scale. The batched int8
 * products' inputs (prefill_x8.c, experts.c) are made by it. */
static inline float q8_super(const float *b, int8_t *q, int16_t *s16) {
    const float d = amax_super(b) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    for (int j = 0; j < QK_K; j += 16) {
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(b + j), vid));
        const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(b + j + 8), vid));
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8); /* 16 int16 in order */
        _mm_storeu_si128((__m128i *)(q + j), _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
        __m128i s = _mm_add_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        s = _mm_add_epi16(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi16(s, _mm_shuffle_epi32(s, 0xb1));
        s = _mm_add_epi16(s, _mm_srli_epi32(s, 16));
        s16[j / 16] = (int16_t)_mm_cvtsi128_si32(s);
    }
    return d;
}

/* The K-quant form of an ACT_I16 or ACT_Q8 vector (once per vector, before its first K-quant product;
 * a vector shared by threads must be made ready before they start). One scale per
 * super-block lets a whole super-block's products add up in int32 before one conversion to
 * float, as the K-quants' own integer sub-block scales allow; int16 is still 128x finer than
 * llama.cpp's int8 per 256 (ggml's Q8_K), which ACT_Q8 is. */
static void prepare_k(Vec *v) {
    if (v->kready) return; /* ready_for calls it for int16 inputs of whole super-blocks only */
    for (int i = 0; i < v->k / QK_K; i++) {
        const float *b = v->x + i * QK_K;
        const float d = amax_super(b) / k_top(v), id = d > 0.0f ? 1.0f / d : 0.0f;
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

/* MXFP4 . integer activations: per block 2^(e - 128) dx sum(k qx), k the codes' doubled
 * values (|k| <= 12, mxfp4_values): int8 inputs (ACT_Q8) by byte products, int16 ones
 * (ACT_I16) by 16-bit ones, the sums exact integers either way. */
#ifdef CB_AVX2
/* acc + the block's scale times sum(k qx) (int8 inputs) */
static inline __m256 mxfp4_q8_block(const uint8_t *b, const Vec *v, int j, __m256 acc) {
    const __m256i w = mxfp4_bytes(b + 1);
    const __m256i x = _mm256_loadu_si256((const __m256i *)(v->q + j * QK));
    /* maddubs wants unsigned x signed: move the sign of w onto x (|k| 12, |qx| 127: no pair
     * saturates) */
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(b[0]) * v->qd[j]), sum_i16_pairs_ps(p), acc);
}

/* the same with int16 inputs */
static inline __m256 mxfp4_i16_block(const uint8_t *b, const Vec *v, int j, __m256 acc) {
    const __m256i w = mxfp4_bytes(b + 1);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
    const __m256 p = i16_block_sums(w0, w1, v->q16 + j * QK);
    return _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(b[0]) * v->qd[j]), p, acc);
}

/* Two blocks per step into two accumulators, as dot_q8_0_i16 (one chain of dependent FMAs
 * would wait on their latency). */
#define CB_MXFP4_DOT(name, block)                                                                  \
    static float name(const uint8_t *row, const Vec *v, int k) {                                   \
        const int nb = k / QK;                                                                     \
        __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                              \
        int j = 0;                                                                                 \
        for (; j + 2 <= nb; j += 2, row += 34) {                                                   \
            _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);                               \
            acc = block(row, v, j, acc);                                                           \
            acc1 = block(row + 17, v, j + 1, acc1);                                                \
        }                                                                                          \
        if (j < nb) acc = block(row, v, j, acc);                                                   \
        return hsum256(_mm256_add_ps(acc, acc1));                                                  \
    }
CB_MXFP4_DOT(dot_mxfp4_q8, mxfp4_q8_block)
CB_MXFP4_DOT(dot_mxfp4_i16, mxfp4_i16_block)
#undef CB_MXFP4_DOT
#elif defined(CB_NEON)
static float dot_mxfp4_q8(const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK;
    float s = 0.0f;
    for (int j = 0; j < nb; j++, row += 17) {
        int8x16_t lo, hi;
        mxfp4_bytes(row + 1, &lo, &hi);
        const int8_t *x = v->q + j * QK;
        s += e8m0_half(row[0]) * v->qd[j] * (float)dot_i8x32(lo, vld1q_s8(x), hi, vld1q_s8(x + 16));
    }
    return s;
}

static float dot_mxfp4_i16(const uint8_t *row, const Vec *v, int k) {
    const int nb = k / QK;
    float s = 0.0f;
    for (int j = 0; j < nb; j++, row += 17) {
        int8x16_t lo, hi;
        mxfp4_bytes(row + 1, &lo, &hi);
        s += e8m0_half(row[0]) * v->qd[j] * (float)dot_s8_i16x32(lo, hi, v->q16 + j * QK);
    }
    return s;
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

