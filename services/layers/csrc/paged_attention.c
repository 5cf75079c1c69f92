/* Decode attention over the paged KV cache, on the CPU, in float32 or bfloat16.
 *
 * One query token per sequence attends to all its keys where they lie, page by
 * page: no copy of the context (gathering the pages for SDPA reads, writes and
 * rereads the whole context, every layer of every step).
 *
 *   q, out        [num_seqs][num_heads][head_dim]
 *   keys, values  [pages][page_size][num_kv_heads][head_dim]  one layer's cache
 *   block_tables  [num_seqs][max_pages]  each sequence's pages, in order
 *   seq_lens      [num_seqs]             its keys, the new token's included
 *
 * One task per sequence; fewer sequences than threads are split in parts of whole
 * chunks, one task a part, merged after (as flash-decoding splits the keys): one
 * long request alone is read by every thread, not one (parts_of). A task walks
 * its pages in chunks of keys (with a running maximum and sum, as SDPA's CPU
 * kernel does): each chunk's keys, then its values, front to back, every head at
 * once: a whole token row is one contiguous run, which the hardware prefetches
 * well (one task per KV head read a quarter of each row and was ~1.5x slower on
 * a cold cache); keys 16 and KEYS_AHEAD tokens on and this 16's values are
 * asked for ahead (prefetch_block), except in float32 (scores_f32), where the
 * hardware's own prefetching was faster.
 * Softmax per chunk: the scores, then their maximum (and the running one: the
 * output so far and the running sum are scaled where it grows), exponentials and
 * sum (a vectorized e^x: libm's expf, called once a score, was a quarter of the
 * kernel's time); then the values weighed by the exponentials; the output is
 * divided by the sum at the end.
 * float32 caches with head_dim a multiple of 64 (the AVX2 class's dtype), built
 * for AVX2 or more, take GCC's vectors of 8 floats: scores 8 tokens at a time,
 * their sums taken together, and values weighed with the sums in registers
 * (scores_f32, values_f32). Other shapes: bfloat16 tensors are read into float32 a token row
 * at a time and computed in float32, rounding where SDPA's CPU kernel rounds: the
 * exponentials before they weigh the values, and the output. Where the compiler
 * targets AVX512-BF16 (-march=native on such a CPU), bfloat16 scores are instead
 * dot products of bf16 pairs (vdpbf16ps), 16 tokens at a time, their horizontal
 * sums taken together (1.8x faster on the medium demo's shapes), and the values
 * are weighed two tokens at a time the same way, the query heads of a KV head
 * together, their sums in registers.
 * Tasks run on OpenMP threads; built against torch's own libgomp, they share
 * its thread pool.
 */
#include "amx.h"
#include "exp.h"
#include "kernels.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

static float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* n elements of `tensor` from `offset` as float32: in place, or converted into buf. */
static const float *as_float(const void *tensor, int64_t offset, int64_t n, int bf16, float *buf) {
    if (!bf16) return (const float *)tensor + offset;
    const uint16_t *src = (const uint16_t *)tensor + offset;
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_float(src[i]);
    return buf;
}

static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* Asks ahead for what the 16 tokens from t lead to: the next 16 tokens' keys, into
 * every cache level (the scores read them next), those KEYS_AHEAD on and these
 * 16's values, into all but L1 (the values pass reads them); keys up to `ahead`
 * (the chunks after this one's `len` included). `rows`: where each token's row lies, in
 * elements of `size` bytes; `width`: a row's elements. A sequence's pages lie
 * anywhere in the pool, so the hardware prefetchers, which follow a run of
 * addresses and stop at each 4 KiB page of memory, start cold on each of them:
 * measured on a 2-core Xeon (AMX), the small demo's decode step spent 35 % less
 * time in this kernel with it. Always inlined: GCC counts a function of nothing
 * but prefetches as free of effects, and drops a call to it that it has not
 * inlined (a wrapper around it lost every prefetch). */
static inline __attribute__((always_inline)) void
prefetch_row(const void *cache, const int64_t *rows, int64_t u, int64_t size, int64_t width,
             int into_l1) { /* token u's row: into every level, or all but L1 */
    for (int64_t at = 0; at < size * width; at += 64)
        if (into_l1)
            __builtin_prefetch((const char *)cache + rows[u] * size + at, 0, 3);
        else
            __builtin_prefetch((const char *)cache + rows[u] * size + at, 0, 2);
}

/* Tokens ahead whose keys the scores pass asks for into L2, beside the next 16's
 * into L1: a page's worth ahead was too close to cover the memory's latency (the
 * medium demo's KV at 1024 tokens: ~1.3x faster with both). */
#define KEYS_AHEAD 64
/* Tokens ahead whose values a values pass asks for into L2 */
#define VALUES_AHEAD 64

static inline __attribute__((always_inline)) void
prefetch_block(const void *keys, const void *values, const int64_t *rows, int64_t t, int64_t len,
               int64_t ahead, int64_t size, int64_t width) {
    for (int64_t u = t + 16; u < t + 32 && u < ahead; u++) prefetch_row(keys, rows, u, size, width, 1);
    for (int64_t u = t + KEYS_AHEAD; u < t + KEYS_AHEAD + 16 && u < ahead; u++)
        prefetch_row(keys, rows, u, size, width, 0);
    for (int64_t u = t; u < t + 16 && u < len; u++) prefetch_row(values, rows, u, size, width, 0);
}

#if defined(__AVX512BF16__)
/* [sum of v[0]'s lanes, ..., sum of v[15]'s lanes]: sixteen horizontal sums as 15
 * adds and 30 shuffles (pairs of 32-bit, then 64-bit elements, then 128-bit lanes),
 * not sixteen separate reductions of 4 shuffles and 4 adds each */
static inline __m512 sums16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: each of v[4i..4i+3]'s partial sum */
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                      _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                         _mm512_shuffle_f32x4(low, high, 0xDD));
}

/* scores[h][t] = q[h] . k[t][h / group] for bfloat16 q and keys, 16 tokens at a
 * time with AVX512-BF16's dot products of bf16 pairs (head_dim a multiple of 32).
 * rows[t]: token t's row in the cache, in elements. A last block of fewer than 16
 * tokens repeats its first row in the others (computed, not stored): every block
 * is the same 16 dot products, unrolled, their accumulators in registers. */
static void scores_bf16(float *scores, const uint16_t *q, const uint16_t *keys,
                        const uint16_t *values, const int64_t *rows, int64_t len, int64_t ahead,
                        int64_t num_heads, int64_t group, int64_t dim, int64_t width) {
    for (int64_t t = 0; t < len; t += 16) {
        const int64_t n = len - t < 16 ? len - t : 16;
        const uint16_t *row[16];
        for (int64_t j = 0; j < 16; j++) row[j] = keys + rows[j < n ? t + j : t];
        /* prefetch_block's asks, a share before each head's dot products: all at
         * once, they queue up behind one another (the medium demo's KV read at
         * ~45 % of the read bandwidth, AVX512-BF16, 2 cores; spread, ~53 %) */
        const int64_t per_head = (16 + num_heads - 1) / num_heads;
        for (int64_t h = 0; h < num_heads; h++) {
            for (int64_t u = t + h * per_head; u < t + (h + 1) * per_head && u < t + 16; u++) {
                if (u + 16 < ahead) prefetch_row(keys, rows, u + 16, 2, width, 1);
                if (u + KEYS_AHEAD < ahead) prefetch_row(keys, rows, u + KEYS_AHEAD, 2, width, 0);
                if (u < len) prefetch_row(values, rows, u, 2, width, 0);
            }
            const uint16_t *qh = q + h * dim;
            const int64_t head = h / group * dim;
            __m512 acc[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < dim; c += 32) {
                const __m512bh qc = (__m512bh)_mm512_loadu_si512(qh + c);
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], qc,
                                              (__m512bh)_mm512_loadu_si512(row[j] + head + c));
            }
            _mm512_mask_storeu_ps(scores + h * len + t, (__mmask16)((1u << n) - 1), sums16(acc));
        }
    }
}

