/* The language model's small operations, float32 or bfloat16, each one pass
 * over its rows.
 *
 * torch runs RMSNorm as five or six operators (square, mean, add, rsqrt, two
 * multiplies) and rotary embedding as eight (two slices, a negation, a concat,
 * two multiplies and an add), for q and for k: each a pass over memory and a
 * dispatch. On a decode step of 16 rows that dispatch is most of their time; on
 * a 2048-row prefill it is the passes. vLLM's CPU build has the same kernels
 * (csrc/cpu/layernorm.cpp, pos_encoding.cpp). The MLP's SiLU and product
 * (bfloat16) take one pass instead of two and a tensor between them, the SiLU
 * looked up in a table of torch's own results (exact, and no e^x to compute:
 * 2.3x faster than torch's two operators on a 1752-token prefill's activations).
 *
 * Built with -ffp-contract=off: every product is rounded before it is added,
 * as torch's separate operators round it, so rotary embedding and the residual
 * add are bit-equal to torch's, and RMSNorm differs only in the order in which
 * a row's squares are summed.
 *
 * bfloat16 tensors are computed in float32 and rounded (to nearest even) where
 * torch rounds each operator's bfloat16 result: rotary embedding and the
 * residual add stay bit-equal to torch's in bfloat16 too.
 *
 * Rows are split across OpenMP threads (torch's libgomp) only where a call is
 * big enough to pay for waking them (PARALLEL_MIN elements).
 */
#include "exp.h"
#include "kernels.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN 65536

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float round_bf16(float f) { /* to the nearest bfloat16, as torch rounds */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits = isnan(f) ? 0x7FC00000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n elements of a float32 or bfloat16 (bf16) tensor from `at` as float32: in
 * place, or converted into buf */
static const float *as_float(const void *tensor, int64_t at, int64_t n, int bf16, float *buf) {
    if (!bf16) return (const float *)tensor + at;
    const uint16_t *src = (const uint16_t *)tensor + at;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_float(src[i]);
    return buf;
}

/* n float32 values rounded to their nearest bfloat16, in place (for `store`) */
static void round_row(float *restrict row, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) row[i] = round_bf16(row[i]);
}

/* Where a row of results is computed: in the float32 tensor, or in buf for `store` */
static float *result_row(void *tensor, int64_t at, int bf16, float *buf) {
    return bf16 ? buf : (float *)tensor + at;
}

/* bfloat16 bits of a float32 that holds a bfloat16 value (round_bf16's) */
static inline uint16_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

/* A bfloat16 tensor's row from buf's n values (already rounded); float32 rows were
 * computed in place */
static void store(void *tensor, int64_t at, const float *restrict buf, int64_t n, int bf16) {
    if (!bf16) return;
    uint16_t *dst = (uint16_t *)tensor + at;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_bits(buf[i]);
}

/* out = w * (x * r), r = 1 / sqrt(mean(x^2) + eps): HF's Qwen2RMSNorm, whose
 * x * r is in float32 and (bf16) rounded before the weight scales it */
static void norm_row(float *restrict out, const float *restrict x, const float *restrict w,
                     int64_t n, float eps, int bf16) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    if (bf16) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = round_bf16(w[i] * round_bf16(x[i] * r));
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
    }
}

/* out [rows][n] = RMSNorm of x's rows (x_stride elements apart). */
void rms_norm(void *out, const void *x, const void *w, int64_t rows, int64_t n,
              int64_t x_stride, float eps, int bf16, int num_threads) {
    float weights[n];
    const float *weight = as_float(w, 0, n, bf16, weights);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float in[n], normed[n];
        float *o = result_row(out, r * n, bf16, normed);
        norm_row(o, as_float(x, r * x_stride, n, bf16, in), weight, n, eps, bf16);
        store(out, r * n, o, n, bf16);
    }
}

/* add_rms_norm's row in bfloat16, in two passes over it: the sum (rounded, stored,
 * its squares summed), then the norm */
