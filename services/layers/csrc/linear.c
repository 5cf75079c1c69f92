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

#if defined(__AVX512F__)

#define GROUP_N 64     /* outputs a task takes: four vectors of 16 */
#define DOT_ROWS 6     /* rows of x summed at once: 24 sums and 4 weight vectors in registers */
#define CHUNK_ROWS 96  /* rows of x a task takes: 16 of those */

/* rows [m, m + R) of x against the 64 outputs of `group` from `n` on, R <= DOT_ROWS:
 * along k, each row's x[k] broadcast times the group's 64 weights at k */
static inline __attribute__((always_inline)) void group_rows(
    float *y, const float *x, const float *group, const float *bias, int64_t m, const int R,
    int64_t n, int64_t N, int64_t K, int64_t x_stride) {
    __m512 sums[DOT_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) sums[r][j] = _mm512_setzero_ps();
    const float *xm = x + m * x_stride;
    for (int64_t k = 0; k < K; k++) {
        const float *w = group + k * GROUP_N;
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(xm[r * x_stride + k]);
            sums[r][0] = _mm512_fmadd_ps(xv, w0, sums[r][0]);
            sums[r][1] = _mm512_fmadd_ps(xv, w1, sums[r][1]);
            sums[r][2] = _mm512_fmadd_ps(xv, w2, sums[r][2]);
            sums[r][3] = _mm512_fmadd_ps(xv, w3, sums[r][3]);
        }
    }
    for (int j = 0; j < 4; j++) {
        const int64_t left = N - n - 16 * j;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b =
            bias ? _mm512_maskz_loadu_ps(mask, bias + n + 16 * j) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(y + (m + r) * N + n + 16 * j, mask,
                                  _mm512_add_ps(sums[r][j], b));
    }
}

/* y [M][N] = x [M][K] (rows x_stride floats apart) times w^T, plus bias [N] if not
 * NULL, on w packed by cpu_kernels.F32Linear.pack: groups of 64 outputs, each [K][64]
 * (zeros past N). A task is a group and up to CHUNK_ROWS rows, DOT_ROWS at a time;
 * a group's weights stay in L2 for its next rows. Any number of rows: a decode
 * step's and a prompt's. */
void linear_avx512(float *y, const float *x, const float *packed, const float *bias, int64_t M,
                   int64_t K, int64_t N, int64_t x_stride, int num_threads) {
    const int64_t groups = (N + GROUP_N - 1) / GROUP_N;
    const int64_t chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads) \
    if (M * N * K >= PARALLEL_MIN)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t c = 0; c < chunks; c++) {
            const float *group = packed + g * K * GROUP_N;
            const int64_t n = g * GROUP_N;
            const int64_t end = (c + 1) * CHUNK_ROWS < M ? (c + 1) * CHUNK_ROWS : M;
            for (int64_t m = c * CHUNK_ROWS; m < end; m += DOT_ROWS) {
                switch (end - m < DOT_ROWS ? (int)(end - m) : DOT_ROWS) {
                case 1: group_rows(y, x, group, bias, m, 1, n, N, K, x_stride); break;
                case 2: group_rows(y, x, group, bias, m, 2, n, N, K, x_stride); break;
                case 3: group_rows(y, x, group, bias, m, 3, n, N, K, x_stride); break;
                case 4: group_rows(y, x, group, bias, m, 4, n, N, K, x_stride); break;
                case 5: group_rows(y, x, group, bias, m, 5, n, N, K, x_stride); break;
                default: group_rows(y, x, group, bias, m, 6, n, N, K, x_stride); break;
                }
            }
        }
    }
}

int has_avx512(void) { return 1; }

#endif /* AVX-512 */

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

#if !defined(__AVX512F__)
void linear_avx512(float *y, const float *x, const float *packed, const float *bias, int64_t M,
                   int64_t K, int64_t N, int64_t x_stride, int num_threads) {
    (void)y, (void)x, (void)packed, (void)bias, (void)M, (void)K, (void)N, (void)x_stride;
    (void)num_threads;
}

int has_avx512(void) { return 0; }
#endif
