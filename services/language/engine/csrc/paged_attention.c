/* Decode attention over the paged KV cache, on the CPU, in float32.
 *
 * One query token per sequence attends to all its keys where they lie, page by
 * page: no copy of the context (gathering the pages for SDPA reads, writes and
 * rereads the whole context, every layer of every step).
 *
 *   q, out        [num_seqs][num_heads][head_dim]
 *   cache         [pages][2][page_size][num_kv_heads][head_dim]  (0 keys, 1 values)
 *   block_tables  [num_seqs][max_pages]  each sequence's pages, in order
 *   seq_lens      [num_seqs]             its keys, the new token's included
 *
 * One task per sequence. It walks the sequence's pages twice, each time reading
 * a page's keys (then values) front to back, every head at once: a whole token
 * row is one contiguous run, which the hardware prefetches well (one task per
 * KV head read a quarter of each row and was ~1.5x slower on a cold cache).
 * Softmax in two passes, as SDPA does: the scores, then their maximum,
 * exponentials and sum, then the weighted values. Tasks run on OpenMP threads;
 * built against torch's own libgomp, they share its thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* One sequence: scores [num_heads][len] is the task's scratch. */
static void attend(float *out, const float *q, const float *cache, const int64_t *pages,
                   int64_t len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t page_size, float scale, float *scores) {
    const int64_t group = num_heads / num_kv_heads; /* query heads per KV head */
    const int64_t row = num_kv_heads * head_dim;    /* one token's keys (or values) */
    const int64_t page_stride = 2 * page_size * row;

    for (int64_t t = 0, p = 0; t < len; p++) {
        const float *k = cache + pages[p] * page_stride;
        for (int64_t end = t + page_size < len ? t + page_size : len; t < end; t++, k += row)
            for (int64_t h = 0; h < num_heads; h++) /* head h reads KV head h / group */
                scores[h * len + t] = dot(q + h * head_dim, k + h / group * head_dim, head_dim);
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * len;
        float max = s[0], sum = 0.0f;
        for (int64_t t = 1; t < len; t++) max = s[t] > max ? s[t] : max;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf((s[t] - max) * scale);
            sum += s[t];
        }
        for (int64_t t = 0; t < len; t++) s[t] /= sum;
    }
    for (int64_t i = 0; i < num_heads * head_dim; i++) out[i] = 0.0f;
    for (int64_t t = 0, p = 0; t < len; p++) {
        const float *v = cache + pages[p] * page_stride + page_size * row;
        for (int64_t end = t + page_size < len ? t + page_size : len; t < end; t++, v += row)
            for (int64_t h = 0; h < num_heads; h++)
                axpy(out + h * head_dim, scores[h * len + t], v + h / group * head_dim, head_dim);
    }
}

/* Returns 0, or -1 when a task could not get its scratch memory. */
int paged_decode_attention(float *out, const float *q, const float *cache,
                           const int64_t *block_tables, const int64_t *seq_lens,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t page_size, int64_t max_pages, float scale,
                           int num_threads) {
    const int64_t size = num_heads * head_dim;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : failed)
    for (int64_t s = 0; s < num_seqs; s++) {
        float *scores = malloc(sizeof(float) * num_heads * seq_lens[s]);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend(out + s * size, q + s * size, cache, block_tables + s * max_pages, seq_lens[s],
               num_heads, num_kv_heads, head_dim, page_size, scale, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
