/* The forward pass of one token (chatbot_decode): scratch sizes, the attention heads, and the
 * layers in one parallel region.
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

static inline int widest_input(const Model *m) {
    const int hd = m->n_heads * m->head_dim;
    int w = m->ffn_dim > m->dim ? m->ffn_dim : m->dim;
    return hd > w ? hd : w;
}

/* Floats of shared scratch, then of each thread's private scratch. */
static long shared_floats(const Model *m) {
    const long qkv = (long)(m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    return qkv + (long)m->n_heads * m->head_dim + 2L * m->dim + 2L * m->ffn_dim + (long)m->n_heads * m->cap +
           m->n_experts + (m->n_experts ? (long)m->n_experts_used * m->dim : 0);
}

static long private_floats(const Model *m) {
    /* x, xn, hid, roped q, roped k, then a Vec, and a mixture's gate/up (moe_split); rounded
     * up to whole cache lines */
    const long n = 2L * m->dim + m->ffn_dim + 2L * m->head_dim + vec_floats(widest_input(m)) +
                   (m->n_experts ? 2L * m->ffn_dim : 0);
    return (n + 15) / 16 * 16;
}

/* Sizes of the structs as this compiler lays them out: kernels.py compares them with its
 * ctypes mirrors at load and refuses a mismatch (a field added on one side only would
 * otherwise shift every later field and read garbage pointers). */
long chatbot_sizeof_mat(void) { return (long)sizeof(Mat); }
long chatbot_sizeof_group(void) { return (long)sizeof(Group); }
long chatbot_sizeof_model(void) { return (long)sizeof(Model); }
/* The most experts per token chatbot_decode takes (Model.n_experts_used). */
long chatbot_max_experts_used(void) { return MAX_EXPERTS_USED; }

/* Floats of scratch space `chatbot_decode` needs with up to `max_threads` threads. */
long chatbot_scratch_floats(const Model *m, int max_threads) {
    return shared_floats(m) + (long)max_threads * private_floats(m) + 16;
}

/* Head h's sink logit in layer l (gpt-oss), or -INFINITY: none. */
static inline float head_sink(const Model *m, int l, int h) { return m->sinks ? m->sinks[l][h] : -INFINITY; }

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
           vc + off + (size_t)p * D, p - first, D, m->attn_scale, m->attn_softcap, head_sink(m, l, h), scores, out);
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
           m->attn_softcap, head_sink(m, l, h), scores, out);
}

/* Rows [e * n, (e + 1) * n) of `all`: expert e's matrix of n rows in a 3-D tensor's rows, as
 * the file stores them (the loader does not lay experts out in tiles). */
static inline Mat expert_rows(const Mat *all, int e, int n) {
    Mat sub = *all;
    sub.data = (const char *)all->data + (size_t)e * n * row_bytes(all);
    sub.rows = n;
    return sub;
}

/* Expert e's router logit, plus its bias where the router has one (gpt-oss). */
static inline float logit(const float *lg, const float *bias, int e) { return bias ? lg[e] + bias[e] : lg[e]; }

/* The experts a token goes to: the n_experts_used largest router logits `lg` (the lower
 * index first among equals), each weighted by its softmax over all the experts, the weights
 * renormalised to sum to 1 where the model does (norm_topk: then they are the softmax of the
 * chosen logits alone, gpt-oss's routing). */
static void route(const Model *m, const float *lg, const float *bias, int *ids, float *w) {
    const int n = m->n_experts, k = m->n_experts_used;
    float mx = logit(lg, bias, 0), sum = 0.0f, picked = 0.0f;
    for (int e = 1; e < n; e++) mx = logit(lg, bias, e) > mx ? logit(lg, bias, e) : mx;
    for (int e = 0; e < n; e++) sum += expf(logit(lg, bias, e) - mx);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int t = 0; t < j; t++) taken |= ids[t] == e;
            if (!taken && (best < 0 || logit(lg, bias, e) > logit(lg, bias, best))) best = e;
        }
        ids[j] = best;
        w[j] = expf(logit(lg, bias, best) - mx) / sum;
        picked += w[j];
    }
    if (m->norm_topk)
        for (int j = 0; j < k; j++) w[j] /= picked;
}

/* moe_mlp's chosen experts shared out whole over a team of several threads (expert j to
 * thread j mod size), each in its own thread's gu/hid, its rows by the one-row products that
 * moe_mlp's matvec_par runs on them (dot_vec: the same bits), plus the experts' biases
 * (gpt-oss) as moe_mlp adds them, its output (plus its down bias) to row j of the shared
 * res; after one barrier every thread adds the rows to its x in moe_mlp's order. One
 * barrier where moe_mlp has two per expert (on a busy machine a descheduled thread stalls
 * the others at each). */
