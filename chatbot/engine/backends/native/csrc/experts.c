/* A mixture's routed experts for a batch of tokens (prefill): chatbot_experts, llama.cpp's
 * mul_mat_id. The tokens' slots (token t's j-th expert) are grouped by expert; each expert
 * with tokens is one unit of work, handed to the next thread free (a dynamic schedule: no
 * barrier between products, as a product of its own per expert and matrix would take), and
 * each of its three matrices is read once for all its tokens:
 *   - int8 inputs into Q4_K / Q6_K (AVX-512 VNNI, or AVX2): a multi-input int8 product (below);
 *   - int16 inputs from EX_MM_MIN tokens on (MXFP4: EX_MM_MIN_MXFP4): the batched int16
 *     product (prefill.c: the rows unpacked once, 32 at a time, then multiplied with 8 inputs
 *     a tile);
 *   - else row by row, each row multiplied with every token's input while it is in L1, by
 *     the decode step's own row product (dot_vec: a token's result is its decode result);
 *     MXFP4 rows (AVX2) by a multi-input form of it, each block's codes looked up once for
 *     up to 4 tokens, each token's result dot_vec's bit for bit (ex_rows_mxfp4).
 * Each slot's output goes to a row of its own; the slots of a token are then summed in order,
 * weighted, so which thread ran which expert never changes a bit of the result.
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

/* Fewest tokens of an expert that take the batched product (below: row by row). MXFP4 rows
 * by the multi-input product (ex_rows_mxfp4) cost less than the batched product's unpacking
 * below about 16 tokens an expert (gpt-oss-20b's shapes; docs/benchmarks.md). */
#define EX_MM_MIN 6
#define EX_MM_MIN_MXFP4 16
/* Inputs the row-by-row product keeps ready at a time */
#define EX_VECS 8

typedef struct {
    const Mat *gate, *up, *down; /* every expert's rows: [n_experts F, E], [n_experts F, E], [n_experts E, F] */
    int F, E, n, k, act_gu, act_down, act_fn;
    const float *x;      /* [n, E] */
    const float *w;      /* [n, k] the slots' weights */
    const float *gu_bias;   /* NULL, or [n_experts, 2 F]: expert e's gate bias, then its up bias */
    const float *down_bias; /* NULL, or [n_experts, E] */
    float *out;          /* [n, E] */
    const int32_t *slot; /* the slots t k + j, grouped by expert */
    const int32_t *first; /* expert e's slots: slot[first[e]] .. slot[first[e + 1] - 1] */
    const int32_t *queue; /* the experts with tokens, the most tokens first */
    int n_queue, most;    /* most: the most tokens of one expert */
    float *res;           /* [n k, E]: each slot's output */
    atomic_int next, failed;
} ExpertsJob;

/* One thread's buffers, for experts of up to `most` tokens and rows of up to K values. */
typedef struct {
    const float **xrow;
    float **yrow;
    float *gu, *hid, *vbuf;
    Vec v[EX_VECS];
    int16_t *xq, *w;
    float *xd, *xs, *ws, *wo;
    int8_t *q8;      /* [most, K] the inputs as int8 (ex_product_q8) */
    float *q8d, *q8s; /* [most, K / 256] their scales, [most, K / 16] their sums times the scale */
} ExBuffers;

static int ex_alloc(ExBuffers *b, int most, int E, int F) {
    const int K = E > F ? E : F, np = (most + 7) / 8 * 8 + 8;
    const long vf = vec_floats(K);
    memset(b, 0, sizeof *b);
    b->xrow = malloc(sizeof(float *) * (size_t)most);
    b->yrow = malloc(sizeof(float *) * (size_t)most);
    b->gu = malloc(sizeof(float) * (size_t)most * 2 * F);
    b->hid = malloc(sizeof(float) * (size_t)most * F);
    b->vbuf = aligned_alloc(64, up64(sizeof(float) * (size_t)vf * EX_VECS));
    b->xq = aligned_alloc(64, up64((size_t)np * K * 2));
    b->xd = aligned_alloc(64, up64((size_t)np * (K / 16) * 4));
    b->xs = aligned_alloc(64, up64((size_t)np * (K / 16) * 4));
    b->w = aligned_alloc(64, up64((size_t)32 * K * 2));
    b->ws = aligned_alloc(64, up64((size_t)(K / 16) * 32 * 4));
    b->wo = aligned_alloc(64, up64((size_t)(K / 16) * 32 * 4));
    b->q8 = aligned_alloc(64, up64((size_t)most * K));
    b->q8d = malloc(sizeof(float) * ((size_t)most * (K / QK_K) + 1));
    b->q8s = malloc(sizeof(float) * ((size_t)most * (K / 16) + 16));
    if (!b->xrow || !b->yrow || !b->gu || !b->hid || !b->vbuf || !b->xq || !b->xd || !b->xs || !b->w || !b->ws ||
        !b->wo || !b->q8 || !b->q8d || !b->q8s)
        return 0;
    for (int i = 0; i < EX_VECS; i++) vec_place(&b->v[i], b->vbuf + (size_t)i * vf, K);
    return 1;
}

