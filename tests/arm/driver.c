/* The aarch64 side of scripts/test-arm: the kernels built for ARM (this file includes
 * csrc/kernels.c, which includes the other parts, so one static program runs under
 * qemu-aarch64), run on the inputs that tests/arm/make_reference.py wrote on x86, its outputs
 * compared with x86's.
 *
 *     driver DIR     (DIR/manifest.txt: one check per line, see make_reference.py)
 *
 * Prints one line per check ("ok" or "FAILED" and the largest differences) and exits 0
 * only when every check agrees.
 *
 * Tolerances. A product's integer sums are exact on both machines, but NEON adds its float
 * partial sums in another order than AVX2 / AVX-512, so results differ by float32 rounding:
 * each is held to the standard tests/test_ggml_formats.py holds the x86 build to, within
 * 2e-6 |w|.|x| (+1e-6) of the float64 product of the weights with x as the kernels hold it,
 * and within twice that of x86's own result. A decode step's logits carry such roundings
 * through every layer, and with int16 activations a rounding can tip an activation to the
 * next integer: within 1e-3 of x86's largest logit (measured: up to 1.1e-4 on the default
 * model; a wrong product moves logits by whole units), and the same greedy token at every
 * step. */
#include "../../chatbot/engine/backends/native/csrc/kernels.c"

#include <stdio.h>

static void *read_all(const char *dir, const char *name, const char *ext, size_t *size) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s%s", dir, name, ext);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "driver: cannot open %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = aligned_alloc(64, ((size_t)n + 63) / 64 * 64 + 64);
    if (!p || fread(p, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "driver: cannot read %s\n", path);
        exit(2);
    }
    fclose(f);
    if (size) *size = (size_t)n;
    return p;
}

static int check_product(const char *dir, const char *name, int fmt, int act, int rows, int cols) {
    Mat m = {read_all(dir, name, ".w", NULL), fmt, rows, cols, 0};
    const float *x = read_all(dir, name, ".x", NULL), *ref = read_all(dir, name, ".y", NULL);
    const double *exact = read_all(dir, name, ".exact", NULL), *bound = read_all(dir, name, ".bound", NULL);
    float *y = malloc(sizeof(float) * (size_t)rows);
    float *scratch = malloc(sizeof(float) * (size_t)chatbot_matvec_scratch(cols));
    chatbot_matvec(&m, x, scratch, y, 1, act);
    double worst_x86 = 0.0, worst_exact = 0.0; /* in units of the allowed error */
    for (int r = 0; r < rows; r++) {
        const double allowed = 2e-6 * bound[r] + 1e-6;
        const double dx = fabs((double)y[r] - ref[r]) / (2.0 * allowed), de = fabs((double)y[r] - exact[r]) / allowed;
        worst_x86 = dx > worst_x86 || dx != dx ? dx : worst_x86;
        worst_exact = de > worst_exact || de != de ? de : worst_exact;
    }
    const int ok = worst_x86 <= 1.0 && worst_exact <= 1.0;
    printf("%-6s product %-10s largest difference %.3f of the allowed from x86, %.3f from float64\n",
           ok ? "ok" : "FAILED", name, worst_x86, worst_exact);
    free(y);
    free(scratch);
    return ok;
}

/* ---------------------------------------------------------------- a Model from NAME.txt */

typedef struct {
    char kind, name[64];
    long a, b, c, off, size; /* m: fmt rows cols; g: parts rows; i: value */
    float f;
} Item;

typedef struct {
    Item *items;
    int n;
    char *blob;
} Desc;

static const Item *find(const Desc *d, const char *name) {
    for (int i = 0; i < d->n; i++)
        if (!strcmp(d->items[i].name, name)) return &d->items[i];
    return NULL;
}

static const Item *need(const Desc *d, const char *name) {
    const Item *it = find(d, name);
    if (!it) {
        fprintf(stderr, "driver: the model has no %s\n", name);
        exit(2);
    }
    return it;
}

static void *array(const Desc *d, const char *name) {
    const Item *it = find(d, name);
    return it ? d->blob + it->off : NULL;
}

static Mat mat(const Desc *d, const char *name) {
    const Item *it = need(d, name);
    Mat m = {d->blob + it->off, (int32_t)it->a, (int32_t)it->b, (int32_t)it->c, 0};
    return m;
}