/* out[h][dim] += sum over t of weights[h][t] * v[t] for `heads` query heads that
 * read one KV head (v: its part of each row, `head` elements in; weights[h] are
 * `stride` apart), for bfloat16 values and weights that are bfloat16 numbers
 * (rounded as SDPA weighs values), two tokens at a time with AVX512-BF16's dot
 * products of bf16 pairs: 32 dims of two tokens' rows interleaved into (t, t + 1)
 * pairs, once for all the heads (one head at a time loaded and interleaved each
 * row `group` times, the bulk of the pass). The sums stay in registers over the
 * tokens (inlined with dim and heads constants: heads x dim / 16 of them, at most
 * 16). Interleaving works within 128-bit lanes, so each 32 dims accumulate
 * permuted (the low unpack holds dims 8k..8k+3 of lane k, the high one
 * 8k+4..8k+7): `out` holds them so, and unpermute() puts them in order once every
 * token is in (dim a multiple of 32, at most MAX_BF16_DIM). */
#define MAX_BF16_DIM 256
static inline __attribute__((always_inline)) void
values_heads_bf16(float *out, const float *weights, int64_t stride, const uint16_t *values,
                  const int64_t *rows, int64_t len, int64_t dim, int64_t head, int64_t heads) {
    __m512 acc[MAX_BF16_DIM / 16];
    const int64_t n = dim / 16;
    for (int64_t j = 0; j < heads; j++)
        for (int64_t i = 0; i < n; i++) acc[j * n + i] = _mm512_loadu_ps(out + j * dim + 16 * i);
    for (int64_t t = 0; t < len; t += 2) {
        const int64_t next = t + 1 < len ? t + 1 : t; /* an odd last token pairs with itself, */
        const uint16_t *row0 = values + rows[t] + head, *row1 = values + rows[next] + head;
        __m512bh w[4];
        for (int64_t j = 0; j < heads; j++) {
            uint32_t w0, w1 = 0; /* weighed 0 */
            memcpy(&w0, weights + j * stride + t, sizeof w0);
            if (next != t) memcpy(&w1, weights + j * stride + next, sizeof w1);
            w[j] = (__m512bh)_mm512_set1_epi32((int)((w0 >> 16) | (w1 & 0xFFFF0000u)));
        }
        for (int64_t c = 0; c < dim; c += 32) {
            const __m512i x = _mm512_loadu_si512(row0 + c), y = _mm512_loadu_si512(row1 + c);
            const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(x, y);
            const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(x, y);
            for (int64_t j = 0; j < heads; j++) {
                acc[j * n + c / 16] = _mm512_dpbf16_ps(acc[j * n + c / 16], low, w[j]);
                acc[j * n + c / 16 + 1] = _mm512_dpbf16_ps(acc[j * n + c / 16 + 1], high, w[j]);
            }
        }
    }
    for (int64_t j = 0; j < heads; j++)
        for (int64_t i = 0; i < n; i++) _mm512_storeu_ps(out + j * dim + 16 * i, acc[j * n + i]);
}

/* values_heads_bf16 for `heads` query heads of one KV head: as many at once as
 * their sums fit in 16 registers (4 at head_dim 64, 2 at 128), with the sizes
 * constants */
static void values_group_bf16(float *out, const float *weights, int64_t stride,
                              const uint16_t *values, const int64_t *rows, int64_t len,
                              int64_t dim, int64_t head, int64_t heads) {
    const int64_t at_once = dim == 64 ? 4 : dim == 128 ? 2 : 1;
    for (int64_t j = 0; j < heads; j += at_once) {
        const int64_t k = heads - j < at_once ? heads - j : at_once;
        float *o = out + j * dim;
        const float *w = weights + j * stride;
        if (dim == 64 && k == 4)
            values_heads_bf16(o, w, stride, values, rows, len, 64, head, 4);
        else if (dim == 64 && k == 3)
            values_heads_bf16(o, w, stride, values, rows, len, 64, head, 3);
        else if (dim == 64 && k == 2)
            values_heads_bf16(o, w, stride, values, rows, len, 64, head, 2);
        else if (dim == 64)
            values_heads_bf16(o, w, stride, values, rows, len, 64, head, 1);
        else if (dim == 128 && k == 2)
            values_heads_bf16(o, w, stride, values, rows, len, 128, head, 2);
        else if (dim == 128)
            values_heads_bf16(o, w, stride, values, rows, len, 128, head, 1);
        else
            values_heads_bf16(o, w, stride, values, rows, len, dim, head, 1);
    }
}

/* values_heads_bf16's permuted sums of one head, in order */
static void unpermute(float *out, int64_t dim) {
    for (int64_t c = 0; c < dim; c += 32) {
        float permuted[32];
        memcpy(permuted, out + c, sizeof permuted);
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 4; j++) {
                out[c + 8 * k + j] = permuted[4 * k + j];
                out[c + 8 * k + 4 + j] = permuted[16 + 4 * k + j];
            }
    }
}

/* Tokens whose value rows every head reads while they are in L1 (16 KiB of rows
 * on the medium demo, half of a 32 KiB L1): a block of a sequence's rows is read
 * once, front to back (each head read its part of every row in turn, a strided
 * walk of the whole context per head). Even: a block's token pairs do not cross
 * into the next. */
#define VALUE_BLOCK 16

/* out (permuted as values_heads_bf16 keeps it) += the weighed values, for every
 * query head (head h reads KV head h / group), a block of VALUE_BLOCK tokens at a
 * time; weights [num_heads][len]; rows up to `ahead` may be asked for */
static void values_bf16(float *out, const float *weights, const uint16_t *values,
                        const int64_t *rows, int64_t len, int64_t ahead, int64_t num_heads,
                        int64_t group, int64_t dim, int64_t width) {
    for (int64_t t = 0; t < len; t += VALUE_BLOCK) {
        const int64_t n = len - t < VALUE_BLOCK ? len - t : VALUE_BLOCK;
        for (int64_t u = t + VALUES_AHEAD; u < t + VALUES_AHEAD + n && u < ahead; u++)
            prefetch_row(values, rows, u, 2, width, 0);
        for (int64_t h = 0; h < num_heads; h += group)
            values_group_bf16(out + h * dim, weights + h * len + t, len, values, rows + t, n, dim,
                              h / group * dim, group);
    }
}
#endif

