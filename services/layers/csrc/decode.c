/* A decode step's decoder layers in one call: bfloat16 on AMX or AVX512-BF16,
 * float32 on AVX2.
 *
 * A decode step of the small demo runs ~600 torch operators and ~80 kernel calls
 * through ctypes, one to a few microseconds of Python and dispatch each: ~30 % of
 * the step (py-spy, docs/performance.md). This file calls the same kernels
 * (linear_bf16.c's projections in bfloat16, linear.c's in float32;
 * paged_attention.c's attention and KV writer; fused_ops.c's norms, rotary
 * embedding and SiLU-and-product), given as function pointers, declared in
 * kernels.h (each keeps its own build flags), layer after layer: the bit-exact
 * results of the Python path, in one call.
 *
 * Per layer, on rows of `hidden` (one per sequence):
 *   residual, h = x (+ residual), RMSNorm   (the first layer: no residual yet)
 *   qkv = h Wqkv^T + b; rotary on q and k in place; k, v into the cache
 *   a = attention(q, the cache); residual, h = residual + a Wo^T, RMSNorm
 *   x = (SiLU(gate) * up) Wdown^T       for [gate | up] = h Wgu^T
 * and at the end: the model's final norm of residual + x.
 */
#include "kernels.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct kernels {
    __typeof__(&linear_amx) linear; /* bfloat16: or linear_avx512bf16, the same type */
    __typeof__(&linear_rows) linear_f32;
    __typeof__(&paged_decode_attention) attention;
    __typeof__(&write_kv) write_kv;
    __typeof__(&rms_norm) rms_norm;
    __typeof__(&add_rms_norm) add_rms_norm;
    __typeof__(&rotary) rotary;
    __typeof__(&silu_mul) silu_mul;
    __typeof__(&silu_mul_f32) silu_mul_f32;
    const float *silu; /* [65536]: torch's SiLU of each bfloat16, by its bits */
};

struct model {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, page_size, cache_rows;
    int64_t bf16; /* 1: bfloat16 weights, cache and activations; 0: float32 */
    float eps, scale;
    const void *final_norm;
};

/* one decoder layer's weights (the projections as their kernel takes them:
 * linear_bf16.c's tiles, float32 rows as loaded; their biases or NULL) and cache */
struct layer {
    const void *input_norm, *post_norm, *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;
    void *keys, *values;
};

struct step {
    int64_t rows, max_pages;
    const int64_t *block_tables; /* [rows][max_pages] */
    const int64_t *seq_lens;     /* [rows]: keys after this step's */
    const int64_t *slots;        /* [rows]: the cache row of each new key */
    const void *cos, *sin;       /* [rows][head_dim], in the model's dtype */
};

static void swap(char **a, char **b) {
    char *t = *a;
    *a = *b;
    *b = t;
}

/* y [rows][n] = x [rows][k] (rows x_stride elements apart) w^T + bias, in the model's dtype */
static void linear(const struct kernels *k, const struct model *m, void *y, const void *x,
                   const void *w, const void *bias, int64_t rows, int64_t in, int64_t n,
                   int64_t x_stride, int num_threads) {
    if (m->bf16)
        k->linear(y, x, w, bias, rows, in, n, x_stride, num_threads);
    else
        k->linear_f32(y, x, w, bias, rows, in, n, x_stride, num_threads);
}

/* x [rows][hidden]: the step's input embeddings in, the final norm's output out.
 * Returns 0; -1 where memory ran out, -2 for a KV slot outside the cache (where
 * the Python path raises). */
int decode_layers(const struct kernels *k, const struct model *m, const struct layer *layers,
                  const struct step *s, void *x, int num_threads) {
    const int64_t rows = s->rows, hidden = m->hidden, dim = m->head_dim, bf16 = m->bf16;
    const int64_t q_width = m->heads * dim, kv_width = m->kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width, inter = m->intermediate;
    const size_t size = bf16 ? 2 : 4; /* bytes an element */
    char *buffer = malloc(size * rows * (3 * hidden + qkv_width + 2 * q_width + 3 * inter));
    if (buffer == NULL) return -1;
    char *residual = buffer, *h = residual + size * rows * hidden;
    char *sum = h + size * rows * hidden, *qkv = sum + size * rows * hidden;
    char *q = qkv + size * rows * qkv_width, *attn = q + size * rows * q_width;
    char *gate_up = attn + size * rows * q_width, *act = gate_up + size * rows * 2 * inter;
    char *keys_of_qkv = qkv + size * q_width, *values_of_qkv = keys_of_qkv + size * kv_width;
    int failed = 0;
    for (int64_t i = 0; i < m->layers; i++) {
        const struct layer *l = &layers[i];
        if (i == 0) {
            memcpy(residual, x, size * rows * hidden);
            k->rms_norm(h, x, l->input_norm, rows, hidden, hidden, m->eps, bf16, num_threads);
        } else {
            k->add_rms_norm(sum, h, residual, x, l->input_norm, rows, hidden, m->eps, bf16,
                            num_threads);
            swap(&residual, &sum);
        }
        linear(k, m, qkv, h, l->qkv, l->qkv_bias, rows, hidden, qkv_width, hidden, num_threads);
        k->rotary(qkv, s->cos, s->sin, rows, m->heads + m->kv_heads, dim, qkv_width, bf16, bf16,
                  num_threads);
        if (k->write_kv(l->keys, l->values, keys_of_qkv, values_of_qkv, s->slots, rows,
                        m->cache_rows, kv_width, qkv_width, qkv_width, size)) {
            failed = -2;
            break;
        }
        for (int64_t r = 0; r < rows; r++)
            memcpy(q + size * r * q_width, qkv + size * r * qkv_width, size * q_width);
        if (k->attention(attn, q, l->keys, l->values, s->block_tables, s->seq_lens, rows,
                         m->heads, m->kv_heads, dim, m->page_size, s->max_pages, m->scale, bf16,
                         num_threads)) {
            failed = -1;
            break;
        }
        linear(k, m, x, attn, l->o, l->o_bias, rows, q_width, hidden, q_width, num_threads);
        k->add_rms_norm(sum, h, residual, x, l->post_norm, rows, hidden, m->eps, bf16,
                        num_threads);
        swap(&residual, &sum);
        linear(k, m, gate_up, h, l->gate_up, NULL, rows, hidden, 2 * inter, hidden, num_threads);
        if (bf16)
            k->silu_mul((uint16_t *)act, (const uint16_t *)gate_up, k->silu, rows, inter,
                        2 * inter, num_threads);
        else
            k->silu_mul_f32((float *)act, (const float *)gate_up, rows, inter, 2 * inter,
                            num_threads);
        linear(k, m, x, act, l->down, NULL, rows, inter, hidden, inter, num_threads);
    }
    if (!failed) {
        k->add_rms_norm(sum, h, residual, x, m->final_norm, rows, hidden, m->eps, bf16,
                        num_threads);
        memcpy(x, h, size * rows * hidden);
    }
    free(buffer);
    return failed;
}
