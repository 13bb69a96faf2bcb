/* The batched product on int8 inputs for matrices in 8-row tiles (chatbot_matmul_x8).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

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

/* input x (k values) into row t of `in` (q8_super: ACT_Q8's K-quant form) */
static void x8_quantize(const float *x, int k, X8Inputs *in, int t) {
    for (int i = 0; i < k / QK_K; i++)
        in->d[(size_t)t * (k / QK_K) + i] = q8_super(x + i * QK_K, in->q + (size_t)t * k + i * QK_K, in->s16 + (size_t)t * (k / 16) + 16 * i);
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