static void ex_free(ExBuffers *b) {
    free(b->xrow), free(b->yrow), free(b->gu), free(b->hid), free(b->vbuf);
    free(b->xq), free(b->xd), free(b->xs), free(b->w), free(b->ws), free(b->wo);
    free(b->q8), free(b->q8d), free(b->q8s);
}

#if defined(CB_AVX2)
/* yrow[t][r] = row r of m . xrow[t] for nt inputs by the batched int16 product: the inputs as
 * int16 per unit, then matmul_team's loop over groups of MM_ROWS rows on this thread alone. */
static void ex_matmul(const Mat *m, int nt, const float *const *xrow, float *const *yrow, ExBuffers *b) {
    const int unit = mm_unit(m->fmt), k = m->cols, nu = k / unit, np = (nt + MM_TOK - 1) / MM_TOK * MM_TOK;
    const int bl = block_len(m->fmt), upb = bl / unit, groups = (m->rows + MM_ROWS - 1) / MM_ROWS;
    for (int t = 0; t < np; t++) {
        for (int u = 0; u < nu; u++) {
            int16_t *q = b->xq + (size_t)t * k + u * unit;
            if (t >= nt) { /* padding inputs: zero */
                memset(q, 0, (size_t)unit * 2);
                b->xd[t * nu + u] = b->xs[t * nu + u] = 0.0f;
                continue;
            }
            mm_quantize(xrow[t] + u * unit, unit, q, b->xd + t * nu + u, b->xs + t * nu + u);
        }
    }
    int16_t stage[MM_ROWS * QK_K] __attribute__((aligned(64)));
    float sb[QK_K / 16], ob[QK_K / 16];
    for (int g = 0; g < groups; g++) {
        const int r0 = g * MM_ROWS, nr = m->rows - r0 < MM_ROWS ? m->rows - r0 : MM_ROWS;
        for (int blk = 0; blk < k / bl; blk++) {
            for (int r = 0; r < MM_ROWS; r++) {
                if (r < nr) {
                    mm_unpack_block(m->fmt, (const uint8_t *)m->data + (size_t)(r0 + r) * row_bytes(m) +
                                                (size_t)blk * block_bytes(m->fmt),
                                    stage + r * QK_K, sb, ob);
                } else { /* rows past the end: zero weights */
                    memset(stage + r * QK_K, 0, sizeof(int16_t) * QK_K);
                    memset(sb, 0, sizeof sb);
                    memset(ob, 0, sizeof ob);
                }
                for (int u = 0; u < upb; u++) {
                    b->ws[(blk * upb + u) * MM_ROWS + r] = sb[u];
                    b->wo[(blk * upb + u) * MM_ROWS + r] = ob[u];
                }
            }
            mm_lay_out(stage, b->w, blk, bl);
        }
        for (int t0 = 0; t0 < np; t0 += MM_TOK) {
            mm_f out[2 * MM_TOK];
            float row[MM_ROWS];
            (unit == 32 ? mm_tile32 : mm_tile16)(b->w, b->ws, b->wo, b->xq + (size_t)t0 * k, b->xd + t0 * nu,
                                                 b->xs + t0 * nu, k, nu, out);
            for (int t = 0; t < MM_TOK && t0 + t < nt; t++) {
                MM_STORE_F(row, out[2 * t]);
                MM_STORE_F(row + MM_LANES, out[2 * t + 1]);
                memcpy(yrow[t0 + t] + r0, row, sizeof(float) * (size_t)nr);
            }
        }
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(CB_AVX2)
#define EX_Q8 1
/* ---- int8 inputs (ACT_Q8: ggml's Q8_K, as llama.cpp's mul_mat_id takes them) into Q4_K / Q6_K
 * rows not in tiles, several inputs a row. A super-block of a row is unpacked once for up to
 * EX_Q8_TOK inputs (ExSuper: its weights as 4 x 64 unsigned bytes, its sub-block scales as
 * int16 beside each pair of bytes, its float scale, and per block a float offset to multiply
 * with the input's block sum: Q4_K's -dmin m, Q6_K's -32 d s); then each input's product
 * reads only it: 4 vpmaddubsw and 4 vpdpwssd (the inputs' bytes laid out in the weights'
 * order, ex_quantize; exact in int32), one conversion and FMA with the scales, one FMA of the
 * offsets with the input's sums. (4 vpdpbusd, then a conversion and FMA per sub-product with
 * float lane scales, took 8% longer at 500 tokens.) An input's result does not depend on the
 * other inputs, nor on the thread. */
typedef struct {
    __m512i w[4];
    __m512i s[4]; /* the sub-block scales as int16, one per pair of weight bytes */
    __m512 m;
    float d;
} ExSuper;

/* super-block b of fmt (Q4_K or Q6_K) into u */
static inline __attribute__((always_inline)) void ex_unpack(const int fmt, const uint8_t *b, ExSuper *u) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    if (fmt == FMT_Q4_K) {
        uint8_t sc[8], mn[8];
        k4_scales(b + 4, sc, mn);
        const __m512i scv = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        const __m512 mnv = _mm512_mul_ps(_mm512_set1_ps(-rdh(b + 2)), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn))));
        /* int16 lanes 0-15 take the scale of block 4h + u, 16-31 that of 4h + u + 2 */
        const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        for (int h = 0; h < 2; h++) { /* low nibbles: blocks 4h, 4h + 2; high: 4h + 1, 4h + 3 */
            const __m512i w = _mm512_loadu_si512(b + 16 + 64 * h);
            u->w[2 * h] = _mm512_and_si512(w, m4);
            u->w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
            u->s[2 * h] = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16((short)(4 * h))), scv);
            u->s[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16((short)(4 * h + 1))), scv);
        }
        u->m = _mm512_maskz_mov_ps(0x00ff, mnv); /* blocks 0-7; lanes 8-15 zero */
        u->d = rdh(b);
    } else { /* Q6_K: values 0..63 (q + 32) in order, 64 a vector */
        const __m512i scv = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
        const float d = rdh(b + 208);
        /* int16 lane i of vector 2n + v: values 128 n + 64 v + 2i, 2i + 1: scale 8 n + 4 v + i / 8 */
        const __m512i eighth = _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                                  15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
        for (int n = 0; n < 2; n++) {
            const __m512i a = _mm512_loadu_si512(b + 64 * n);
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            u->w[2 * n] = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_and_si512(_mm512_slli_epi16(h01, 4), m30));
            u->w[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), _mm512_and_si512(h01, m30));
            u->s[2 * n] = _mm512_permutexvar_epi16(_mm512_add_epi16(eighth, _mm512_set1_epi16((short)(8 * n))), scv);
            u->s[2 * n + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(eighth, _mm512_set1_epi16((short)(8 * n + 4))), scv);
        }
        u->m = _mm512_mul_ps(_mm512_set1_ps(-32.0f * d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
        u->d = d;
    }
}