#if defined(__AVX2__)
/* float32 caches, head_dim a multiple of 64, on AVX2 builds and up: GCC's vectors
 * of 8 floats (AVX2's registers; an AVX-512 build keeps them). A dot product a
 * (token, head) with its own horizontal sum, and an axpy a (token, head) whose
 * sums went to memory and back, made this path compute-bound.
 * No software prefetch: a float32 row is 1-2 KiB and a page 16-32 KiB of them, runs
 * the hardware prefetchers follow. Measured on a 2-core EPYC (Zen 3, AVX2), the
 * medium demo's caches over 20 layers: prefetch_block's asks (~130 prefetches a
 * token) made the kernel 1.12x slower from memory and 1.4x in cache. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* [sum of a[0]'s lanes, ..., sum of a[7]'s]: pairwise sums of adjacent lanes
 * (vhaddps), then of the 128-bit halves */
static inline v8 sums8(const v8 a[8]) {
#define HADD(x, y) (__builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + \
                    __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
    const v8 h01 = HADD(a[0], a[1]), h23 = HADD(a[2], a[3]);
    const v8 h45 = HADD(a[4], a[5]), h67 = HADD(a[6], a[7]);
    const v8 low = HADD(h01, h23), high = HADD(h45, h67); /* lanes 0-3 and 4-7: halves */
#undef HADD
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* scores[h][t] = q[h] . k[t][h / group], 8 tokens at a time, their 8 dot products'
 * sums taken together (a last block of fewer repeats its first row, computed and
 * not stored) */
static void scores_f32(float *scores, const float *q, const float *keys, const int64_t *rows,
                       int64_t n, int64_t num_heads, int64_t group, int64_t dim) {
    for (int64_t t = 0; t < n; t += 8) {
        const int64_t m = n - t < 8 ? n - t : 8;
        const float *row[8];
        for (int64_t j = 0; j < 8; j++) row[j] = keys + rows[j < m ? t + j : t];
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = q + h * dim;
            const int64_t head = h / group * dim;
            v8 acc[8] = {{0}};
            for (int64_t c = 0; c < dim; c += 8) {
                const v8 qc = load8(qh + c);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) acc[j] += qc * load8(row[j] + head + c);
            }
            const v8 sums = sums8(acc);
            if (m == 8) /* a copy of a size known: a store (else `rep movs`, ~10 % of the kernel) */
                memcpy(scores + h * n + t, &sums, sizeof sums);
            else
                memcpy(scores + h * n + t, &sums, sizeof(float) * m);
        }
    }
}

/* out[64] += sum over t of weights[t] * v[t][head..head + 64]: one query head's 64
 * dims, their sums in 8 registers over the tokens */
static inline void values_f32_64(float *out, const float *weights, const float *values,
                                 const int64_t *rows, int64_t n, int64_t head) {
    v8 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = load8(out + 8 * i);
    for (int64_t t = 0; t < n; t++) {
        const float *v = values + rows[t] + head;
        const v8 w = (v8){0} + weights[t];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] += w * load8(v + 8 * i);
    }
    memcpy(out, acc, sizeof acc);
}

/* Rows of float32 values every head weighs while they are in L1 (16 KiB-32 KiB;
 * 8 rows, the sums loaded and stored twice as often, were ~3 % slower) */
#define VALUE_BLOCK_F32 16

/* out [num_heads][dim] += the weighed values, a block of rows at a time, each
 * query head 64 dims at a time; weights [num_heads][n] */
static void values_f32(float *out, const float *weights, const float *values,
                       const int64_t *rows, int64_t n, int64_t num_heads, int64_t group,
                       int64_t dim) {
    for (int64_t t = 0; t < n; t += VALUE_BLOCK_F32) {
        const int64_t m = n - t < VALUE_BLOCK_F32 ? n - t : VALUE_BLOCK_F32;
        for (int64_t h = 0; h < num_heads; h++)
            for (int64_t d = 0; d < dim; d += 64)
                values_f32_64(out + h * dim + d, weights + h * n + t, values, rows + t, m,
                              h / group * dim + d);
    }
}
#endif

/* Bytes of keys a chunk (of values as many): a chunk's scores, their softmax
 * and its weighed values are done before the next chunk's keys are read, so
 * that its values, asked for as its keys are read, are still in L2 (its keys and
 * values in half of a 1 MiB L2: 256 keys of the medium demo in bfloat16, 128 in
 * float32; 512 of them, as SDPA's CPU kernel splits the keys, were 5-10 % slower). */
#define CHUNK_BYTES (256 << 10)

struct shape {
    int64_t num_heads, num_kv_heads, head_dim, page_size;
    float scale;
    int bf16;
    int64_t chunk; /* keys a chunk: CHUNK_BYTES of them, a multiple of 16 */
};

/* The softmax of one chunk's scores [num_heads][n], in place, continuing the
 * running maximum and sum of each head (the first chunk starts them): each head's
 * output so far, out [num_heads][dim], is scaled by e^(old max - new max). */
static void softmax_chunk(float *scores, int64_t n, const struct shape *sh, int first,
                          float *maxes, float *sums, float *out) {
    const float scale = sh->scale;
    const int64_t dim = sh->head_dim;
    for (int64_t h = 0; h < sh->num_heads; h++) {
        float *s = scores + h * n;
        float max = s[0], sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t t = 1; t < n; t++) max = s[t] > max ? s[t] : max;
        if (!first && maxes[h] > max) max = maxes[h];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) {
            s[t] = exp_nonpositive((s[t] - max) * scale);
            sum += s[t];
        }
        if (sh->bf16) /* rounded as SDPA weighs values */
#pragma omp simd
            for (int64_t t = 0; t < n; t++)
                s[t] = bf16_to_float(float_to_bf16(s[t]));
        if (first) {
            sums[h] = sum;
        } else if (max > maxes[h]) {
            const float rescale = exp_nonpositive((maxes[h] - max) * scale);
            sums[h] = sums[h] * rescale + sum;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) out[h * dim + i] *= rescale;
        } else {
            sums[h] += sum;
        }
        maxes[h] = max;
    }
}

/* One chunk's scores [num_heads][n] in float32 (q [num_heads][head_dim]; row:
 * scratch for a token's row), for every dtype and head size */
static void scores_float(float *scores, const float *q, const void *keys, const void *values,
                         const int64_t *rows, int64_t n, int64_t ahead, const struct shape *sh,
                         float *row) {
    const int64_t group = sh->num_heads / sh->num_kv_heads, dim = sh->head_dim;
    const int64_t width = sh->num_kv_heads * dim, size = sh->bf16 ? 2 : 4;
    for (int64_t t = 0; t < n; t++) {
        if (t % 16 == 0) prefetch_block(keys, values, rows, t, n, ahead, size, width);
        const float *k = as_float(keys, rows[t], width, sh->bf16, row);
        for (int64_t h = 0; h < sh->num_heads; h++) /* head h reads KV head h / group */
            scores[h * n + t] = dot(q + h * dim, k + h / group * dim, dim);
    }
}

/* out [num_heads][head_dim] += one chunk's values weighed by its weights
 * [num_heads][n], in float32, for every dtype and head size */
static void values_float(float *out, const float *weights, const void *values,
                         const int64_t *rows, int64_t n, const struct shape *sh, float *row) {
    const int64_t group = sh->num_heads / sh->num_kv_heads, dim = sh->head_dim;
    const int64_t width = sh->num_kv_heads * dim;
    for (int64_t t = 0; t < n; t++) {
        const float *v = as_float(values, rows[t], width, sh->bf16, row);
        for (int64_t h = 0; h < sh->num_heads; h++)
            axpy(out + h * dim, weights[h * n + t], v + h / group * dim, dim);
    }
}

