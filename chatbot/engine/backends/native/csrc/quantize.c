/* Float32 rows packed into Q8_0 or Q4_1 (chatbot_quantize).
 *
 * Part of the kernels' one translation unit: kernels.c includes it after the parts before it, whose
 * definitions it uses; it is not compiled alone. */

typedef struct {
    const float *w;
    int rows, cols, fmt;
    void *out;
    atomic_uint worst, biggest; /* float bits (both >= 0) */
} QuantizeJob;

static void quantize_team(void *arg) {
    QuantizeJob *job = arg;
    const float *w = job->w;
    const int cols = job->cols, fmt = job->fmt, nb = cols / QK;
    void *out = job->out;
    float worst = 0.0f, biggest = 0.0f;
    const Span share = team_share(job->rows);
    for (int n = share.lo; n < share.hi; n++) {
        const float *row = w + (size_t)n * cols;
        for (int j = 0; j < nb; j++) {
            const float *x = row + j * QK;
            if (fmt == FMT_Q8_0) {
                block_q8_0 *b = (block_q8_0 *)out + (size_t)n * nb + j;
                float amax = 0.0f;
                for (int i = 0; i < QK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
                biggest = amax > biggest ? amax : biggest;
                b->d = f32_to_fp16(amax / 127.0f);
                const float d = fp16_to_f32(b->d), id = d > 0.0f ? 1.0f / d : 0.0f;
                for (int i = 0; i < QK; i++) {
                    float q = nearbyintf(x[i] * id);
                    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                    b->qs[i] = (int8_t)q;
                    const float e = fabsf(x[i] - d * q);
                    worst = e > worst ? e : worst;
                }
            } else {
                block_q4_1 *b = (block_q4_1 *)out + (size_t)n * nb + j;
                float lo = x[0], hi = x[0];
                for (int i = 1; i < QK; i++) {
                    lo = x[i] < lo ? x[i] : lo;
                    hi = x[i] > hi ? x[i] : hi;
                }
                biggest = fabsf(lo) > biggest ? fabsf(lo) : biggest;
                biggest = fabsf(hi) > biggest ? fabsf(hi) : biggest;
                b->m = f32_to_fp16(lo);
                b->d = f32_to_fp16((hi - lo) / 15.0f);
                const float m = fp16_to_f32(b->m), d = fp16_to_f32(b->d);
                const float id = d > 0.0f ? 1.0f / d : 0.0f;
                uint8_t q[QK];
                for (int i = 0; i < QK; i++) {
                    float v = nearbyintf((x[i] - m) * id);
                    v = v > 15.0f ? 15.0f : (v < 0.0f ? 0.0f : v);
                    q[i] = (uint8_t)v;
                    const float e = fabsf(x[i] - (d * v + m));
                    worst = e > worst ? e : worst;
                }
                for (int i = 0; i < QK / 2; i++) b->qs[i] = (uint8_t)(q[i] | (q[i + 16] << 4));
            }
        }
    }
    team_max(&job->worst, worst);
    team_max(&job->biggest, biggest);
}

/* Pack float32 rows [rows, cols] into Q8_0 or Q4_1 at `out`. stats[0]: the largest
 * |w - dequantized w| (0 for a matrix that was in that format already); stats[1]: the
 * largest |w|. */
void chatbot_quantize(const float *w, int rows, int cols, int fmt, void *out, int n_threads, float *stats) {
    QuantizeJob job = {w, rows, cols, fmt, out, 0, 0};
    team_run(n_threads, quantize_team, &job);
    stats[0] = bits_float(atomic_load(&job.worst));
    stats[1] = bits_float(atomic_load(&job.biggest));
}