static void add_norm_row_bf16(uint16_t *restrict sum, uint16_t *restrict out,
                              const uint16_t *restrict x, const uint16_t *restrict delta,
                              const float *restrict w, int64_t n, float eps) {
    float s[n];
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; i++) {
        s[i] = round_bf16(bf16_to_float(x[i]) + bf16_to_float(delta[i]));
        sum[i] = bf16_bits(s[i]);
        squares += s[i] * s[i];
    }
    const float r = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = bf16_bits(round_bf16(w[i] * round_bf16(s[i] * r)));
}

/* sum = x + delta, out = RMSNorm(sum), all [rows][n]: a residual add and the next norm. */
void add_rms_norm(void *sum, void *out, const void *x, const void *delta, const void *w,
                  int64_t rows, int64_t n, float eps, int bf16, int num_threads) {
    float weights[n];
    const float *weight = as_float(w, 0, n, bf16, weights);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            add_norm_row_bf16((uint16_t *)sum + r * n, (uint16_t *)out + r * n,
                              (const uint16_t *)x + r * n, (const uint16_t *)delta + r * n,
                              weight, n, eps);
            continue;
        }
        const float *a = (const float *)x + r * n, *b = (const float *)delta + r * n;
        float *s = (float *)sum + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) s[i] = a[i] + b[i];
        norm_row((float *)out + r * n, s, weight, n, eps, 0);
    }
}

/* Rotates heads [tokens][heads][dim] in place (a token's heads contiguous, tokens
 * token_stride elements apart) by cos/sin [tokens][dim], as HF's rotate_half does:
 * out = x * cos + cat(-x2, x1) * sin for the halves x1, x2 of each head, in the
 * precision of cos/sin: bf16 x by bf16 cos/sin (the language model's) has each
 * product and the sum rounded, as torch's three operators round them; by float32
 * cos/sin (cos_bf16 = 0: HF's vision towers, which rotate in float32) it is
 * computed in float32 and rounded once. */
void rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads,
            int64_t dim, int64_t token_stride, int bf16, int cos_bf16, int num_threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        float cb[dim], sb[dim], buf[dim];
        const float *c = as_float(cos, t * dim, dim, cos_bf16, cb);
        const float *s = as_float(sin, t * dim, dim, cos_bf16, sb);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * token_stride + h * dim;
            float *row = result_row(x, at, bf16, buf);
            as_float(x, at, dim, bf16, buf); /* bf16: the head into buf (float32: in place) */
            if (cos_bf16) {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float a = row[i], b = row[i + half];
                    row[i] = round_bf16(round_bf16(a * c[i]) + round_bf16((-b) * s[i]));
                    row[i + half] =
                        round_bf16(round_bf16(b * c[i + half]) + round_bf16(a * s[i + half]));
                }
            } else {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float a = row[i], b = row[i + half];
                    row[i] = a * c[i] + (-b) * s[i];
                    row[i + half] = b * c[i + half] + a * s[i + half];
                }
                if (bf16) round_row(row, dim);
            }
            store(x, at, row, dim, bf16);
        }
    }
}

/* out [rows][n] = SiLU(gate) * up for bfloat16 x [rows][2n] = [gate | up] (rows
 * x_stride elements apart), as F.silu(gate) * up: the SiLU is silu[its bits]
 * (torch's SiLU of each of the 65536 bfloat16 values, as float32), the product
 * rounded once to bfloat16, as torch rounds it. */
void silu_mul(uint16_t *out, const uint16_t *x, const float *silu, int64_t rows, int64_t n,
              int64_t x_stride, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * x_stride, *up = gate + n;
        uint16_t *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            o[i] = bf16_bits(round_bf16(silu[gate[i]] * bf16_to_float(up[i])));
    }
}

/* out [rows][n] = F.silu(gate) * up in float32 for x [rows][2n] = [gate | up]
 * (rows x_stride elements apart): SiLU as torch computes it, gate / (1 + e^-gate),
 * with exp.h's e^x (within 2 ulp of libm's, as torch's own is), of -|gate| so that
 * it never overflows: for gate < 0, e^-gate = 1 / e^gate. One pass instead of
 * torch's two operators and the tensor between them. */
void silu_mul_f32(float *out, const float *x, int64_t rows, int64_t n, int64_t x_stride,
                  int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float g = gate[i], e = exp_nonpositive(-fabsf(g));
            o[i] = g / (1.0f + (g >= 0.0f ? e : 1.0f / e)) * up[i];
        }
    }
}