/* One part of a sequence, its tokens [first, end) (whole chunks but the last):
 * q and out [num_heads][head_dim] in float32 (q16: q as given, for the bfloat16
 * scores; NULL in float32); out gets the values weighed by e^((score - max) *
 * scale), not yet divided by the sum, and maxes and sums [num_heads] each head's
 * maximum and sum. scores [num_heads][sh->chunk], row [num_kv_heads * head_dim]
 * and rows [end - first] are the task's scratch. */
static void attend(float *out, float *maxes, float *sums, const float *q, const void *q16,
                   const void *keys, const void *values, const int64_t *pages, int64_t first,
                   int64_t end, const struct shape *sh, float *scores, float *row, int64_t *rows) {
    const int64_t dim = sh->head_dim, width = sh->num_kv_heads * dim; /* a token's row */
    const int64_t heads = sh->num_heads, len = end - first;
#if defined(__AVX2__) /* (AVX512-BF16 builds too) */
    const int64_t group = sh->num_heads / sh->num_kv_heads; /* query heads per KV head */
    const int f32 = !sh->bf16 && dim % 64 == 0; /* scores_f32 and values_f32 take it */
#endif
#if defined(__AVX512BF16__)
    /* the dot products of bf16 pairs take this shape (else the float32 loops) */
    const int pairs = sh->bf16 && dim % 32 == 0 && dim <= MAX_BF16_DIM;
#else
    (void)q16; /* read by the dot products of bf16 pairs only */
#endif
    /* each token's row, where its page puts it (a page at a time: no division a token) */
    const int64_t page = sh->page_size;
    for (int64_t t = first, p = first / page, i = first % page; t < end; p++, i = 0)
        for (; i < page && t < end; i++, t++)
            rows[t - first] = pages[p] * page * width + i * width;
    memset(out, 0, sizeof(float) * heads * dim);
    for (int64_t c = 0; c < len; c += sh->chunk) {
        const int64_t n = len - c < sh->chunk ? len - c : sh->chunk, *at = rows + c;
#if defined(__AVX2__)
        if (f32)
            scores_f32(scores, q, keys, at, n, heads, group, dim);
        else
#endif
#if defined(__AVX512BF16__)
        if (pairs)
            scores_bf16(scores, q16, keys, values, at, n, len - c, heads, group, dim, width);
        else
#endif
            scores_float(scores, q, keys, values, at, n, len - c, sh, row);
        softmax_chunk(scores, n, sh, c == 0, maxes, sums, out);
#if defined(__AVX2__)
        if (f32)
            values_f32(out, scores, values, at, n, heads, group, dim);
        else
#endif
#if defined(__AVX512BF16__)
        if (pairs)
            values_bf16(out, scores, values, at, n, len - c, heads, group, dim, width);
        else
#endif
            values_float(out, scores, values, at, n, sh, row);
    }
#if defined(__AVX512BF16__)
    if (pairs)
        for (int64_t h = 0; h < heads; h++) unpermute(out + h * dim, dim);
#endif
}

/* Sequence s's output: its `count` parts' (each [num_heads][head_dim] sums, then
 * num_heads maxima and num_heads sums, `partial` floats apart), each weighed by
 * e^((its max - the max of all) * scale), over their sums so weighed; a sequence
 * in one part has weights of 1 */
static void merge(void *out, int64_t s, const float *parts, int64_t count, const struct shape *sh) {
    const int64_t heads = sh->num_heads, dim = sh->head_dim, size = heads * dim;
    const int64_t partial = size + 2 * heads;
    for (int64_t h = 0; h < heads; h++) {
        float max = parts[size + h], sum = 0.0f, weights[count];
        for (int64_t p = 1; p < count; p++)
            if (parts[p * partial + size + h] > max) max = parts[p * partial + size + h];
        for (int64_t p = 0; p < count; p++) {
            const float *part = parts + p * partial;
            weights[p] = exp_nonpositive((part[size + h] - max) * sh->scale);
            sum += part[size + heads + h] * weights[p];
        }
        for (int64_t i = 0; i < dim; i++) {
            float value = 0.0f;
            for (int64_t p = 0; p < count; p++) value += parts[p * partial + h * dim + i] * weights[p];
            value /= sum;
            if (sh->bf16)
                ((uint16_t *)out)[s * size + h * dim + i] = float_to_bf16(value);
            else
                ((float *)out)[s * size + h * dim + i] = value;
        }
    }
}

/* Parts a sequence of `chunks` chunks is split in: one, unless there are fewer
 * sequences than threads (one long request alone), where each is split in whole
 * chunks so that every thread has a part, and the parts are merged after (as
 * flash-decoding splits the keys). Measured on a 2-core EPYC, the medium demo's
 * caches: one request alone at 1024-4096 tokens 1.4-1.7x faster (bfloat16),
 * 1.7-1.8x (float32); 2 to 16 sequences also split, in parts enough for four
 * tasks a thread, were 5-10 % slower (each part starts its prefetching cold). */
static int64_t parts_of(int64_t chunks, int64_t num_seqs, int num_threads) {
    if (num_seqs >= num_threads)
        return 1;
    const int64_t wanted = (num_threads + num_seqs - 1) / num_seqs;
    return wanted < chunks ? wanted : chunks > 1 ? chunks : 1; /* a part at least */
}

/* One task: part `part` of `count` of sequence s (its tokens in whole chunks),
 * into `partial` (the sums, maxima and sums merge() takes), or, where that is
 * NULL (a sequence in one part), into out. Returns 0, or -1 when it could not get
 * its scratch memory. */
static int attend_part(void *out, float *partial, const void *q, const void *keys,
                       const void *values, const int64_t *block_tables, int64_t max_pages,
                       int64_t s, int64_t len, int64_t part, int64_t count,
                       const struct shape *sh) {
    const int64_t heads = sh->num_heads, size = heads * sh->head_dim;
    const int64_t width = sh->num_kv_heads * sh->head_dim;
    const int64_t chunks = (len + sh->chunk - 1) / sh->chunk;
    const int64_t first = part * chunks / count * sh->chunk;
    const int64_t last = (part + 1) * chunks / count * sh->chunk, end = last < len ? last : len;
    const int64_t chunk = end - first < sh->chunk ? end - first : sh->chunk;
    /* where each token's row lies, the scores, a token's row, (bfloat16) the query
     * in float32, and (one part) the partial */
    int64_t *rows = malloc(sizeof(int64_t) * (end - first) +
                           sizeof(float) * (heads * chunk + width + size + (size + 2 * heads)));
    if (rows == NULL)
        return -1;
    float *scores = (float *)(rows + end - first), *row = scores + heads * chunk;
    const float *query = as_float(q, s * size, size, sh->bf16, row + width);
    float *sums = partial ? partial : row + width + size;
    attend(sums, sums + size, sums + size + heads, query,
           sh->bf16 ? (const uint16_t *)q + s * size : NULL, keys, values,
           block_tables + s * max_pages, first, end, sh, scores, row, rows);
    if (partial == NULL)
        merge(out, s, sums, 1, sh);
    free(rows);
    return 0;
}

/* q, out, keys and values are all float32 (bf16 = 0) or all bfloat16 (bf16 = 1).
 * Returns 0, or -1 when a task could not get its scratch memory. */
