/* The language model's small float32 operations, each one pass over its rows.
 *
 * torch runs RMSNorm as five or six operators (square, mean, add, rsqrt, two
 * multiplies) and rotary embedding as eight (two slices, a negation, a concat,
 * two multiplies and an add), for q and for k: each a pass over memory and a
 * dispatch. On a decode step of 16 rows that dispatch is most of their time; on
 * a 2048-row prefill it is the passes. vLLM's CPU build has the same kernels
 * (csrc/cpu/layernorm.cpp, pos_encoding.cpp).
 *
 * Built with -ffp-contract=off: every product is rounded before it is added,
 * as torch's separate operators round it, so rotary embedding and the residual
 * add are bit-equal to torch's, and RMSNorm differs only in the order in which
 * a row's squares are summed.
 *
 * Rows are split across OpenMP threads (torch's libgomp) only where a call is
 * big enough to pay for waking them (PARALLEL_MIN elements).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN 65536

/* out = w * (x * r), r = 1 / sqrt(mean(x^2) + eps): HF's Qwen2RMSNorm in float32 */
static void norm_row(float *restrict out, const float *restrict x, const float *restrict w,
                     int64_t n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* out [rows][n] = RMSNorm of x's rows (x_stride floats apart). */
void rms_norm(float *out, const float *x, const float *w, int64_t rows, int64_t n,
              int64_t x_stride, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) norm_row(out + r * n, x + r * x_stride, w, n, eps);
}

/* sum = x + delta, out = RMSNorm(sum), all [rows][n]: a residual add and the next norm. */
void add_rms_norm(float *sum, float *out, const float *x, const float *delta, const float *w,
                  int64_t rows, int64_t n, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *s = sum + r * n;
        const float *a = x + r * n, *b = delta + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) s[i] = a[i] + b[i];
        norm_row(out + r * n, s, w, n, eps);
    }
}

/* Rotates heads [tokens][heads][dim] in place (a token's heads contiguous, tokens
 * token_stride floats apart) by cos/sin [tokens][dim], as HF's rotate_half does:
 * out = x * cos + cat(-x2, x1) * sin for the halves x1, x2 of each head. */
void rotary(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads,
            int64_t dim, int64_t token_stride, int num_threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *row = x + t * token_stride + h * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = row[i], b = row[i + half];
                row[i] = a * c[i] + (-b) * s[i];
                row[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