static void moe_split(const Model *m, int l, Vec *vec, const float *xn, const int *ids, const float *w, float *gu,
                      float *hid, float *res, float *x) {
    const int E = m->dim, F = m->expert_dim, k = m->n_experts_used;
    for (int j = team_id(); j < k; j += team_size()) {
        const Mat gate = expert_rows(&m->wgu[l].part[0], ids[j], F), up = expert_rows(&m->wgu[l].part[1], ids[j], F);
        const Mat down = expert_rows(&m->wdown[l].part[0], ids[j], E);
        const float *gb = m->exp_gu_bias ? m->exp_gu_bias[l] + (size_t)ids[j] * 2 * F : NULL;
        const float *db = m->exp_down_bias ? m->exp_down_bias[l] + (size_t)ids[j] * E : NULL;
        prepare_vec(vec, xn, E, site_act(m, SITE_GU));
        ready_for(vec, &gate);
        ready_for(vec, &up);
        for (int r = 0; r < F; r++) gu[r] = dot_vec(&gate, r, vec);
        for (int r = 0; r < F; r++) gu[F + r] = dot_vec(&up, r, vec);
        if (gb)
            for (int r = 0; r < 2 * F; r++) gu[r] += gb[r];
        if (m->act_fn == ACT_FN_SWIGLU_OAI)
            swiglu_oai_mul(gu, gu + F, F, hid);
        else if (m->act_fn == ACT_FN_GELU_TANH)
            gelu_tanh_mul(gu, gu + F, F, hid);
        else
            silu_mul(gu, gu + F, F, hid);
        prepare_vec(vec, hid, F, site_act(m, SITE_DOWN));
        ready_for(vec, &down);
        float *out = res + (size_t)j * E;
        for (int r = 0; r < E; r++) out[r] = dot_vec(&down, r, vec);
        if (db)
            for (int r = 0; r < E; r++) out[r] += db[r];
    }
    team_barrier();
    for (int j = 0; j < k; j++)
        for (int i = 0; i < E; i++) x[i] += w[j] * res[(size_t)j * E + i];
}

/* A mixture of experts' MLP on the normed input xn, added to the residual x: the router's
 * logits (into the shared lg), then each chosen expert's gate/up, activation and down, its
 * rows read from the 3-D tensors where they lie; only the chosen experts' rows are read.
 * Called by every thread of the team, each with its own x, xn, hid and vec. */
static void moe_mlp(const Model *m, int l, Vec *vec, const float *xn, float *gu, float *hid, float *dn, float *lg,
                    float *x, float *own_gu) {
    const int E = m->dim, F = m->expert_dim, k = m->n_experts_used;
    int ids[MAX_EXPERTS_USED];
    float w[MAX_EXPERTS_USED];
    prepare_vec(vec, xn, E, site_act(m, SITE_GU));
    matvec_par(&m->router[l], vec, lg);
    route(m, lg, m->router_bias ? m->router_bias[l] : NULL, ids, w);
    const Group *all = &m->wgu[l];
    const int split = team_size() > 1 && k >= team_size() && !all->part[0].x8 && !all->part[1].x8 &&
                      !m->wdown[l].part[0].x8;
    if (split) moe_split(m, l, vec, xn, ids, w, own_gu, hid, lg + m->n_experts, x);
    for (int j = 0; j < k && !split; j++) {
        Group g = *all;
        g.part[0] = expert_rows(&all->part[0], ids[j], F);
        g.part[1] = expert_rows(&all->part[1], ids[j], F);
        g.rows = 2 * F;
        g.bias = m->exp_gu_bias ? m->exp_gu_bias[l] + (size_t)ids[j] * 2 * F : NULL;
        if (j) prepare_vec(vec, xn, E, site_act(m, SITE_GU)); /* the down product took vec */
        group_matvec_par(&g, vec, gu);
        if (m->act_fn == ACT_FN_SWIGLU_OAI)
            swiglu_oai_mul(gu, gu + F, F, hid);
        else if (m->act_fn == ACT_FN_GELU_TANH)
            gelu_tanh_mul(gu, gu + F, F, hid);
        else
            silu_mul(gu, gu + F, F, hid);
        prepare_vec(vec, hid, F, site_act(m, SITE_DOWN));
        const Mat down = expert_rows(&m->wdown[l].part[0], ids[j], E);
        matvec_par(&down, vec, dn);
        if (m->exp_down_bias) {
            const float *db = m->exp_down_bias[l] + (size_t)ids[j] * E;
            for (int i = 0; i < E; i++) x[i] += w[j] * (dn[i] + db[i]);
        } else {
            for (int i = 0; i < E; i++) x[i] += w[j] * dn[i];
        }
    }
    if (m->shexp_gu) { /* qwen2moe: the shared expert, times sigmoid(its gate . xn) */
        const int S = m->shexp_gu[l].rows / 2;
        float g = 0.0f;
        for (int i = 0; i < E; i++) g += m->shexp_gate[l][i] * xn[i];
        const float s = 1.0f / (1.0f + expf(-g));
        prepare_vec(vec, xn, E, site_act(m, SITE_GU));
        group_matvec_par(&m->shexp_gu[l], vec, gu);
        silu_mul(gu, gu + S, S, hid);
        prepare_vec(vec, hid, S, site_act(m, SITE_DOWN));
        group_matvec_par(&m->shexp_down[l], vec, dn);
        for (int i = 0; i < E; i++) x[i] += s * dn[i];
    }
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
    float *router = scores + (size_t)H * m->cap;
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
        if (m->n_experts) {
            moe_mlp(m, l, &vec, xn, gu, hid, dn, router, x, kr + D + vec_floats(widest_input(m)));
            continue;
        }
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
    if (m->n_experts && (m->n_experts_used < 1 || m->n_experts_used > m->n_experts ||
                         m->n_experts_used > MAX_EXPERTS_USED || !m->router))
        return -1;
    if (pos < 0 || pos >= m->cap || pos >= m->rope_len || token < 0 || token >= m->embed->rows) return -1;
    DecodeJob job = {m, token, pos, logits};
    team_run(m->n_threads, decode_team, &job);
    return 0;
}

