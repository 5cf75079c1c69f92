/* The language model's projections at few rows, y = x w^T (+ bias), float32,
 * on the weight as the checkpoint holds it: w [N][K], each output's row
 * contiguous.
 *
 * A decode step has one row per running sequence, so a projection does a
 * handful of multiply-adds per weight it reads: too few for a GEMM library's
 * blocking to pay (oneDNN and MKL stream the small demo's weights at 5-9 GB/s
 * at 16 rows on this machine, which reads at 20), too many for a plain stream.
 * Here each weight row is read from memory once: a tile of 3 weight rows and 4
 * rows of x sums in 12 AVX2 accumulators along k, every 4-row group of x
 * passes over the tile's rows while they sit in L1, and those passes prefetch
 * the next tile's rows, spread evenly over them, so that memory and arithmetic
 * overlap. Tiles are split across OpenMP threads (torch's libgomp).
 *
 * Sums run along k in 8 lanes, added up at the end: another order than a GEMM
 * library's, within float32 rounding of it. Without AVX2 and FMA the build has
 * a plain loop and linear_vectorized() says 0 (the engine keeps torch's path).
 */
#include "kernels.h"
#include <stdint.h>

#define PARALLEL_MIN (1 << 18) /* multiply-adds below which one thread does it all */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int linear_vectorized(void) { return 1; }

/* Keeps v in a register: without it GCC folds the loads of x and w into the
 * FMAs, reloading each vector for every use (15 loads an iteration instead of
 * 7, and the loop bound by loads, not by the FMAs: measured 25% slower). */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y [MR][NR] (rows ys apart) = x [MR][K] (rows xs apart) times w [NR][K]^T, plus
 * bias [NR] if given. Pass p of P over these weight rows prefetches the next
 * tile's rows (next, or NULL) at the k-steps i = p (mod P): the P passes
 * together touch each of their cache lines. */
#define TILE(MR, NR)                                                                           \
    static inline void tile_##MR##_##NR(float *y, int64_t ys, const float *x, int64_t xs,      \
                                        const float *w, const float *bias, int64_t K,          \
                                        const float *next, int64_t p, int64_t P) {             \
        __m256 acc[MR][NR];                                                                    \
        for (int r = 0; r < MR; r++)                                                           \
            for (int c = 0; c < NR; c++) acc[r][c] = _mm256_setzero_ps();                      \
        int64_t k = 0;                                                                         \
        for (int64_t i = 0; k + 8 <= K; k += 8, i++) {                                         \
            if (next && i % P == p)                                                            \
                for (int c = 0; c < NR; c++)                                                   \
                    _mm_prefetch((const char *)(next + c * K + k), _MM_HINT_T0);               \
            __m256 wv[NR];                                                                     \
            for (int c = 0; c < NR; c++) {                                                     \
                wv[c] = _mm256_loadu_ps(w + c * K + k);                                        \
                IN_REGISTER(wv[c]);                                                            \
            }                                                                                  \
            for (int r = 0; r < MR; r++) {                                                     \
                __m256 xv = _mm256_loadu_ps(x + r * xs + k);                                   \
                IN_REGISTER(xv);                                                               \
                for (int c = 0; c < NR; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]); \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < MR; r++)                                                           \
            for (int c = 0; c < NR; c++) {                                                     \
                float sum = hsum(acc[r][c]);                                                   \
                for (int64_t j = k; j < K; j++) sum += x[r * xs + j] * w[c * K + j];           \
                y[r * ys + c] = bias ? sum + bias[c] : sum;                                    \
            }                                                                                  \
    }
TILE(4, 3) TILE(3, 3) TILE(2, 3) TILE(1, 3)
TILE(4, 1) TILE(3, 1) TILE(2, 1) TILE(1, 1)

/* All M rows of x against NR weight rows: passes of 4 rows, then the rest. */
#define PASSES(NR)                                                                             \
    static void passes_##NR(float *y, int64_t ys, const float *x, int64_t xs, int64_t M,       \
                            const float *w, const float *bias, int64_t K, const float *next) { \
        const int64_t P = (M + 3) / 4;                                                         \
        int64_t m = 0, p = 0;                                                                  \
        for (; m + 4 <= M; m += 4, p++)                                                        \
            tile_4_##NR(y + m * ys, ys, x + m * xs, xs, w, bias, K, next, p, P);               \
        switch (M - m) {                                                                       \
        case 3: tile_3_##NR(y + m * ys, ys, x + m * xs, xs, w, bias, K, next, p, P); break;    \
        case 2: tile_2_##NR(y + m * ys, ys, x + m * xs, xs, w, bias, K, next, p, P); break;    \
        case 1: tile_1_##NR(y + m * ys, ys, x + m * xs, xs, w, bias, K, next, p, P); break;    \
        }                                                                                      \
    }
PASSES(3) PASSES(1)

/* y [M][N] = x [M][K] (rows x_stride floats apart) times w [N][K]^T, plus bias
 * [N] if not NULL. */
void linear_rows(float *y, const float *x, const float *w, const float *bias, int64_t M,
                 int64_t K, int64_t N, int64_t x_stride, int num_threads) {
    const int64_t tiles = N / 3; /* tiles of 3 weight rows; the rest one by one */
#pragma omp parallel num_threads(num_threads) if (M * N * K >= PARALLEL_MIN)
    {
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n = t * 3;
            const float *next = t + 1 < tiles ? w + (n + 3) * K : 0;
            passes_3(y + n, N, x, x_stride, M, w + n * K, bias ? bias + n : 0, K, next);
        }
#pragma omp for schedule(static)
        for (int64_t n = tiles * 3; n < N; n++)
            passes_1(y + n, N, x, x_stride, M, w + n * K, bias ? bias + n : 0, K, 0);
    }
}

#else

int linear_vectorized(void) { return 0; }

void linear_rows(float *y, const float *x, const float *w, const float *bias, int64_t M,
                 int64_t K, int64_t N, int64_t x_stride, int num_threads) {
    (void)num_threads;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float sum = bias ? bias[n] : 0.0f;
            for (int64_t k = 0; k < K; k++) sum += x[m * x_stride + k] * w[n * K + k];
            y[m * N + n] = sum;
        }
}

#endif