/* x (k values) as int8 per super-block of 256 (scale dx[i] = amax / 127, values rounded to
 * nearest even, as prepare_k) into q in fmt's order (Q4_K: its blocks of 32 in the order
 * 0 2 1 3 4 6 5 7, as ex_unpack_row's vectors hold them; Q6_K: in order), and the sums times
 * dx: Q4_K per block of 32 (8 of each 16), Q6_K per 16. */
static void ex_quantize(int fmt, const float *x, int k, int8_t *q, float *dx, float *sums) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int i = 0; i < k / QK_K; i++) {
        const float *b = x + (size_t)i * QK_K;
        __m512 mx = _mm512_setzero_ps();
        for (int t = 0; t < QK_K; t += 16) mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, _mm512_loadu_ps(b + t)));
        const float amax = _mm512_reduce_max_ps(mx), d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        dx[i] = d;
        int bs[16] = {0};
        for (int g = 0; g < 16; g++) {
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(b + 16 * g), _mm512_set1_ps(id)));
            const int blk = g / 2, at = fmt == FMT_Q4_K ? QK * ((blk & 4) | ((blk & 1) << 1) | ((blk >> 1) & 1)) + 16 * (g & 1) : 16 * g;
            _mm_storeu_si128((__m128i *)(q + (size_t)i * QK_K + at), _mm512_cvtsepi32_epi8(qi));
            bs[fmt == FMT_Q4_K ? blk : g] += _mm512_reduce_add_epi32(qi);
        }
        for (int j = 0; j < 16; j++) sums[16 * i + j] = d * (float)bs[j];
    }
}

