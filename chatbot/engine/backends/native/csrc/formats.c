/* The weight formats: each format's block (`block_len`, `block_bytes`, `dequant_block`: every
 * ggml layout) and its row product with float32 inputs (ACT_F32).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

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
 *   MXFP4 32: one E8M0 byte e, 16 bytes of 4-bit E2M1 codes  w = 2^(e - 128) k
 *         (gpt-oss's experts; the OCP microscaling format). A code is a sign, a 2-bit
 *         exponent and a 1-bit mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6. ggml keeps them doubled,
 *         as the integers k of mxfp4_values, and halves the scale 2^(e - 127) to match, so
 *         the integer products multiply k itself. e = 0 and 1 give the subnormal scales
 *         2^-128 and 2^-127, e = 255 gives 2^127 (the OCP format's NaN is not one in ggml).
 * Byte j of a 32-block's nibbles holds q[j] (low) and q[j + 16] (high), as for Q4_1.
 */

/* the E2M1 codes' values, doubled (code 8 is -0) */
static const int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An MXFP4 block's scale, halved: 2^(e - 128) exactly. From its bits: the exponent field
 * e - 1 for e >= 2, else the subnormal whose one mantissa bit is 2^-127 (e = 1) or 2^-128. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x400000u >> (1 - e);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

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
    case FMT_MXFP4: return 17;
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
    case FMT_MXFP4: {
        const float d = e8m0_half(b[0]);
        for (int i = 0; i < QK / 2; i++) {
            y[i] = d * (float)mxfp4_values[b[1 + i] & 0x0f];
            y[i + 16] = d * (float)mxfp4_values[b[1 + i] >> 4];
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

/* 16 bytes of MXFP4 codes as their doubled values: 32 signed bytes, the low nibbles' first */
static inline __m256i mxfp4_bytes(const uint8_t *qs) {
    const __m128i table = _mm_loadu_si128((const __m128i *)mxfp4_values), m4 = _mm_set1_epi8(0x0f);
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, m4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    return _mm256_set_m128i(hi, lo);
}

/* MXFP4 . float32 x: per block 2^(e - 128) sum(k x), the codes looked up as bytes (pshufb) */
static float dot_mxfp4(const uint8_t *row, const float *x, int k) {
    const int nb = k / QK;
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++, row += 17, x += QK) {
        const __m256i w = mxfp4_bytes(row + 1);
        const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
        __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x));
        p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + 8), p);
        p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + 16), p);
        p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + 24), p);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(row[0])), p, acc);
    }
    return hsum256(acc);
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

/* 16 bytes of MXFP4 codes as their doubled values (lo: the low nibbles', hi: the high ones') */
static inline void mxfp4_bytes(const uint8_t *qs, int8x16_t *lo, int8x16_t *hi) {
    const int8x16_t table = vld1q_s8(mxfp4_values);
    const uint8x16_t raw = vld1q_u8(qs);
    *lo = vqtbl1q_s8(table, vandq_u8(raw, vdupq_n_u8(0x0f)));
    *hi = vqtbl1q_s8(table, vshrq_n_u8(raw, 4));
}

static float dot_mxfp4(const uint8_t *row, const float *x, int k) {
    const int nb = k / QK;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int j = 0; j < nb; j++, row += 17, x += QK) {
        int8x16_t lo, hi;
        mxfp4_bytes(row + 1, &lo, &hi);
        const float32x4_t p = fma_s8x16(fma_s8x16(vdupq_n_f32(0.0f), lo, x), hi, x + 16);
        acc = vfmaq_n_f32(acc, p, e8m0_half(row[0]));
    }
    return vaddvq_f32(acc);
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

