/* The operations of a layer between its products: RMSNorm, RoPE, soft-capping, attention over
 * the cache, and the MLP's activations (SiLU, GELU).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

/* transformers' LlamaRMSNorm in float32: w * (x * rsqrt(mean(x^2) + eps)). */
static void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* rotate_half RoPE on one head, in place. */
static void rope(float *v, const float *cs, const float *sn, int d) {
    const int h = d / 2;
    for (int i = 0; i < h; i++) {
        const float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i] + a * sn[i];
    }
}

/* x -> cap * tanh(x / cap) over n floats, in place (Gemma 2's soft-capping), with
 * tanh(y) = 1 - 2 / (1 + exp(2y)): near 0 that loses the relative precision of tanh but not
 * its absolute one (~1e-7 of cap). */
static void softcap(float *x, int n, float cap) {
    const float inv = 1.0f / cap;
    int i = 0;
#ifdef CB_AVX2
    const __m256 vinv2 = _mm256_set1_ps(2.0f * inv), vcap = _mm256_set1_ps(cap);
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv2));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, e)));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(t, vcap));
    }
#elif defined(CB_NEON)
    const float32x4_t one = vdupq_n_f32(1.0f), two = vdupq_n_f32(2.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = exp4(vmulq_n_f32(vld1q_f32(x + i), 2.0f * inv));
        vst1q_f32(x + i, vmulq_n_f32(vsubq_f32(one, vdivq_f32(two, vaddq_f32(one, e))), cap));
    }
#endif
    for (; i < n; i++) x[i] = cap * tanhf(x[i] * inv);
}

/* One head of attention over the cached positions [0, n) and the new one:
 * softmax(q.K^T * scale) V, with the new key and value in `k_new`, `v_new`; `cap` > 0
 * soft-caps the scores first; `sink` (gpt-oss; -INFINITY: none) is one more logit in the
 * softmax's denominator, with no value. */
static void attend(const float *q, const float *kc, const float *vc, const float *k_new, const float *v_new,
                   int n, int d, float scale, float cap, float sink, float *sc, float *out) {
    for (int t = 0; t < n; t++) sc[t] = dot_f32(kc + (size_t)t * d, q, d) * scale;
    sc[n] = dot_f32(k_new, q, d) * scale;
    const int total = n + 1;
    if (cap > 0.0f) softcap(sc, total, cap);
    float mx = -INFINITY;
    for (int t = 0; t < total; t++) mx = sc[t] > mx ? sc[t] : mx;
    mx = sink > mx ? sink : mx;
    float sum = 0.0f;
    int t = 0;
#ifdef CB_AVX2
    __m256 vmx = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
    for (; t + 8 <= total; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vmx));
        _mm256_storeu_ps(sc + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum256(vs);
#elif defined(CB_NEON)
    const float32x4_t vmx = vdupq_n_f32(mx);
    float32x4_t vs = vdupq_n_f32(0.0f);
    for (; t + 4 <= total; t += 4) {
        const float32x4_t e = exp4(vsubq_f32(vld1q_f32(sc + t), vmx));
        vst1q_f32(sc + t, e);
        vs = vaddq_f32(vs, e);
    }
    sum = vaddvq_f32(vs);
#endif
    for (; t < total; t++) {
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
    }
    sum += expf(sink - mx); /* gpt-oss's sink (-INFINITY for none: adds 0) */
    const float inv = 1.0f / sum;
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (t = 0; t < total; t++) {
        const float p = sc[t] * inv;
        const float *v = t < n ? vc + (size_t)t * d : v_new;
        int i = 0;
#ifdef CB_AVX2
        const __m256 vp = _mm256_set1_ps(p);
        for (; i + 8 <= d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
#elif defined(CB_NEON)
        for (; i + 4 <= d; i += 4) vst1q_f32(out + i, vfmaq_n_f32(vld1q_f32(out + i), vld1q_f32(v + i), p));
#endif
        for (; i < d; i++) out[i] += p * v[i];
    }
}

/* out = silu(g) * u over n floats (transformers' SiLU: x * sigmoid(x)). */
static void silu_mul(const float *g, const float *u, int n, float *out) {
    int i = 0;
#ifdef CB_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_sub_ps(zero, x));
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
#elif defined(CB_NEON)
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(g + i);
        const float32x4_t sig = vdivq_f32(one, vaddq_f32(one, exp4(vnegq_f32(x))));
        vst1q_f32(out + i, vmulq_f32(vmulq_f32(x, sig), vld1q_f32(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* gpt-oss's clamped SwiGLU over n floats: with x = min(g, 7) and y = clamp(u, -7, 7),
 * out = x sigmoid(1.702 x) (y + 1) (transformers' GptOssExperts, llama.cpp's swiglu_oai). */
static void swiglu_oai_mul(const float *g, const float *u, int n, float *out) {
    for (int i = 0; i < n; i++) {
        const float x = g[i] < 7.0f ? g[i] : 7.0f;
        const float y = u[i] < -7.0f ? -7.0f : (u[i] > 7.0f ? 7.0f : u[i]);
        out[i] = x / (1.0f + expf(-1.702f * x)) * (y + 1.0f);
    }
}

/* out = gelu_tanh(g) * u over n floats: transformers' gelu_pytorch_tanh,
 * 0.5 x (1 + tanh(c (x + 0.044715 x^3))), written as x * sigmoid(2 c (x + 0.044715 x^3)). */
static void gelu_tanh_mul(const float *g, const float *u, int n, float *out) {
    const float c2 = 2.0f * 0.7978845608028654f, a = 0.044715f;
    int i = 0;
#ifdef CB_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), vc = _mm256_set1_ps(-c2), va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(va, x), _mm256_mul_ps(x, x), x);
        const __m256 e = exp256(_mm256_mul_ps(vc, inner));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#elif defined(CB_NEON)
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(g + i);
        const float32x4_t inner = vfmaq_f32(x, vmulq_n_f32(x, a), vmulq_f32(x, x));
        const float32x4_t e = exp4(vmulq_n_f32(inner, -c2));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(x, vaddq_f32(one, e)), vld1q_f32(u + i)));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i];
        out[i] = x / (1.0f + expf(-c2 * (x + a * x * x * x))) * u[i];
    }
}

