/* One token for each of B conversations in one pass over the weights (chatbot_decode_batch):
 * the batched row products and the batched forward pass.
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

/* ---------------------------------------------------------------- batched decode (serving)
 *
 * One token for each of B conversations in one pass over the weights: every weight row is read
 * (and, for Q4_1 / Q8_0 with int16 inputs, unpacked) once and multiplied with the B inputs
 * while it is in L1, each conversation attending to its own cache. The arithmetic of each row
 * is that of chatbot_decode, so a batched answer equals the one decoded alone. */

#define MAX_BATCH 16

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

#if defined(__AVX512BW__) && defined(CB_AVX2)

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

#ifdef CB_AVX2
/* s[t] = row . v[t] for N <= 8 of the inputs (t = off..off + N - 1 of the B whose numbers
 * transpose_scales put in tq, `stride` = B) with Q4_1 weights and int8 inputs (ACT_Q8, what
 * --opt auto feeds the layers): dot_q4_1_q8's arithmetic for each input in its order, so each
 * result equals it exactly. A block's weights are unpacked once for the N inputs, the scale
 * products d x qd of the row's blocks are made ahead (each FMA takes its scale from memory), and
 * the min terms m x qs of the N inputs are one vector chain of the same products and sums: an
 * input costs a block four vector operations (vpmaddubsw, vpmaddwd, a conversion, an FMA), where
 * one row alone also spends a scalar product, a broadcast and the scalar min term. Made for each
 * N with N a constant (dot_q4_1_q8_multi), so the sums stay in registers. */
static inline __attribute__((always_inline)) void dot_q4_1_q8_multi_(const block_q4_1 *b, const Vec *v, const int N,
                                                                     int k, const float *tq, int stride, int off,
                                                                     float *s) {
    const int nb = k / QK;
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(N), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    float scall[nb * N + 1], ms[8];
    for (int j = 0; j < nb; j++) {
        const float d = fp16_to_f32(b[j].d);
        for (int t = 0; t < N; t++) scall[j * N + t] = d * tq[(size_t)j * stride + off + t];
    }
    __m256 acc[8], msv = _mm256_setzero_ps();
    for (int t = 0; t < N; t++) acc[t] = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++) {
        _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128((const __m128i *)b[j].qs);
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
        const float *sc = scall + j * N;
        for (int t = 0; t < N; t++) {
            const __m256i p = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(v[off + t].q + j * QK)));
            acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + t), _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), acc[t]);
        }
        const __m256 qs = _mm256_maskload_ps(tq + (size_t)(nb + j) * stride + off, lanes);
        msv = _mm256_add_ps(msv, _mm256_mul_ps(_mm256_set1_ps(fp16_to_f32(b[j].m)), qs));
    }
    _mm256_storeu_ps(ms, msv);
    for (int t = 0; t < N; t++) s[off + t] = hsum256(acc[t]) + ms[t];
}

/* Q8_0 weights . int16 inputs for N <= 4 of the B inputs (as dot_q4_1_q8_multi_): dot_q8_0_i16's
 * arithmetic for each input in its order (even blocks in one sum, odd ones in another), the
 * weights widened to int16 once for the N inputs, the scale products made ahead. Four at most:
 * each input holds two sums, and the widened weights two registers more. */
