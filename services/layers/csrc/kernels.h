/* The kernels decode.c calls through pointers, declared once: each defining
 * source includes this, so a signature that drifts from its declaration is a
 * compile error there, and decode.c takes its pointer types from here. */
#ifndef EPD_KERNELS_H
#define EPD_KERNELS_H

#include <stdint.h>

/* linear_bf16.c: the two take the same arguments, so decode.c calls either */
void linear_amx(uint16_t *y, const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                int64_t M, int64_t K, int64_t N, int64_t x_stride, int num_threads);
void linear_avx512bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                       const uint16_t *bias, int64_t M, int64_t K, int64_t N, int64_t x_stride,
                       int num_threads);

/* linear.c: float32, w as loaded [N][K] (linear_rows, AVX2) or packed (linear_avx512):
 * the two take the same arguments, so decode.c calls either */
void linear_rows(float *y, const float *x, const float *w, const float *bias, int64_t M,
                 int64_t K, int64_t N, int64_t x_stride, int num_threads);
void linear_avx512(float *y, const float *x, const float *packed, const float *bias, int64_t M,
                   int64_t K, int64_t N, int64_t x_stride, int num_threads);

/* paged_attention.c */
int paged_decode_attention(void *out, const void *q, const void *keys, const void *values,
                           const int64_t *block_tables, const int64_t *seq_lens,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t page_size, int64_t max_pages, float scale,
                           int bf16, int num_threads);
int write_kv(void *keys, void *values, const void *k, const void *v, const int64_t *slots,
             int64_t tokens, int64_t num_rows, int64_t width, int64_t k_stride,
             int64_t v_stride, int64_t size);

/* fused_ops.c */
void rms_norm(void *out, const void *x, const void *w, int64_t rows, int64_t n,
              int64_t x_stride, float eps, int bf16, int num_threads);
void add_rms_norm(void *sum, void *out, const void *x, const void *delta, const void *w,
                  int64_t rows, int64_t n, float eps, int bf16, int num_threads);
void rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads,
            int64_t dim, int64_t token_stride, int bf16, int cos_bf16, int num_threads);
void silu_mul(uint16_t *out, const uint16_t *x, const float *silu, int64_t rows, int64_t n,
              int64_t x_stride, int num_threads);
void silu_mul_f32(float *out, const float *x, int64_t rows, int64_t n, int64_t x_stride,
                  int num_threads);

#endif