/* per-layer arrays NAME.0, NAME.1... as a pointer table, or NULL where there are none */
static const float *const *layer_arrays(const Desc *d, const char *name, int layers) {
    char key[80];
    snprintf(key, sizeof key, "%s.0", name);
    if (!find(d, key)) return NULL;
    const float **p = malloc(sizeof(float *) * (size_t)layers);
    for (int l = 0; l < layers; l++) {
        snprintf(key, sizeof key, "%s.%d", name, l);
        p[l] = (const float *)(d->blob + need(d, key)->off);
    }
    return p;
}

static Group *groups(const Desc *d, const char *name, int layers) {
    Group *g = calloc((size_t)layers, sizeof(Group));
    char key[80];
    for (int l = 0; l < layers; l++) {
        snprintf(key, sizeof key, "%s.%d", name, l);
        const Item *it = need(d, key);
        g[l].n_parts = (int32_t)it->a;
        g[l].rows = (int32_t)it->b;
        for (int p = 0; p < g[l].n_parts; p++) {
            snprintf(key, sizeof key, "%s.%d.%d", name, l, p);
            g[l].part[p] = mat(d, key);
        }
        snprintf(key, sizeof key, "%s.%d.bias", name, l);
        g[l].bias = array(d, key);
    }
    return g;
}

static Desc read_desc(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.txt", dir, name);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "driver: cannot open %s\n", path);
        exit(2);
    }
    Desc d = {calloc(4096, sizeof(Item)), 0, read_all(dir, name, ".bin", NULL)};
    char kind[8], value[64];
    while (d.n < 4096 && fscanf(f, "%7s", kind) == 1) {
        Item *it = &d.items[d.n++];
        it->kind = kind[0];
        int got = 0;
        switch (kind[0]) {
        case 'i': got = fscanf(f, "%63s %ld", it->name, &it->a) == 2; break;
        case 'f': got = fscanf(f, "%63s %63s", it->name, value) == 2, it->f = strtof(value, NULL); break;
        case 'a': got = fscanf(f, "%63s %ld %ld", it->name, &it->off, &it->size) == 3; break;
        case 'm': got = fscanf(f, "%ld %ld %ld %63s %ld %ld", &it->a, &it->b, &it->c, it->name, &it->off, &it->size) == 6; break;
        case 'g': got = fscanf(f, "%63s %ld %ld", it->name, &it->a, &it->b) == 3; break;
        }
        if (!got) {
            fprintf(stderr, "driver: %s: cannot read line %d\n", path, d.n);
            exit(2);
        }
    }
    fclose(f);
    return d;
}

