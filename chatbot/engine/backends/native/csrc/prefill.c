/* What prefill calls: one matrix's product and rows (chatbot_matvec, chatbot_rows,
 * chatbot_dequantize), and the batched product on int16 inputs (chatbot_matmul).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

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

/* Round n up to a multiple of 64 (aligned_alloc wants whole alignments). */
static size_t up64(size_t n) { return (n + 63) / 64 * 64; }

#if defined(CB_AVX2)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MM_512 1
#endif

/* values sharing one float scale in the batched product, or 0: no batched product for fmt */
static int mm_unit(int fmt) {
    switch (fmt) {
    case FMT_Q8_0: case FMT_Q4_0: case FMT_Q4_1: case FMT_Q5_0: case FMT_Q5_1: case FMT_Q4_K: case FMT_Q5_K:
    case FMT_MXFP4:
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
    case FMT_MXFP4:
        store_i16(q, mxfp4_bytes(b + 1), 1);
        s[0] = e8m0_half(b[0]), o[0] = 0.0f;
        break;
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

/* One unit of an input (`unit` values b) as int16 q for the batched product: scale *d =
 * amax / 32767, rounded to nearest even (as prepare_blocks' ACT_I16), *s = *d times their sum. */
static void mm_quantize(const float *b, int unit, int16_t *q, float *d, float *s) {
    float amax = 0.0f;
    for (int i = 0; i < unit; i++) amax = fabsf(b[i]) > amax ? fabsf(b[i]) : amax;
    const float dq = amax / 32767.0f, id = dq > 0.0f ? 1.0f / dq : 0.0f;
    int sum = 0;
    for (int i = 0; i < unit; i++) {
        q[i] = (int16_t)nearbyintf(b[i] * id);
        sum += q[i];
    }
    *d = dq;
    *s = dq * (float)sum;
}

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
            mm_quantize(x + (size_t)t * k + u * unit, unit, q, xd + t * nu + u, xs + t * nu + u);
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