int paged_decode_attention(void *out, const void *q, const void *keys, const void *values,
                           const int64_t *block_tables, const int64_t *seq_lens,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t page_size, int64_t max_pages, float scale,
                           int bf16, int num_threads) {
    const int64_t row_bytes = num_kv_heads * head_dim * (bf16 ? 2 : 4);
    const int64_t per_chunk = CHUNK_BYTES / row_bytes / 16 * 16;
    const struct shape sh = {num_heads, num_kv_heads, head_dim, page_size, scale, bf16,
                             per_chunk > 16 ? per_chunk : 16};
    /* each sequence's first task (its parts follow) */
    int64_t firsts[num_seqs + 1], tasks = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        firsts[s] = tasks;
        tasks += parts_of((seq_lens[s] + sh.chunk - 1) / sh.chunk, num_seqs, num_threads);
    }
    firsts[num_seqs] = tasks;
    int failed = 0;
    if (tasks == num_seqs) { /* a task a sequence */
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : failed)
        for (int64_t s = 0; s < num_seqs; s++)
            failed |= attend_part(out, NULL, q, keys, values, block_tables, max_pages, s,
                                  seq_lens[s], 0, 1, &sh);
        return failed ? -1 : 0;
    }
    /* each task's sequence, and each task's partial */
    const int64_t partial = num_heads * head_dim + 2 * num_heads;
    int64_t owners[tasks];
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = firsts[s]; t < firsts[s + 1]; t++) owners[t] = s;
    float *parts = malloc(sizeof(float) * tasks * partial);
    if (parts == NULL)
        return -1;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t s = owners[t];
            failed |= attend_part(out, parts + t * partial, q, keys, values, block_tables,
                                  max_pages, s, seq_lens[s], t - firsts[s],
                                  firsts[s + 1] - firsts[s], &sh);
        }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < num_seqs; s++)
            merge(out, s, parts + firsts[s] * partial, firsts[s + 1] - firsts[s], &sh);
    }
    free(parts);
    return failed ? -1 : 0;
}

/* Appends a step's keys and values to the layer's cache: row t of k and of v
 * (`width` elements of `size` bytes; rows k_stride and v_stride elements apart,
 * as a split of the fused QKV projection leaves them) to row slots[t] of keys
 * and values, seen as [num_rows][width]. torch's index_copy_ needs contiguous
 * sources (a copy of each) and costs ~60 us a layer on a decode step of 16 rows
 * with a cold cache; this is a memcpy a row. Returns 0, or -1 (nothing written)
 * when a slot is outside the cache. */
int write_kv(void *keys, void *values, const void *k, const void *v, const int64_t *slots,
             int64_t tokens, int64_t num_rows, int64_t width, int64_t k_stride,
             int64_t v_stride, int64_t size) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_rows) return -1;
    const int64_t bytes = width * size;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy((char *)keys + slots[t] * bytes, (const char *)k + t * k_stride * size, bytes);
        memcpy((char *)values + slots[t] * bytes, (const char *)v + t * v_stride * size, bytes);
    }
    return 0;
}

/* Prefill attention over the paged KV cache in bfloat16, on Intel AMX
 * (prefill_attention_amx) or, without it, with AVX512-BF16's dot products of
 * pairs (prefill_attention_avx512bf16): a prompt's n new tokens, the last of its
 * len tokens (the first len - n are its cached prefix, already in the pages),
 * each attending causally to the keys up to its own position.
 *
 *   q, out        [n][num_heads][head_dim]  (q's token rows q_stride apart)
 *   keys, values  the layer's cache, as above; pages: the prompt's pages in order
 *
 * First each KV head's keys and values are copied out of the pages into the
 * tiles AMX multiplies (keys transposed: a tile's row r holds dimensions 2r and
 * 2r + 1 of 16 keys; values: row r holds keys 2r and 2r + 1 of 16 dimensions).
 * Then each task, one query head and 16 query tokens, computes its scores S = q
 * k^T, the softmax of each row in float32 (its keys up to the token's position),
 * rounds the exponentials to bfloat16 (as SDPA's CPU kernel rounds them before
 * they weigh the values) and sums P v, 64 output dimensions at a time, dividing
 * by each row's sum at the end. On AMX the products are tiles (16 keys a tile,
 * summed over head_dim in 32-wide tiles; at head_dim 64 the queries stay in two
 * tiles and two key blocks go at once). Without AMX the same tiles are read a
 * row at a time: a key tile's row is one pair of dimensions of 16 keys, a value
 * tile's one pair of keys of 16 dimensions, which is what one vdpbf16ps
 * multiplies by a broadcast pair of a query (of the weights); 6 query rows by 64
 * keys (dimensions) at a time, their sums in 24 of the 32 vector registers, as
 * linear_bf16.c's linear_avx512bf16. Sums in another order than SDPA's: within
 * bfloat16 rounding of them. head_dim must be a multiple of 64 (on AMX; 16
 * without). The same code serves a vision tower's attention (window_attention_*):
 * each window's tokens attend to one another, unmasked, their keys and values
 * read from the QKV projection's rows instead of the pages.
 * Returns 0, -1 when out of memory, -2 where the build lacks the kernel's
 * instructions (amx_init() says 0 there, has_avx512bf16() likewise, and the
 * engine never calls it). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PREFILL_AMX 1
#endif

#if defined(__AVX512BF16__)

#define DOT_ROWS 6 /* query rows the AVX512-BF16 kernel sums at once */

int has_avx512bf16(void) { return 1; }

/* KV head h's keys [dim block][16-key block] and values [32-key block][16-dim
 * block] as tiles (a tile's elements as 16 x 16 pairs, one 32-bit word each);
 * zeros past len */
static int pack_head(uint32_t *kt, uint32_t *vt, const uint16_t *keys, const uint16_t *values,
                      const int64_t *pages, int64_t len, int64_t padded, int64_t h,
                      int64_t kv_stride, int64_t head_dim, int64_t page_size) {
    const int64_t key_blocks = padded / 16, pairs = head_dim / 2;
    uint16_t *k16 = malloc(sizeof(uint16_t) * 2 * 16 * head_dim); /* 16 tokens' keys, values */
    if (k16 == NULL) return -1;
    uint16_t *v16 = k16 + 16 * head_dim;
    const uint32_t *k32 = (const uint32_t *)k16;
    for (int64_t t0 = 0; t0 < padded; t0 += 16) {
        for (int c = 0; c < 16; c++) { /* copied side by side: the transposes below vectorize */
            const int64_t t = t0 + c;
            const int64_t row = pages == NULL ? t : pages[t / page_size] * page_size + t % page_size;
            const int64_t at = row * kv_stride + h * head_dim;
            if (t < len) {
                memcpy(k16 + c * head_dim, keys + at, sizeof(uint16_t) * head_dim);
                memcpy(v16 + c * head_dim, values + at, sizeof(uint16_t) * head_dim);
            } else {
                memset(k16 + c * head_dim, 0, sizeof(uint16_t) * head_dim);
                memset(v16 + c * head_dim, 0, sizeof(uint16_t) * head_dim);
            }
        }
        /* keys: tile (pair / 16, t0 / 16), row pair % 16, column c: pair of token c */
        for (int64_t p = 0; p < pairs; p++) {
            uint32_t *dst = kt + ((p / 16) * key_blocks + t0 / 16) * 256 + (p % 16) * 16;
            for (int c = 0; c < 16; c++) dst[c] = k32[c * pairs + p];
        }
        /* values: tile (t / 32, d / 16), row (t % 32) / 2, column d % 16: tokens t, t + 1 */
        for (int c = 0; c < 16; c += 2) {
            const int64_t t = t0 + c;
            uint32_t *dst = vt + (t / 32) * (head_dim / 16) * 256 + (t % 32) / 2 * 16;
            const uint16_t *even = v16 + c * head_dim, *odd = even + head_dim;
            for (int64_t d0 = 0; d0 < head_dim; d0 += 16)
                for (int d = 0; d < 16; d++)
                    dst[(d0 / 16) * 256 + d] = (uint32_t)even[d0 + d] | (uint32_t)odd[d0 + d] << 16;
        }
    }
    free(k16);
    return 0;
}