/* acc + super-block u . one input of ex_quantize (q: its 256 bytes, dx its scale, sums its 16
 * sums): byte products in pairs (vpmaddubsw: |2 x 63 x 127| < 2^15, no saturation), times
 * the pairs' sub-block scales into int32 lanes (vpdpwssd: at most 4 x 2 x 16002 x 128 < 2^31),
 * one conversion a super-block */
static inline __attribute__((always_inline)) __m512 ex_dot_super(const int fmt, const ExSuper *u, const int8_t *q, float dx, const float *sums, __m512 acc) {
    (void)fmt;
    __m512i s = dpwt(_mm512_setzero_si512(), _mm512_maddubs_epi16(u->w[0], _mm512_loadu_si512(q)), u->s[0]);
    s = dpwt(s, _mm512_maddubs_epi16(u->w[1], _mm512_loadu_si512(q + 64)), u->s[1]);
    s = dpwt(s, _mm512_maddubs_epi16(u->w[2], _mm512_loadu_si512(q + 128)), u->s[2]);
    s = dpwt(s, _mm512_maddubs_epi16(u->w[3], _mm512_loadu_si512(q + 192)), u->s[3]);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(u->d * dx), acc);
    return _mm512_fmadd_ps(u->m, _mm512_loadu_ps(sums), acc);
}

typedef __m512 ExAcc;
static inline __m512 ex_acc_zero(void) { return _mm512_setzero_ps(); }
static inline float ex_acc_sum(__m512 acc) { return _mm512_reduce_add_ps(acc); }
#elif defined(CB_AVX2)
#define EX_Q8 1
/* The same with AVX2 (vpmaddubsw, then vpmaddwd with the sub-block scales): a 32-byte load of
 * a Q4_K super-block is one 64-value chunk whose low nibbles are block 2j and high ones block
 * 2j + 1, so every vector holds one block of 32 in order, and the inputs stay in order. */
typedef struct {
    __m256i w[8]; /* values 32 b .. 32 b + 31 as unsigned bytes (Q6_K: q + 32) */
    __m256i s[8]; /* their sub-block scales as int16, one per pair of bytes */
    __m256 m[2];  /* per 16 values (Q4_K: per 32, then zeros) the offset to multiply with the input's sum */
    float d;
} ExSuper;

static inline __attribute__((always_inline)) void ex_unpack(const int fmt, const uint8_t *b, ExSuper *u) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    if (fmt == FMT_Q4_K) {
        uint8_t sc[8], mn[8];
        k4_scales(b + 4, sc, mn);
        for (int j = 0; j < 4; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
            u->w[2 * j] = _mm256_and_si256(w, m4);
            u->w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
            u->s[2 * j] = _mm256_set1_epi16((short)sc[2 * j]);
            u->s[2 * j + 1] = _mm256_set1_epi16((short)sc[2 * j + 1]);
        }
        u->m[0] = _mm256_mul_ps(_mm256_set1_ps(-rdh(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn))));
        u->m[1] = _mm256_setzero_ps();
        u->d = rdh(b);
    } else { /* Q6_K: values 0..63 (q + 32) in order */
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = rdh(b + 208);
        for (int n = 0; n < 2; n++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(b + 64 * n));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            u->w[4 * n] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
            u->w[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
            u->w[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(h, m30));
            u->w[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                              _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
        }
        for (int r = 0; r < 8; r++) /* int16 lanes 0-7: values 0-15 of the 32, scale 2r; 8-15: 2r + 1 */
            u->s[r] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * r + 1]), _mm_set1_epi16(sc[2 * r]));
        for (int h = 0; h < 2; h++)
            u->m[h] = _mm256_mul_ps(_mm256_set1_ps(-32.0f * d),
                                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * h)))));
        u->d = d;
    }
}