static inline __attribute__((always_inline)) void dot_q8_0_i16_multi_(const block_q8_0 *b, const Vec *v, const int N,
                                                                      int k, const float *tq, int stride, int off,
                                                                      float *s) {
    const int nb = k / QK;
    float scall[nb * N + 1];
    for (int j = 0; j < nb; j++) {
        const float d = fp16_to_f32(b[j].d);
        for (int t = 0; t < N; t++) scall[j * N + t] = d * tq[(size_t)j * stride + off + t];
    }
    __m256 acc[2][4];
    for (int t = 0; t < N; t++) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++) {
        _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[j].qs));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b[j].qs + 16)));
        const float *sc = scall + j * N;
        for (int t = 0; t < N; t++)
            acc[j & 1][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + t), i16_block_sums(w0, w1, v[off + t].q16 + j * QK), acc[j & 1][t]);
    }
    for (int t = 0; t < N; t++) s[off + t] = hsum256(_mm256_add_ps(acc[0][t], acc[1][t]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q41_VNNI 1
#define Q41_VNNI_MIN 6 /* fewer inputs: dot_q4_1_q8_multi_ (as fast or faster there, measured) */
/* The same with AVX-512 VNNI for B = Q41_VNNI_MIN..16 inputs in one pass: vpdpbusd sums each
 * lane's 4 byte products in int32 (exact: < 4 x 15 x 127), the lanes vpmaddubsw + vpmaddwd
 * give dot_q4_1_q8, and each input's sum is its chain of FMAs in its order, with the scale
 * products d x qd made ahead for all inputs at once and the min terms one chain of vector
 * adds beside them (from transpose_scales' numbers: each product and sum the float operation
 * dot_q4_1_q8 makes). A block then costs each input one vpdpbusd, one conversion and one FMA
 * with its scale broadcast from memory, where dot_q4_1_q8_multi_ spends five operations and
 * two scalar ones. */
static inline __attribute__((always_inline)) void dot_q4_1_q8_vnni_(const block_q4_1 *b, const Vec *v, const int B,
                                                                    int k, const float *tq, float *s) {
    const int nb = k / QK;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __mmask16 bm = (__mmask16)((1u << B) - 1u);
    float scall[nb * B + 16], ms[16] __attribute__((aligned(64)));
    for (int j = 0; j < nb; j++) /* 16 floats a store, past B the next block's place (masked stores are slow on AMD) */
        _mm512_storeu_ps(scall + j * B, _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(b[j].d)), _mm512_maskz_loadu_ps(bm, tq + (size_t)j * B)));
    __m256 acc[MAX_BATCH];
    __m512 msv = _mm512_setzero_ps();
    for (int t = 0; t < B; t++) acc[t] = _mm256_setzero_ps();
    for (int j = 0; j < nb; j++) {
        _mm_prefetch((const char *)(b + j) + PREFETCH, _MM_HINT_T0);
        const __m128i raw = _mm_loadu_si128((const __m128i *)b[j].qs);
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
        const float *sc = scall + j * B;
        for (int t = 0; t < B; t++) {
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, _mm256_loadu_si256((const __m256i *)(v[t].q + j * QK)));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(sc[t]), _mm256_cvtepi32_ps(p), acc[t]);
        }
        msv = _mm512_add_ps(msv, _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(b[j].m)), _mm512_maskz_loadu_ps(bm, tq + (size_t)(nb + j) * B)));
    }
    _mm512_store_ps(ms, msv);
    for (int t = 0; t < B; t++) s[t] = hsum256(acc[t]) + ms[t];
}

/* dot_q4_1_q8_vnni_ for B = Q41_VNNI_MIN..16; tq holds the B inputs' numbers (ready_multi) */
static void dot_q4_1_q8_vnni(const block_q4_1 *b, const Vec *v, int B, int k, const float *tq, float *s) {
    switch (B) {
#define Q41_CASE(N) \
    case N: dot_q4_1_q8_vnni_(b, v, N, k, tq, s); return;
        Q41_CASE(6) Q41_CASE(7) Q41_CASE(8) Q41_CASE(9) Q41_CASE(10) Q41_CASE(11) Q41_CASE(12) Q41_CASE(13)
        Q41_CASE(14) Q41_CASE(15) Q41_CASE(16)
#undef Q41_CASE
    }
}
#endif

/* s[t] = row . v[t], t < B (2..MAX_BATCH), for Q4_1 and int8 inputs: eight inputs a pass */
static void dot_q4_1_q8_multi(const block_q4_1 *b, const Vec *v, int B, int k, const float *tq, float *s) {
    for (int off = 0; off < B; off += 8) {
        switch (B - off < 8 ? B - off : 8) {
#define Q41_CASE(N) \
    case N: dot_q4_1_q8_multi_(b, v, N, k, tq, B, off, s); break;
            Q41_CASE(1) Q41_CASE(2) Q41_CASE(3) Q41_CASE(4) Q41_CASE(5) Q41_CASE(6) Q41_CASE(7) Q41_CASE(8)
#undef Q41_CASE
        }
    }
}

