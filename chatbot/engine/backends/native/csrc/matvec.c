/* A matrix times a vector: a row's product chosen by its format and the input's form (dot_vec),
 * the rows shared out over the team (matvec_par, group_matvec_par), and a row as float32
 * (embed_row).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

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
    case FMT_MXFP4:
        switch (v->act) {
        case ACT_Q8: return dot_mxfp4_q8((const uint8_t *)row, v, m->cols);
        case ACT_I16: return dot_mxfp4_i16((const uint8_t *)row, v, m->cols);
        default: return dot_mxfp4((const uint8_t *)row, v->x, m->cols);
        }
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
        dot_tile_multi(m, r / X8, v, B, s);
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