/* Each of `rows` rows of scores into its softmax's exponentials, rounded to
 * bfloat16 in `weights` (zeros past its keys, up to a whole 32-key block), and 1 /
 * their sum in sums[r]. Row r sees `first` + r + 1 keys (causal), or all `len`
 * where first < 0. */
static void softmax_rows(float *scores, uint16_t *weights, float *sums, int rows, int64_t first,
                         int64_t len, int64_t padded, int64_t blocks32, float scale) {
    for (int r = 0; r < rows; r++) {
        float *s = scores + r * padded;
        uint16_t *w = weights + r * padded;
        const int64_t keys = first < 0 ? len : first + r + 1;
        __m512 most = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < keys; j += 16) {
            const __mmask16 valid = keys - j >= 16 ? 0xffff : (__mmask16)((1u << (keys - j)) - 1);
            most = _mm512_mask_max_ps(most, valid, most, _mm512_maskz_loadu_ps(valid, s + j));
        }
        const float max = _mm512_reduce_max_ps(most) * scale;
        float sum = 0.0f;
#pragma omp simd simdlen(16) reduction(+ : sum)
        for (int64_t j = 0; j < keys; j++) {
            const float e = exp_nonpositive(s[j] * scale - max);
            sum += e;
            s[j] = e;
        }
        for (int64_t j = keys; j < blocks32 * 32; j++) s[j] = 0.0f;
        for (int64_t j = 0; j < blocks32 * 32; j += 16)
            _mm256_storeu_si256((__m256i *)(w + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j)));
        sums[r] = 1.0f / sum;
    }
}

/* 16 output dimensions of a row, each times `inverse` (1 / the row's sum), as bfloat16 */
static inline void store_out(uint16_t *dst, __m512 sum, float inverse) {
    _mm256_storeu_si256((__m256i *)dst,
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sum, _mm512_set1_ps(inverse))));
}