/* The same for Q8_0 and int16 inputs (what --opt auto feeds the output layer): four a pass */
static void dot_q8_0_i16_multi4(const block_q8_0 *b, const Vec *v, int B, int k, const float *tq, float *s) {
    for (int off = 0; off < B; off += 4) {
        switch (B - off < 4 ? B - off : 4) {
        case 1: dot_q8_0_i16_multi_(b, v, 1, k, tq, B, off, s); break;
        case 2: dot_q8_0_i16_multi_(b, v, 2, k, tq, B, off, s); break;
        case 3: dot_q8_0_i16_multi_(b, v, 3, k, tq, B, off, s); break;
        case 4: dot_q8_0_i16_multi_(b, v, 4, k, tq, B, off, s); break;
        }
    }
}
#endif

/* Whether dot_vec_multi takes m's rows in one pass for the B inputs v with int16 inputs (then
 * it needs transpose_scales' numbers): Q4_1 and Q8_0 with AVX-512, Q8_0 with AVX2 */
static inline int multi_pass(const Mat *m, const Vec *v) {
#if defined(__AVX512BW__) && defined(CB_AVX2)
    return v[0].act == ACT_I16 && (m->fmt == FMT_Q4_1 || m->fmt == FMT_Q8_0);
#elif defined(CB_AVX2)
    return v[0].act == ACT_I16 && m->fmt == FMT_Q8_0;
#else
    (void)m, (void)v;
    return 0;
#endif
}

/* Whether dot_vec_multi takes m's rows for B int8 inputs in one pass (dot_q4_1_q8_vnni, or
 * dot_q4_1_q8_multi: they need them too) */
static inline int int8_pass(const Mat *m, const Vec *v, int B) {
#ifdef CB_AVX2
    return B >= 2 && v[0].act == ACT_Q8 && m->fmt == FMT_Q4_1 && !m->x8;
#else
    (void)m, (void)v, (void)B;
    return 0;
#endif
}

/* Makes v ready for m and, where dot_vec_multi needs them, the inputs' scales side by side in
 * tq (2 B cols / 32 floats). */
static void ready_multi(Vec *v, int B, const Mat *m, float *tq) {
    for (int t = 0; t < B; t++) ready_for(&v[t], m);
    if (B > 1 && (multi_pass(m, v) || int8_pass(m, v, B))) transpose_scales(v, B, m->cols / QK, tq);
}

/* s[t] = row n of m . v[t] for the B inputs (all of one length and form); tq from ready_multi */
static inline void dot_vec_multi(const Mat *m, int n, const Vec *v, int B, const float *tq, float *s) {
    if (B == 1) { /* one input: the one-row product (what chatbot_decode runs) */
        s[0] = dot_vec(m, n, v);
        return;
    }
#if defined(__AVX512BW__) && defined(CB_AVX2)
    if (multi_pass(m, v)) {
        const char *row = (const char *)m->data + (size_t)n * row_bytes(m);
        if (m->fmt == FMT_Q4_1)
            dot_q4_1_i16_multi((const block_q4_1 *)row, v, B, m->cols, tq, s);
        else
            dot_q8_0_i16_multi((const block_q8_0 *)row, v, B, m->cols, tq, s);
        return;
    }
#elif defined(CB_AVX2)
    if (multi_pass(m, v)) {
        dot_q8_0_i16_multi4((const block_q8_0 *)((const char *)m->data + (size_t)n * row_bytes(m)), v, B, m->cols, tq, s);
        return;
    }
#else
    (void)tq;
#endif
#ifdef CB_AVX2
    if (int8_pass(m, v, B)) {
        const block_q4_1 *row = (const block_q4_1 *)((const char *)m->data + (size_t)n * row_bytes(m));
#ifdef Q41_VNNI
        if (B >= Q41_VNNI_MIN) {
            dot_q4_1_q8_vnni(row, v, B, m->cols, tq, s);
            return;
        }
#endif
        dot_q4_1_q8_multi(row, v, B, m->cols, tq, s);
        return;
    }
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
        for (int g = tiles.lo; g < tiles.hi; g++) {
            float out[MAX_BATCH * X8];
            dot_tile_multi(m->lm_head, g, &vec[lo], NL, out);
            for (int t = 0; t < NL; t++) memcpy(logits + (size_t)t * V + (size_t)g * X8, out + t * X8, sizeof(float) * X8);
        }
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