/* x (k values) as int8 per super-block of 256 (q8_super: prepare_k's ACT_Q8 values, as
 * x8_quantize) into q in order, dx[i] the scale, and the sums times dx: Q4_K per block of 32
 * (then 8 zeros), Q6_K per 16. */
static void ex_quantize(int fmt, const float *x, int k, int8_t *q, float *dx, float *sums) {
    for (int i = 0; i < k / QK_K; i++) {
        int16_t bs[16];
        const float d = dx[i] = q8_super(x + (size_t)i * QK_K, q + (size_t)i * QK_K, bs);
        for (int j = 0; j < 16; j++)
            sums[16 * i + j] = fmt == FMT_Q4_K ? (j < 8 ? d * (float)(bs[2 * j] + bs[2 * j + 1]) : 0.0f) : d * (float)bs[j];
    }
}

/* acc + super-block u . one input of ex_quantize: byte products in pairs (vpmaddubsw:
 * |2 x 63 x 127| < 2^15), times the pairs' sub-block scales into int32 lanes (vpmaddwd: at
 * most 8 x 2 x 16002 x 128 < 2^31 a lane), one conversion a super-block */
static inline __attribute__((always_inline)) __m256 ex_dot_super(const int fmt, const ExSuper *u, const int8_t *q, float dx,
                                                                 const float *sums, __m256 acc) {
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u->w[0], _mm256_loadu_si256((const __m256i *)q)), u->s[0]);
    for (int b = 1; b < 8; b++)
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u->w[b], _mm256_loadu_si256((const __m256i *)(q + 32 * b))), u->s[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(u->d * dx), acc);
    acc = _mm256_fmadd_ps(u->m[0], _mm256_loadu_ps(sums), acc);
    return fmt == FMT_Q6_K ? _mm256_fmadd_ps(u->m[1], _mm256_loadu_ps(sums + 8), acc) : acc;
}

typedef __m256 ExAcc;
static inline __m256 ex_acc_zero(void) { return _mm256_setzero_ps(); }
static inline float ex_acc_sum(__m256 acc) { return hsum256(acc); }
#endif

#ifdef EX_Q8
/* whether ex_product_q8 takes m */
static inline int ex_q8_takes(const Mat *m) {
    return (m->fmt == FMT_Q4_K || m->fmt == FMT_Q6_K) && !m->x8 && m->cols % QK_K == 0;
}

/* Inputs whose sums one pass over a row keeps */
#define EX_Q8_TOK 16

static inline __attribute__((always_inline)) void ex_rows_q8(const int fmt, const Mat *m, int t0, int nb, float *const *yrow, const ExBuffers *b) {
    const int k = m->cols, nsb = k / QK_K, bb = fmt == FMT_Q4_K ? 144 : 210;
    const size_t rb = row_bytes(m);
    for (int r = 0; r < m->rows; r++) {
        const uint8_t *row = (const uint8_t *)m->data + (size_t)r * rb;
        for (size_t c = 0; c < rb; c += 64) _mm_prefetch((const char *)row + PREFETCH + c, _MM_HINT_T0);
        ExAcc acc[EX_Q8_TOK];
        for (int t = 0; t < nb; t++) acc[t] = ex_acc_zero();
        for (int i = 0; i < nsb; i++) {
            ExSuper u;
            ex_unpack(fmt, row + (size_t)i * bb, &u);
            for (int t = 0; t < nb; t++) {
                const int at = t0 + t;
                acc[t] = ex_dot_super(fmt, &u, b->q8 + (size_t)at * k + (size_t)i * QK_K, b->q8d[(size_t)at * nsb + i],
                                      b->q8s + ((size_t)at * nsb + i) * 16, acc[t]);
            }
        }
        for (int t = 0; t < nb; t++) yrow[t0 + t][r] = ex_acc_sum(acc[t]);
    }
}