#if defined(PREFILL_AMX)
/* query head h, its tokens [i0, i0 + rows), on AMX (this thread's tiles configured for rows) */
static void attend_rows_amx(uint16_t *out, const uint16_t *q, const uint32_t *kt,
                            const uint32_t *vt, int64_t i0, int rows, int64_t h, int64_t n,
                            int64_t len, int causal, int64_t padded, int64_t num_heads,
                            int64_t head_dim, int64_t q_stride, float scale, float *scores,
                            uint16_t *weights, float *sums) {
    const int64_t first = len - n;                         /* the position of new token 0 */
    const int64_t seen = causal ? first + i0 + rows : len; /* keys the last row sees */
    const int64_t key_blocks = padded / 16, dim_blocks = head_dim / 32;
    const int64_t blocks16 = (seen + 15) / 16, blocks32 = (seen + 31) / 32;
    const uint16_t *qh = q + i0 * q_stride + h * head_dim;
    if (dim_blocks == 2) {
        /* the queries stay in tiles 4 and 1 (shaped as 4 is); two blocks of keys at
         * a time, in tiles 0 and 2, so that one's products wait on the other's */
        _tile_loadd(4, qh, q_stride * 2);
        _tile_loadd(1, qh + 32, q_stride * 2);
        const uint32_t *low = kt, *high = kt + key_blocks * 256; /* dimensions 0-31, 32-63 */
        int64_t b = 0;
        for (; b + 2 <= blocks16; b += 2) {
            _tile_zero(0);
            _tile_zero(2);
            _tile_loadd(5, low + b * 256, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, low + (b + 1) * 256, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, high + b * 256, 64);
            _tile_dpbf16ps(0, 1, 7);
            _tile_loadd(5, high + (b + 1) * 256, 64);
            _tile_dpbf16ps(2, 1, 5);
            _tile_stored(0, scores + b * 16, padded * 4);
            _tile_stored(2, scores + (b + 1) * 16, padded * 4);
        }
        if (b < blocks16) {
            _tile_zero(0);
            _tile_loadd(5, low + b * 256, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(7, high + b * 256, 64);
            _tile_dpbf16ps(0, 1, 7);
            _tile_stored(0, scores + b * 16, padded * 4);
        }
    } else {
        for (int64_t b = 0; b < blocks16; b++) {
            _tile_zero(0);
            for (int64_t d = 0; d < dim_blocks; d++) {
                _tile_loadd(4, qh + d * 32, q_stride * 2);
                _tile_loadd(5, kt + (d * key_blocks + b) * 256, 64);
                _tile_dpbf16ps(0, 4, 5);
            }
            _tile_stored(0, scores + b * 16, padded * 4);
        }
    }
    softmax_rows(scores, weights, sums, rows, causal ? first + i0 : -1, len, padded, blocks32,
                 scale);
    const int64_t out_stride = num_heads * head_dim;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < blocks32; b++) {
            const uint32_t *v = vt + (b * (head_dim / 16) + d0 / 16) * 256;
            _tile_loadd(4, weights + b * 32, padded * 2);
            _tile_loadd(5, v, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, v + 256, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, v + 2 * 256, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, v + 3 * 256, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        float o[16][64];
        _tile_stored(0, &o[0][0], 256);
        _tile_stored(1, &o[0][16], 256);
        _tile_stored(2, &o[0][32], 256);
        _tile_stored(3, &o[0][48], 256);
        for (int r = 0; r < rows; r++) {
            uint16_t *dst = out + (i0 + r) * out_stride + h * head_dim + d0;
            for (int c = 0; c < 64; c += 16) store_out(dst + c, _mm512_loadu_ps(&o[r][c]), sums[r]);
        }
    }
}
#endif /* PREFILL_AMX */

/* The pair of bfloat16 values at x, as one 32-bit word broadcast to 16 lanes */
static inline __m512bh broadcast_pair(const uint16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* Scores of R query rows (row r at q + r * q_stride) against 64 keys a time,
 * blocks [0, blocks16) rounded up to 4 (the packing's blocks come in fours): row
 * r's into scores + r * padded. Always inlined with R known, so that the sums
 * stay in registers. */
static inline __attribute__((always_inline)) void
scores_dp(float *scores, const uint16_t *q, int64_t q_stride, const uint32_t *kt, const int R,
          int64_t blocks16, int64_t key_blocks, int64_t pairs, int64_t padded) {
    for (int64_t b = 0; b < blocks16; b += 4) {
        __m512 sums[DOT_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) sums[r][j] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const uint32_t *k = kt + ((p / 16) * key_blocks + b) * 256 + (p % 16) * 16;
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(k + 256);
            const __m512bh k2 = (__m512bh)_mm512_loadu_si512(k + 2 * 256);
            const __m512bh k3 = (__m512bh)_mm512_loadu_si512(k + 3 * 256);
            for (int r = 0; r < R; r++) {
                const __m512bh x = broadcast_pair(q + r * q_stride + 2 * p);
                sums[r][0] = _mm512_dpbf16_ps(sums[r][0], x, k0);
                sums[r][1] = _mm512_dpbf16_ps(sums[r][1], x, k1);
                sums[r][2] = _mm512_dpbf16_ps(sums[r][2], x, k2);
                sums[r][3] = _mm512_dpbf16_ps(sums[r][3], x, k3);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(scores + r * padded + (b + j) * 16, sums[r][j]);
    }
}

/* P v of R rows (row r's weights at w + r * padded) for D blocks of 16 output
 * dimensions from d0, divided by each row's sum and rounded: into out's rows,
 * out_stride apart. Always inlined with R and D known, as scores_dp. */
static inline __attribute__((always_inline)) void
values_dp(uint16_t *out, int64_t out_stride, const uint16_t *w, int64_t padded,
          const uint32_t *vt, const float *inverse, const int R, const int D, int64_t blocks32,
          int64_t d0, int64_t head_dim) {
    __m512 sums[DOT_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < D; j++) sums[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < blocks32 * 16; p++) { /* keys 2p and 2p + 1 */
        const uint32_t *v = vt + ((p / 16) * (head_dim / 16) + d0 / 16) * 256 + (p % 16) * 16;
        __m512bh vs[4];
        for (int j = 0; j < D; j++) vs[j] = (__m512bh)_mm512_loadu_si512(v + j * 256);
        for (int r = 0; r < R; r++) {
            const __m512bh x = broadcast_pair(w + r * padded + 2 * p);
            for (int j = 0; j < D; j++) sums[r][j] = _mm512_dpbf16_ps(sums[r][j], x, vs[j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < D; j++) store_out(out + r * out_stride + 16 * j, sums[r][j], inverse[r]);
}

/* values_dp for R rows over all of head_dim: 64 dimensions a time, then 16 */
#define VALUES_DP(R)                                                                           \
    do {                                                                                       \
        int64_t d0 = 0;                                                                        \
        for (; d0 + 64 <= head_dim; d0 += 64)                                                  \
            values_dp(o + d0, out_stride, w, padded, vt, inv, R, 4, blocks32, d0, head_dim);   \
        for (; d0 < head_dim; d0 += 16)                                                        \
            values_dp(o + d0, out_stride, w, padded, vt, inv, R, 1, blocks32, d0, head_dim);   \
    } while (0)

/* attend_rows_amx's work without AMX, DOT_ROWS rows at a time (head_dim a
 * multiple of 16) */
static void attend_rows_dp(uint16_t *out, const uint16_t *q, const uint32_t *kt,
                           const uint32_t *vt, int64_t i0, int rows, int64_t h, int64_t n,
                           int64_t len, int causal, int64_t padded, int64_t num_heads,
                           int64_t head_dim, int64_t q_stride, float scale, float *scores,
                           uint16_t *weights, float *sums) {
    const int64_t first = len - n, seen = causal ? first + i0 + rows : len;
    const int64_t blocks16 = (seen + 15) / 16, blocks32 = (seen + 31) / 32;
    const int64_t key_blocks = padded / 16, pairs = head_dim / 2;
    const uint16_t *qh = q + i0 * q_stride + h * head_dim;
    for (int r = 0; r < rows; r += DOT_ROWS) {
        const uint16_t *qr = qh + r * q_stride;
        float *s = scores + r * padded;
        switch (rows - r < DOT_ROWS ? rows - r : DOT_ROWS) {
        case 1: scores_dp(s, qr, q_stride, kt, 1, blocks16, key_blocks, pairs, padded); break;
        case 2: scores_dp(s, qr, q_stride, kt, 2, blocks16, key_blocks, pairs, padded); break;
        case 3: scores_dp(s, qr, q_stride, kt, 3, blocks16, key_blocks, pairs, padded); break;
        case 4: scores_dp(s, qr, q_stride, kt, 4, blocks16, key_blocks, pairs, padded); break;
        case 5: scores_dp(s, qr, q_stride, kt, 5, blocks16, key_blocks, pairs, padded); break;
        default: scores_dp(s, qr, q_stride, kt, 6, blocks16, key_blocks, pairs, padded); break;
        }
    }
    softmax_rows(scores, weights, sums, rows, causal ? first + i0 : -1, len, padded, blocks32,
                 scale);
    const int64_t out_stride = num_heads * head_dim;
    for (int r = 0; r < rows; r += DOT_ROWS) {
        uint16_t *o = out + (i0 + r) * out_stride + h * head_dim;
        const uint16_t *w = weights + r * padded;
        const float *inv = sums + r;
        switch (rows - r < DOT_ROWS ? rows - r : DOT_ROWS) {
        case 1: VALUES_DP(1); break;
        case 2: VALUES_DP(2); break;
        case 3: VALUES_DP(3); break;
        case 4: VALUES_DP(4); break;
        case 5: VALUES_DP(5); break;
        default: VALUES_DP(6); break;
        }
    }
}

/* Both kernels over `windows` sequences of queries: window w's are tokens
 * [starts[w], starts[w + 1]) of q (rows q_stride apart) and out ([token][num_heads]
 * [head_dim]). With pages there is one window, whose keys are the prompt's len in
 * the pages (its queries the last of them, causally); without, each window's keys
 * are its own tokens' rows of keys and values (kv_stride apart), all seen by each
 * query (a vision tower's windows). The heads packed, then (window, query head, 16
 * tokens) tasks; amx picks attend_rows_amx (a build with AMX only, head_dim a
 * multiple of 64) over attend_rows_dp. */
static int attention_bf16(uint16_t *out, const uint16_t *q, const uint16_t *keys,
                          const uint16_t *values, const int64_t *pages, int64_t page_size,
                          int64_t len, const int64_t *starts, int64_t windows, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t q_stride,
                          int64_t kv_stride, float scale, int num_threads, int amx) {
    const int64_t group = num_heads / num_kv_heads, pair_blocks = (head_dim / 2 + 15) / 16;
    /* per window: its first task, and where its packed heads start (words) */
    int64_t *tasks = malloc(sizeof(int64_t) * 2 * (windows + 1));
    if (tasks == NULL) return -1;
    int64_t *offsets = tasks + windows + 1, most = 0;
    tasks[0] = offsets[0] = 0;
    for (int64_t w = 0; w < windows; w++) {
        const int64_t n = starts[w + 1] - starts[w];
        const int64_t keys_w = pages != NULL ? len : n;
        const int64_t padded = (keys_w + 63) / 64 * 64; /* scores_dp takes keys 64 at a time */
        most = padded > most ? padded : most;
        tasks[w + 1] = tasks[w] + num_heads * ((n + 15) / 16);
        offsets[w + 1] = offsets[w] + num_kv_heads * padded * (pair_blocks * 16 + head_dim / 2);
    }
    uint32_t *packed = malloc(sizeof(uint32_t) * (offsets[windows] > 0 ? offsets[windows] : 1));
    if (packed == NULL) {
        free(tasks);
        return -1;
    }
    int failed = 0;
    (void)amx; /* a build without AMX has the one kernel */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* window w's KV head h: keys at offsets[w] + h * head_words, values after them */
#pragma omp for schedule(static)
        for (int64_t wh = 0; wh < windows * num_kv_heads; wh++) {
            const int64_t w = wh / num_kv_heads, h = wh % num_kv_heads;
            const int64_t n = starts[w + 1] - starts[w], keys_w = pages != NULL ? len : n;
            const int64_t padded = (keys_w + 63) / 64 * 64;
            const int64_t key_words = pair_blocks * 16 * padded;
            uint32_t *kt = packed + offsets[w] + h * (key_words + padded * head_dim / 2);
            const int64_t at = pages != NULL ? 0 : starts[w] * kv_stride;
            if (pack_head(kt, kt + key_words, keys + at, values + at, pages, keys_w, padded, h,
                          kv_stride, head_dim, page_size))
                failed = 1;
        }
        float *scores = malloc(sizeof(float) * (16 * most + 16));
        uint16_t *weights = malloc(sizeof(uint16_t) * 16 * most);
        if (scores == NULL || weights == NULL) failed = 1;
#if defined(PREFILL_AMX)
        int configured = 0;
#endif
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks[windows]; task++) {
            if (failed) continue;
            int64_t w = 0, last = windows; /* the window whose tasks hold this one */
            while (last - w > 1) {
                const int64_t mid = (w + last) / 2;
                if (tasks[mid] <= task) w = mid;
                else last = mid;
            }
            const int64_t n = starts[w + 1] - starts[w], keys_w = pages != NULL ? len : n;
            const int64_t padded = (keys_w + 63) / 64 * 64, blocks = (n + 15) / 16;
            const int64_t h = (task - tasks[w]) / blocks, i0 = (task - tasks[w]) % blocks * 16;
            const int rows = n - i0 < 16 ? (int)(n - i0) : 16;
            const int64_t key_words = pair_blocks * 16 * padded;
            const uint32_t *k = packed + offsets[w] + h / group * (key_words + padded * head_dim / 2);
            const uint32_t *v = k + key_words;
            uint16_t *o = out + starts[w] * num_heads * head_dim;
            const uint16_t *qw = q + starts[w] * q_stride;
            const int causal = pages != NULL;
#if defined(PREFILL_AMX)
            if (amx) {
                if (rows != configured) {
                    amx_configure(rows);
                    configured = rows;
                }
                attend_rows_amx(o, qw, k, v, i0, rows, h, n, keys_w, causal, padded, num_heads,
                                head_dim, q_stride, scale, scores, weights, scores + 16 * padded);
                continue;
            }
#endif
            attend_rows_dp(o, qw, k, v, i0, rows, h, n, keys_w, causal, padded, num_heads,
                           head_dim, q_stride, scale, scores, weights, scores + 16 * padded);
        }
#if defined(PREFILL_AMX)
        if (configured) _tile_release();
#endif
        free(scores);
        free(weights);
    }
    free(packed);
    free(tasks);
    return failed ? -1 : 0;
}

/* A prompt's prefill (one window: its n new tokens of len, causally, keys in the pages) */
static int prefill_attention(uint16_t *out, const uint16_t *q, const uint16_t *keys,
                             const uint16_t *values, const int64_t *pages, int64_t n, int64_t len,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t page_size, int64_t q_stride, float scale, int num_threads,
                             int amx) {
    const int64_t starts[2] = {0, n};
    return attention_bf16(out, q, keys, values, pages, page_size, len, starts, 1, num_heads,
                          num_kv_heads, head_dim, q_stride, num_kv_heads * head_dim, scale,
                          num_threads, amx);
}

int prefill_attention_avx512bf16(uint16_t *out, const uint16_t *q, const uint16_t *keys,
                                 const uint16_t *values, const int64_t *pages, int64_t n,
                                 int64_t len, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t page_size, int64_t q_stride,
                                 float scale, int num_threads) {
    return prefill_attention(out, q, keys, values, pages, n, len, num_heads, num_kv_heads,
                             head_dim, page_size, q_stride, scale, num_threads, 0);
}

/* A vision tower's attention: each window's tokens [starts[w], starts[w + 1]) attend
 * to one another (no mask); q, k and v rows `stride` apart (the fused QKV
 * projection's), `heads` each; out [tokens][heads][head_dim]. */
int window_attention_avx512bf16(uint16_t *out, const uint16_t *q, const uint16_t *k,
                                const uint16_t *v, const int64_t *starts, int64_t windows,
                                int64_t heads, int64_t head_dim, int64_t stride, float scale,
                                int num_threads) {
    return attention_bf16(out, q, k, v, NULL, 0, 0, starts, windows, heads, heads, head_dim,
                          stride, stride, scale, num_threads, 0);
}

#else

int has_avx512bf16(void) { return 0; }

int prefill_attention_avx512bf16(uint16_t *out, const uint16_t *q, const uint16_t *keys,
                                 const uint16_t *values, const int64_t *pages, int64_t n,
                                 int64_t len, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t page_size, int64_t q_stride,
                                 float scale, int num_threads) {
    (void)out, (void)q, (void)keys, (void)values, (void)pages, (void)n, (void)len;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)page_size, (void)q_stride;
    (void)scale, (void)num_threads;
    return -2;
}

int window_attention_avx512bf16(uint16_t *out, const uint16_t *q, const uint16_t *k,
                                const uint16_t *v, const int64_t *starts, int64_t windows,
                                int64_t heads, int64_t head_dim, int64_t stride, float scale,
                                int num_threads) {
    (void)out, (void)q, (void)k, (void)v, (void)starts, (void)windows, (void)heads;
    (void)head_dim, (void)stride, (void)scale, (void)num_threads;
    return -2;
}

#endif /* AVX512-BF16 */

#if defined(PREFILL_AMX)

int prefill_attention_amx(uint16_t *out, const uint16_t *q, const uint16_t *keys,
                          const uint16_t *values, const int64_t *pages, int64_t n, int64_t len,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t page_size, int64_t q_stride, float scale, int num_threads) {
    return prefill_attention(out, q, keys, values, pages, n, len, num_heads, num_kv_heads,
                             head_dim, page_size, q_stride, scale, num_threads, 1);
}

int window_attention_amx(uint16_t *out, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                         const int64_t *starts, int64_t windows, int64_t heads, int64_t head_dim,
                         int64_t stride, float scale, int num_threads) {
    return attention_bf16(out, q, k, v, NULL, 0, 0, starts, windows, heads, heads, head_dim,
                          stride, stride, scale, num_threads, 1);
}

#else

int prefill_attention_amx(uint16_t *out, const uint16_t *q, const uint16_t *keys,
                          const uint16_t *values, const int64_t *pages, int64_t n, int64_t len,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t page_size, int64_t q_stride, float scale, int num_threads) {
    (void)out, (void)q, (void)keys, (void)values, (void)pages, (void)n, (void)len;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)page_size, (void)q_stride;
    (void)scale, (void)num_threads;
    return -2;
}

int window_attention_amx(uint16_t *out, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                         const int64_t *starts, int64_t windows, int64_t heads, int64_t head_dim,
                         int64_t stride, float scale, int num_threads) {
    (void)out, (void)q, (void)k, (void)v, (void)starts, (void)windows, (void)heads;
    (void)head_dim, (void)stride, (void)scale, (void)num_threads;
    return -2;
}

#endif