static int check_decode(const char *dir, const char *name, int steps) {
    const Desc d = read_desc(dir, name);
    Model m = {0};
    m.n_layers = (int32_t)need(&d, "n_layers")->a;
    m.dim = (int32_t)need(&d, "dim")->a;
    m.n_heads = (int32_t)need(&d, "n_heads")->a;
    m.n_kv_heads = (int32_t)need(&d, "n_kv_heads")->a;
    m.head_dim = (int32_t)need(&d, "head_dim")->a;
    m.ffn_dim = (int32_t)need(&d, "ffn_dim")->a;
    m.vocab = (int32_t)need(&d, "vocab")->a;
    m.act = (int32_t)need(&d, "act")->a;
    m.act_fn = (int32_t)need(&d, "act_fn")->a;
    m.rope_len = (int32_t)need(&d, "rope_len")->a;
    m.cap = (int32_t)need(&d, "cap")->a;
    m.eps = need(&d, "eps")->f;
    m.attn_scale = need(&d, "attn_scale")->f;
    m.embed_scale = need(&d, "embed_scale")->f;
    m.attn_softcap = need(&d, "attn_softcap")->f;
    m.final_softcap = need(&d, "final_softcap")->f;
    m.n_threads = 2;
    m.rope_cos = array(&d, "rope_cos");
    m.rope_sin = array(&d, "rope_sin");
    m.rope_cos2 = array(&d, "rope_cos2");
    m.rope_sin2 = array(&d, "rope_sin2");
    Mat embed = mat(&d, "embed"), head = mat(&d, "lm_head");
    m.embed = &embed;
    m.lm_head = &head;
    m.final_norm = array(&d, "final_norm");
    m.attn_norm = layer_arrays(&d, "attn_norm", m.n_layers);
    m.ffn_norm = layer_arrays(&d, "ffn_norm", m.n_layers);
    m.q_norm = layer_arrays(&d, "q_norm", m.n_layers);
    m.k_norm = layer_arrays(&d, "k_norm", m.n_layers);
    m.post_attn_norm = layer_arrays(&d, "post_attn_norm", m.n_layers);
    m.post_ffn_norm = layer_arrays(&d, "post_ffn_norm", m.n_layers);
    m.window = array(&d, "window");
    m.rope_sel = array(&d, "rope_sel");
    m.wqkv = groups(&d, "wqkv", m.n_layers);
    m.wo = groups(&d, "wo", m.n_layers);
    m.wgu = groups(&d, "wgu", m.n_layers);
    m.wdown = groups(&d, "wdown", m.n_layers);
    float **kc = malloc(sizeof(float *) * (size_t)m.n_layers), **vc = malloc(sizeof(float *) * (size_t)m.n_layers);
    for (int l = 0; l < m.n_layers; l++) {
        kc[l] = calloc((size_t)m.n_kv_heads * m.cap * m.head_dim, sizeof(float));
        vc[l] = calloc((size_t)m.n_kv_heads * m.cap * m.head_dim, sizeof(float));
    }
    m.kcache = kc;
    m.vcache = vc;
    m.scratch = malloc(sizeof(float) * (size_t)chatbot_scratch_floats(&m, m.n_threads));
    const int *tokens = read_all(dir, name, ".tokens", NULL);
    const float *ref = read_all(dir, name, ".logits", NULL);
    float *logits = malloc(sizeof(float) * (size_t)m.vocab);
    int same_tokens = 1;
    double worst = 0.0, top = 0.0;
    for (int pos = 0; pos < steps; pos++) {
        if (chatbot_decode(&m, tokens[pos], pos, logits) != 0) {
            printf("FAILED decode  %s: chatbot_decode refused position %d\n", name, pos);
            return 0;
        }
        const float *want = ref + (size_t)pos * m.vocab;
        int best = 0, best_ref = 0;
        for (int i = 0; i < m.vocab; i++) {
            const double diff = fabs((double)logits[i] - want[i]);
            worst = diff > worst || diff != diff ? diff : worst;
            top = fabs(want[i]) > top ? fabs(want[i]) : top;
            best = logits[i] > logits[best] ? i : best;
            best_ref = want[i] > want[best_ref] ? i : best_ref;
        }
        same_tokens &= best == best_ref;
    }
    const int ok = worst <= 1e-3 * top && same_tokens;
    printf("%-6s decode  %s: %d steps, largest logit difference %.2e (%.2e of the largest logit)%s\n",
           ok ? "ok" : "FAILED", name, steps, worst, worst / top, same_tokens ? ", same greedy tokens" : ", OTHER greedy tokens");
    return ok;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: driver DIR (written by tests/arm/make_reference.py)\n");
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/manifest.txt", argv[1]);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "driver: cannot open %s\n", path);
        return 2;
    }
#if defined(__aarch64__) && !defined(CB_NEON)
    printf("FAILED kernels.c was built without its NEON code\n");
    return 1;
#elif defined(CB_NEON) && defined(__ARM_FEATURE_DOTPROD)
    printf("kernels.c: NEON, with the int8 dot products (sdot)\n");
#elif defined(CB_NEON)
    printf("kernels.c: NEON, without the int8 dot products (widening multiplies)\n");
#else
    printf("kernels.c: not the NEON build (a check of this driver on the machine that wrote DIR)\n");
#endif
    char kind[16], name[128];
    int passed = 0, failed = 0;
    while (fscanf(f, "%15s %127s", kind, name) == 2) {
        int ok = 0;
        if (!strcmp(kind, "product")) {
            int fmt, act, rows, cols;
            if (fscanf(f, "%d %d %d %d", &fmt, &act, &rows, &cols) != 4) break;
            ok = check_product(argv[1], name, fmt, act, rows, cols);
        } else {
            int steps;
            if (fscanf(f, "%d", &steps) != 1) break;
            ok = check_decode(argv[1], name, steps);
        }
        passed += ok;
        failed += !ok;
        fflush(stdout);
    }
    fclose(f);
    printf("%d checks: %d agree, %d FAILED\n", passed + failed, passed, failed);
    return failed || !passed ? 1 : 0;
}