/* yrow[t][r] = row r of m . xrow[t] with int8 inputs, each super-block of a row unpacked once
 * for up to EX_Q8_TOK inputs. An input's result does not depend on the other inputs. */
static void ex_product_q8(const Mat *m, int nt, const float *const *xrow, float *const *yrow, ExBuffers *b) {
    const int k = m->cols, nsb = k / QK_K;
    for (int t = 0; t < nt; t++)
        ex_quantize(m->fmt, xrow[t], k, b->q8 + (size_t)t * k, b->q8d + (size_t)t * nsb, b->q8s + (size_t)t * 16 * nsb);
    for (int t0 = 0; t0 < nt; t0 += EX_Q8_TOK) {
        const int nb = nt - t0 < EX_Q8_TOK ? nt - t0 : EX_Q8_TOK;
        if (m->fmt == FMT_Q4_K)
            ex_rows_q8(FMT_Q4_K, m, t0, nb, yrow, b);
        else
            ex_rows_q8(FMT_Q6_K, m, t0, nb, yrow, b);
    }
}
#endif

#if defined(CB_AVX2)
/* ---- MXFP4 rows x several int16 or int8 inputs (gpt-oss's experts of fewer than
 * EX_MM_MIN_MXFP4 tokens, or int8 inputs): a block's codes looked up once (mxfp4_bytes) for up to EX_FP4_TOK
 * inputs, where the one-input product looks them up per input. Each input's products, scales
 * and sums are dot_mxfp4_i16's / dot_mxfp4_q8's, in their order (blocks alternately into two
 * accumulators, added at the end), so its result is theirs bit for bit. */
#define EX_FP4_TOK 4

static inline __attribute__((always_inline)) float ex_fp4_sum(__m256 acc0, __m256 acc1) {
    return hsum256(_mm256_add_ps(acc0, acc1));
}

/* row . v[t] into y[t] for n (a constant, 1..EX_FP4_TOK) inputs of the form i8 ? ACT_Q8 : ACT_I16 */
static inline __attribute__((always_inline)) void ex_row_mxfp4(const int n, const int i8, const uint8_t *row, int k, const Vec *v, float *y) {
    const int nb = k / QK;
    __m256 acc[EX_FP4_TOK][2];
    for (int t = 0; t < n; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++, row += 17) {
        if (!(j & 1)) _mm_prefetch((const char *)row + PREFETCH, _MM_HINT_T0);
        const __m256i w = mxfp4_bytes(row + 1);
        const float e = e8m0_half(row[0]);
        if (i8) {
            const __m256i aw = _mm256_sign_epi8(w, w);
            for (int t = 0; t < n; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(v[t].q + j * QK));
                const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
                acc[t][j & 1] = _mm256_fmadd_ps(_mm256_set1_ps(e * v[t].qd[j]), sum_i16_pairs_ps(p), acc[t][j & 1]);
            }
        } else {
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
            for (int t = 0; t < n; t++)
                acc[t][j & 1] = _mm256_fmadd_ps(_mm256_set1_ps(e * v[t].qd[j]), i16_block_sums(w0, w1, v[t].q16 + j * QK), acc[t][j & 1]);
        }
    }
    for (int t = 0; t < n; t++) y[t] = ex_fp4_sum(acc[t][0], acc[t][1]);
}

#define EX_FP4_CASES(i8)                                                    \
    switch (n) {                                                            \
    case 1: ex_row_mxfp4(1, i8, row, k, v, y); break;                      \
    case 2: ex_row_mxfp4(2, i8, row, k, v, y); break;                      \
    case 3: ex_row_mxfp4(3, i8, row, k, v, y); break;                      \
    default: ex_row_mxfp4(EX_FP4_TOK, i8, row, k, v, y); break;            \
    }

/* yrow[t][r] = row r of m (MXFP4) . v[t] for nt (<= EX_VECS) inputs made ready, all of one
 * form (ACT_I16 or ACT_Q8): each row read once, for all of them in groups of up to EX_FP4_TOK */
