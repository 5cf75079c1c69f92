/* A decode step's decoder layers in one call, bfloat16 on AMX or AVX512-BF16.
 *
 * A decode step of the small demo runs ~600 torch operators and ~80 kernel calls
 * through ctypes, one to a few microseconds of Python and dispatch each: ~30 % of
 * the step (py-spy, docs/performance.md). This file calls the same kernels
 * (linear_bf16.c's projections, paged_attention.c's attention and KV writer,
 * fused_ops.c's norms, rotary embedding and SiLU-and-product, given as function
 * pointers, declared in kernels.h: each keeps its own build flags) layer after
 * layer: the bit-exact results of the Python path, in one call.
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
    __typeof__(&linear_amx) linear; /* or linear_avx512bf16: the same type */
    __typeof__(&paged_decode_attention) attention;
    __typeof__(&write_kv) write_kv;
    __typeof__(&rms_norm) rms_norm;
    __typeof__(&add_rms_norm) add_rms_norm;
    __typeof__(&rotary) rotary;
    __typeof__(&silu_mul) silu_mul;
    const float *silu; /* [65536]: torch's SiLU of each bfloat16, by its bits */
};

struct model {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, page_size, cache_rows;
    float eps, scale;
    const void *final_norm;
};

/* one decoder layer's weights (the projections as linear_bf16.c's tiles, their
 * biases or NULL) and cache */
struct layer {
    const void *input_norm, *post_norm, *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;
    void *keys, *values;
};

struct step {
    int64_t rows, max_pages;
    const int64_t *block_tables; /* [rows][max_pages] */
    const int64_t *seq_lens;     /* [rows]: keys after this step's */
    const int64_t *slots;        /* [rows]: the cache row of each new key */
    const void *cos, *sin;       /* [rows][head_dim] */
};

static void swap(uint16_t **a, uint16_t **b) {
    uint16_t *t = *a;
    *a = *b;
    *b = t;
}

/* x [rows][hidden]: the step's input embeddings in, the final norm's output out.
 * Returns 0; -1 where memory ran out, -2 for a KV slot outside the cache (where
 * the Python path raises). */
int decode_layers(const struct kernels *k, const struct model *m, const struct layer *layers,
                  const struct step *s, uint16_t *x, int num_threads) {
    const int64_t rows = s->rows, hidden = m->hidden, dim = m->head_dim;
    const int64_t q_width = m->heads * dim, kv_width = m->kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width, inter = m->intermediate;
    uint16_t *buffer = malloc(sizeof(uint16_t) * rows *
                              (3 * hidden + qkv_width + 2 * q_width + 3 * inter));
    if (buffer == NULL) return -1;
    uint16_t *residual = buffer, *h = residual + rows * hidden, *sum = h + rows * hidden;
    uint16_t *qkv = sum + rows * hidden, *q = qkv + rows * qkv_width, *attn = q + rows * q_width;
    uint16_t *gate_up = attn + rows * q_width, *act = gate_up + rows * 2 * inter;
    int failed = 0;
    for (int64_t i = 0; i < m->layers; i++) {
        const struct layer *l = &layers[i];
        if (i == 0) {
            memcpy(residual, x, sizeof(uint16_t) * rows * hidden);
            k->rms_norm(h, x, l->input_norm, rows, hidden, hidden, m->eps, 1, num_threads);
        } else {
            k->add_rms_norm(sum, h, residual, x, l->input_norm, rows, hidden, m->eps, 1,
                            num_threads);
            swap(&residual, &sum);
        }
        k->linear(qkv, h, l->qkv, l->qkv_bias, rows, hidden, qkv_width, hidden, num_threads);
        k->rotary(qkv, s->cos, s->sin, rows, m->heads + m->kv_heads, dim, qkv_width, 1, 1,
                  num_threads);
        if (k->write_kv(l->keys, l->values, qkv + q_width, qkv + q_width + kv_width, s->slots,
                        rows, m->cache_rows, kv_width, qkv_width, qkv_width, 2)) {
            failed = -2;
            break;
        }
        for (int64_t r = 0; r < rows; r++)
            memcpy(q + r * q_width, qkv + r * qkv_width, sizeof(uint16_t) * q_width);
        if (k->attention(attn, q, l->keys, l->values, s->block_tables, s->seq_lens, rows,
                         m->heads, m->kv_heads, dim, m->page_size, s->max_pages, m->scale, 1,
                         num_threads)) {
            failed = -1;
            break;
        }
        k->linear(x, attn, l->o, l->o_bias, rows, q_width, hidden, q_width, num_threads);
        k->add_rms_norm(sum, h, residual, x, l->post_norm, rows, hidden, m->eps, 1, num_threads);
        swap(&residual, &sum);
        k->linear(gate_up, h, l->gate_up, NULL, rows, hidden, 2 * inter, hidden, num_threads);
        k->silu_mul(act, gate_up, k->silu, rows, inter, 2 * inter, num_threads);
        k->linear(x, act, l->down, NULL, rows, inter, hidden, inter, num_threads);
    }
    if (!failed) {
        k->add_rms_norm(sum, h, residual, x, m->final_norm, rows, hidden, m->eps, 1, num_threads);
        memcpy(x, h, sizeof(uint16_t) * rows * hidden);
    }
    free(buffer);
    return failed;
}
