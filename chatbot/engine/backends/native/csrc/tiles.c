/* Q4_K and Q6_K matrices in tiles of 8 rows (chatbot_repack) and their products, 8 rows at a
 * time (AVX2 and AVX-512).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

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

/* dot_q4_k_x8_i8 for B inputs at once (rows 8 g.. of the tile . v[t] into out[8 t..]): the
 * weights' nibbles and the tile's scales unpacked once for all, each input's sums made in
 * dot_q4_k_x8_i8's order (so each equals its result bit for bit). B a constant up to 4, so
 * the sums stay in registers; dot_tile_multi takes any B in groups of 4. */
static inline __attribute__((always_inline)) void dot_q4_k_x8_i8_b(const uint8_t *tile, const Vec *v, const int B, int k,
                                                                   float *out) {
    const int nb = k / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[4], accm[4];
    for (int t = 0; t < B; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, tile += 1152) {
        TILE_PREFETCH(tile, 1152);
        const K4Scales s = k4_tile_scales(tile);
        const uint8_t *q = tile + 128;
        __m256 sf[4];
        for (int t = 0; t < B; t++) sf[t] = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            __m256i hA[4], hB[4];
            for (int t = 0; t < B; t++) hA[t] = hB[t] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * (8 * j + g)));
                const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                for (int t = 0; t < B; t++) {
                    const int8_t *x = v[t].kc + (size_t)i * QK_K;
                    const __m256i xa = bcast4(x + 4 * (16 * j + g)), xb = bcast4(x + 4 * (16 * j + g + 8));
#ifdef X8_DPB256
                    hA[t] = DPB256(hA[t], lo, xa);
                    hB[t] = DPB256(hB[t], hi, xb);
#else
                    hA[t] = _mm256_add_epi16(hA[t], _mm256_maddubs_epi16(lo, xa));
                    hB[t] = _mm256_add_epi16(hB[t], _mm256_maddubs_epi16(hi, xb));
#endif
                }
            }
            const __m256i a = k4_lane_byte(s.sc03, s.sc47, 2 * j), b = k4_lane_byte(s.sc03, s.sc47, 2 * j + 1);
            for (int t = 0; t < B; t++) {
#ifdef X8_DPB256
                const __m256i S = _mm256_add_epi32(_mm256_mullo_epi32(hA[t], a), _mm256_mullo_epi32(hB[t], b));
#else
                const __m256i pa = _mm256_or_si256(a, _mm256_slli_epi32(a, 16)), pb = _mm256_or_si256(b, _mm256_slli_epi32(b, 16));
                const __m256i S = _mm256_add_epi32(_mm256_madd_epi16(hA[t], pa), _mm256_madd_epi16(hB[t], pb));
#endif
                sf[t] = _mm256_add_ps(sf[t], _mm256_cvtepi32_ps(S));
            }
        }
        for (int t = 0; t < B; t++) k4_tile_close(tile, v[t].kd[i], sf[t], &s, v[t].kbs + 8 * i, &acc[t], &accm[t]);
    }
    for (int t = 0; t < B; t++) _mm256_storeu_ps(out + 8 * t, _mm256_sub_ps(acc[t], accm[t]));
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

/* dot_q6_k_x8_i8 for B inputs at once (out[8 t..]): the tile's 6-bit quants unpacked once
 * for all, each input's sums in dot_q6_k_x8_'s order (bit for bit its result); B a constant
 * up to 4, so the sums stay in registers. */
static inline __attribute__((always_inline)) void dot_q6_k_x8_i8_b(const uint8_t *tile, const Vec *v, const int B, int k,
                                                                   float *out) {
    const int nb = k / QK_K;
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256 acc[4];
    for (int t = 0; t < B; t++) acc[t] = _mm256_setzero_ps();
    for (int i = 0; i < nb; i++, tile += 1680) {
        TILE_PREFETCH(tile, 1680);
        __m256 sf[4];
        for (int t = 0; t < B; t++) sf[t] = _mm256_setzero_ps();
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) {
                __m512i th[4][4];
                for (int t = 0; t < B; t++)
                    for (int s = 0; s < 4; s++) th[t][s] = _mm512_setzero_si512();
                for (int g = 4 * h; g < 4 * h + 4; g += 2) {
                    __m512i q[4];
                    k6_tile_quants(tile, n, g, q);
                    for (int t = 0; t < B; t++) {
                        const int8_t *xc = v[t].kc + (size_t)i * QK_K;
                        for (int s = 0; s < 4; s++)
                            th[t][s] = dpbt(th[t][s], q[s], x8_halves(xc + 4 * (32 * n + 8 * s + g), halves));
                    }
                }
                for (int t = 0; t < B; t++)
                    for (int s = 0; s < 4; s++) {
                        const int b = 8 * n + 2 * s + h;
                        const __m256i T = _mm256_sub_epi32(fold8(th[t][s]), _mm256_set1_epi32(32 * v[t].ks16[16 * i + b]));
                        sf[t] = _mm256_fmadd_ps(k6_tile_scale(tile, b), _mm256_cvtepi32_ps(T), sf[t]);
                    }
            }
        for (int t = 0; t < B; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile)), _mm256_set1_ps(v[t].kd[i])),
                                     sf[t], acc[t]);
    }
    for (int t = 0; t < B; t++) _mm256_storeu_ps(out + 8 * t, acc[t]);
}
#define CB_Q6_MULTI 1

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

/* rows 8 g .. 8 g + 7 of m (in tiles) . v[t] into out[8 t ..] for B inputs of one form: the
 * int8 products of Q4_K (and Q6_K with AVX-512 VNNI) with the tile unpacked once for up to 4
 * inputs, each result dot_tile's bit for bit */
static void dot_tile_multi(const Mat *m, int g, const Vec *v, int B, float *out) {
    const uint8_t *tile = (const uint8_t *)m->data + (size_t)g * X8 * row_bytes(m);
    const int q6 = m->fmt == FMT_Q6_K;
    int shared = B > 1 && v[0].act == ACT_Q8;
#ifndef CB_Q6_MULTI
    shared = shared && !q6;
#endif
    if (shared) {
        for (; B > 0; B -= 4, v += 4, out += 32) {
            const int n = B < 4 ? B : 4;
            if (n == 1) {
                dot_tile(m, g, v, out);
                return;
            }
#ifdef CB_Q6_MULTI
            if (q6) {
                if (n == 2) dot_q6_k_x8_i8_b(tile, v, 2, m->cols, out);
                else if (n == 3) dot_q6_k_x8_i8_b(tile, v, 3, m->cols, out);
                else dot_q6_k_x8_i8_b(tile, v, 4, m->cols, out);
                continue;
            }
#endif
            if (n == 2) dot_q4_k_x8_i8_b(tile, v, 2, m->cols, out);
            else if (n == 3) dot_q4_k_x8_i8_b(tile, v, 3, m->cols, out);
            else dot_q4_k_x8_i8_b(tile, v, 4, m->cols, out);
        }
        return;
    }
    for (int t = 0; t < B; t++) dot_tile(m, g, &v[t], out + 8 * t);
}

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