static void ex_rows_mxfp4(const Mat *m, const Vec *v, int nt, float *const *yrow) {
    const int k = m->cols, i8 = v[0].act == ACT_Q8, groups = (nt + EX_FP4_TOK - 1) / EX_FP4_TOK;
    const size_t rb = row_bytes(m);
    for (int r = 0; r < m->rows; r++) {
        const uint8_t *row = (const uint8_t *)m->data + (size_t)r * rb;
        for (int g = 0, t0 = 0; g < groups; g++) {
            const int n = (nt - t0) / (groups - g); /* the inputs shared out evenly: 5 as 2 + 3 */
            float y[EX_FP4_TOK];
            if (i8) {
                EX_FP4_CASES(1)
            } else {
                EX_FP4_CASES(0)
            }
            for (int t = 0; t < n; t++) yrow[t0 + t][r] = y[t];
            v += n, t0 += n;
        }
        v -= nt;
    }
}
#undef EX_FP4_CASES
#endif

/* yrow[t][r] = row r of m . xrow[t] for nt inputs in the form `act`, every row read once. */
static void ex_product(const Mat *m, int act, int nt, const float *const *xrow, float *const *yrow, ExBuffers *b) {
#ifdef EX_Q8
    if (act == ACT_Q8 && ex_q8_takes(m)) {
        ex_product_q8(m, nt, xrow, yrow, b);
        return;
    }
#endif
#if defined(CB_AVX2)
    if (nt >= (m->fmt == FMT_MXFP4 ? EX_MM_MIN_MXFP4 : EX_MM_MIN) && act == ACT_I16 && !m->x8 && mm_unit(m->fmt) && m->cols % block_len(m->fmt) == 0) {
        ex_matmul(m, nt, xrow, yrow, b);
        return;
    }
#endif
    for (int t0 = 0; t0 < nt; t0 += EX_VECS) {
        const int nb = nt - t0 < EX_VECS ? nt - t0 : EX_VECS;
        for (int t = 0; t < nb; t++) {
            prepare_vec(&b->v[t], xrow[t0 + t], m->cols, act);
            ready_for(&b->v[t], m);
        }
#if defined(CB_AVX2)
        if (m->fmt == FMT_MXFP4 && (b->v[0].act == ACT_I16 || b->v[0].act == ACT_Q8)) {
            ex_rows_mxfp4(m, b->v, nb, yrow + t0);
            continue;
        }
#endif
        for (int r = 0; r < m->rows; r++)
            for (int t = 0; t < nb; t++) yrow[t0 + t][r] = dot_vec(m, r, &b->v[t]);
    }
}

/* Expert e's tokens through its gate/up (plus their biases), the activation and its down
 * (plus its bias), into their slots' rows: as the decode step's loop (moe_mlp) adds them. */
static void ex_expert(ExpertsJob *job, int e, ExBuffers *b) {
    const int F = job->F, E = job->E, nt = job->first[e + 1] - job->first[e];
    const int32_t *sl = job->slot + job->first[e];
    const Mat gate = expert_rows(job->gate, e, F), up = expert_rows(job->up, e, F);
    const Mat down = expert_rows(job->down, e, E);
    const float *gb = job->gu_bias ? job->gu_bias + (size_t)e * 2 * F : NULL;
    const float *db = job->down_bias ? job->down_bias + (size_t)e * E : NULL;
    for (int t = 0; t < nt; t++) {
        b->xrow[t] = job->x + (size_t)(sl[t] / job->k) * E;
        b->yrow[t] = b->gu + (size_t)t * 2 * F;
    }
    ex_product(&gate, job->act_gu, nt, b->xrow, b->yrow, b);
    for (int t = 0; t < nt; t++) b->yrow[t] += F;
    ex_product(&up, job->act_gu, nt, b->xrow, b->yrow, b);
    for (int t = 0; t < nt; t++) {
        float *g = b->gu + (size_t)t * 2 * F;
        if (gb)
            for (int i = 0; i < 2 * F; i++) g[i] += gb[i];
        if (job->act_fn == ACT_FN_SWIGLU_OAI)
            swiglu_oai_mul(g, g + F, F, b->hid + (size_t)t * F);
        else if (job->act_fn == ACT_FN_GELU_TANH)
            gelu_tanh_mul(g, g + F, F, b->hid + (size_t)t * F);
        else
            silu_mul(g, g + F, F, b->hid + (size_t)t * F);
        b->xrow[t] = b->hid + (size_t)t * F;
        b->yrow[t] = job->res + (size_t)sl[t] * E;
    }
    ex_product(&down, job->act_down, nt, b->xrow, b->yrow, b);
    if (db)
        for (int t = 0; t < nt; t++)
            for (int i = 0; i < E; i++) b->yrow[t][i] += db[i];
}

static void experts_team(void *arg) {
    ExpertsJob *job = arg;
    ExBuffers b;
    const int ok = ex_alloc(&b, job->most, job->E, job->F);
    if (!ok) atomic_store(&job->failed, 1);
    for (int i = team_next(&job->next); i < job->n_queue; i = team_next(&job->next))
        if (ok) ex_expert(job, job->queue[i], &b);
    ex_free(&b);
    team_barrier();
    const int E = job->E, k = job->k;
    const Span tokens = team_share(job->n);
    for (int t = tokens.lo; t < tokens.hi; t++) {
        float *o = job->out + (size_t)t * E;
        for (int j = 0; j < k; j++) {
            const float wj = job->w[t * k + j], *r = job->res + (size_t)(t * k + j) * E;
            if (j == 0)
                for (int i = 0; i < E; i++) o[i] = wj * r[i];
            else
                for (int i = 0; i < E; i++) o[i] += wj * r[i];
        }
    }
}

/* out [n, E] = for each token t the sum over j < k of w[t k + j] times expert ids[t k + j]'s
 * MLP of x[t]: down(act(gate x) * up x), its matrices the rows of expert e in gate/up
 * ([n_experts F, E]) and down ([n_experts E, F]), not in tiles; the inputs of gate/up in the
 * form act_gu, of down in act_down; act_fn an ACT_FN_*; gu_bias (NULL: none) [n_experts, 2 F] each
 * expert's gate bias then its up bias, down_bias (NULL: none) [n_experts, E] (gpt-oss). Returns 0, or -1 (out not written) for an expert id out of
 * range, matrices of other shapes or memory refused. */
int chatbot_experts(const Mat *gate, const Mat *up, const Mat *down, int n_experts, const float *x, int n,
                    const int32_t *ids, const float *w, int k, int act_gu, int act_down, int act_fn,
                    const float *gu_bias, const float *down_bias, float *out, int n_threads) {
    if (n < 1 || k < 1 || n_experts < 1 || gate->x8 || up->x8 || down->x8 || gate->rows % n_experts ||
        up->rows != gate->rows || down->rows % n_experts || gate->cols != up->cols)
        return -1;
    const int F = gate->rows / n_experts, E = gate->cols;
    if (down->rows / n_experts != E || down->cols != F) return -1;
    int32_t *first = calloc((size_t)n_experts + 1, sizeof(int32_t));
    int32_t *slot = malloc(sizeof(int32_t) * (size_t)n * k), *queue = malloc(sizeof(int32_t) * (size_t)n_experts);
    float *res = malloc(sizeof(float) * (size_t)n * k * E);
    int status = -1;
    if (!first || !slot || !queue || !res) goto done;
    for (int s = 0; s < n * k; s++) {
        if (ids[s] < 0 || ids[s] >= n_experts) goto done;
        first[ids[s] + 1]++;
    }
    int most = 0, n_queue = 0;
    for (int e = 0; e < n_experts; e++) {
        const int c = first[e + 1];
        most = c > most ? c : most;
        first[e + 1] += first[e];
    }
    /* the slots by expert, each expert's in token order */
    int32_t *fill = queue; /* a cursor per expert first, the queue after */
    for (int e = 0; e < n_experts; e++) fill[e] = first[e];
    for (int s = 0; s < n * k; s++) slot[fill[ids[s]]++] = s;
    /* the experts with tokens, the most first (the largest units of work start first) */
    for (int c = most; c > 0; c--)
        for (int e = 0; e < n_experts; e++)
            if (first[e + 1] - first[e] == c) queue[n_queue++] = e;
    ExpertsJob job = {gate, up, down, F, E, n, k, act_gu, act_down, act_fn, x, w, gu_bias, down_bias, out,
                      slot, first, queue, n_queue, most, res, 0, 0};
    team_run(n_threads, experts_team, &job);
    status = atomic_load(&job.failed) ? -1 : 0;
done:
    free(first), free(slot), free(queue), free(res);
    return status;
}
