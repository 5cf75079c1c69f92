/* The language model's projections in bfloat16: y = x w^T (+ bias), x [M][K] and
 * y [M][N] bfloat16, sums in float32, each output rounded once. Two kernels on one
 * packing of the weights: AMX's tiles (linear_amx, for the few rows of a decode
 * step) where the CPU has AMX, AVX512-BF16's pair dot products
 * (linear_avx512bf16, any rows) where it has those without AMX.
 *
 * oneDNN's AMX GEMM (torch's packed path) reads the small demo's weights at
 * 13-20 GB/s in a step of 16 rows on a 2-core Sapphire Rapids, where a plain
 * read of them runs at 20-40: a decode step's projections are a stream of
 * weights. Here each weight is packed once, at load (cpu_kernels.Bf16Linear.pack),
 * into the tiles AMX multiplies: for 16 outputs and 32 inputs, a 1 KB tile whose
 * row r holds the pairs w[n][2r], w[n][2r+1] of its 16 outputs; a group of 64
 * outputs is four such columns of tiles along k, one after the other, so a call
 * reads the weight in order. A tile's row is also what one AVX512-BF16 dot
 * product (vdpbf16ps) takes: 16 outputs' pairs against a pair of x broadcast.
 *
 * AMX: a thread takes groups of 64 outputs. For each 16 rows of x (group_rows) it
 * keeps the four 16x16 float32 sums in tiles 0-3 and, along k, multiplies 32
 * columns of x (tile 4) by the group's four weight tiles, prefetching the tiles
 * AHEAD blocks on; 32 rows at a time (pair_rows) it sums 2 x 2 tiles, so each
 * tile loaded is used twice. A group's weights stay in L2 for its next rows.
 * Past ~100 rows oneDNN's blocking is faster (linear.py sends such calls there).
 * Sums in another order than oneDNN's: within bfloat16 rounding of them.
 *
 * A process needs the kernel's leave to use AMX state: amx_init() (amx.h) asks
 * for it, and is 0 where the build has no AMX (then linear_amx is never called).
 */
#include "amx.h"
#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <string.h>

#define TILE_K 32     /* bfloat16 inputs a tile multiplies */
#define TILE_N 16     /* outputs a tile sums */
#define GROUP_N 64    /* outputs a thread takes at once: four tiles */
#define TILE_ELEMS 512 /* bfloat16 elements in a weight tile: TILE_K * TILE_N */
#define DOT_ROWS 6    /* rows of x linear_avx512bf16 sums at once */
#define CHUNK_ROWS 96 /* and a task's rows: 16 of those */

/* y's rows [m, m + rows), columns [n, n + width): the float32 sums (rows `stride`
 * apart) plus bias, rounded to bfloat16 */
static inline void store(uint16_t *y, const float *sums, int64_t stride, const uint16_t *bias,
                         int64_t m, int rows, int64_t n, int64_t width, int64_t N) {
    for (int64_t c = 0; c < width; c += 16) {
        const __mmask16 mask = width - c >= 16 ? 0xffff : (__mmask16)((1u << (width - c)) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias) {
            __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n + c);
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        for (int r = 0; r < rows; r++) {
            __m512 s = _mm512_add_ps(_mm512_loadu_ps(sums + r * stride + c), b);
            _mm256_mask_storeu_epi16(y + (m + r) * N + n + c, mask,
                                     (__m256i)_mm512_cvtneps_pbh(s));
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#define AHEAD 2 /* weight tiles group_rows prefetches ahead of its loads */

/* rows [m, m + rows) of x against one group of 64 outputs from `n` on */
static void group_rows(uint16_t *y, const uint16_t *x, const uint16_t *group,
                       const uint16_t *bias, int64_t m, int rows, int64_t n, int64_t N,
                       int64_t K, int64_t x_stride) {
    const int64_t blocks = K / TILE_K;
    const uint16_t *w0 = group, *w1 = group + blocks * TILE_ELEMS,
                   *w2 = group + 2 * blocks * TILE_ELEMS, *w3 = group + 3 * blocks * TILE_ELEMS;
    const uint16_t *xm = x + m * x_stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * TILE_ELEMS;
        if (b + AHEAD < blocks)
            for (int line = 0; line < TILE_ELEMS * 2; line += 64) {
                const int64_t ahead = at + AHEAD * TILE_ELEMS + line / 2;
                _mm_prefetch((const char *)(w0 + ahead), _MM_HINT_T0);
                _mm_prefetch((const char *)(w1 + ahead), _MM_HINT_T0);
                _mm_prefetch((const char *)(w2 + ahead), _MM_HINT_T0);
                _mm_prefetch((const char *)(w3 + ahead), _MM_HINT_T0);
            }
        _tile_loadd(4, xm + b * TILE_K, x_stride * 2);
        _tile_loadd(5, w0 + at, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, w1 + at, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, w2 + at, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, w3 + at, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    float sums[16][GROUP_N];
    _tile_stored(0, &sums[0][0], GROUP_N * 4);
    _tile_stored(1, &sums[0][16], GROUP_N * 4);
    _tile_stored(2, &sums[0][32], GROUP_N * 4);
    _tile_stored(3, &sums[0][48], GROUP_N * 4);
    store(y, &sums[0][0], GROUP_N, bias, m, rows, n, N < n + GROUP_N ? N - n : GROUP_N, N);
}

/* 32 rows [m, m + 32) of x against 32 outputs from `n` on (whose weight tiles
 * start at w0 and w1): 2 x 2 tiles of sums, each tile of x and of weights used twice */
static void pair_rows(uint16_t *y, const uint16_t *x, const uint16_t *w0, const uint16_t *w1,
                      const uint16_t *bias, int64_t m, int64_t n, int64_t N, int64_t K,
                      int64_t x_stride) {
    const int64_t blocks = K / TILE_K;
    const uint16_t *x0 = x + m * x_stride, *x1 = x + (m + 16) * x_stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        _tile_loadd(4, x0 + b * TILE_K, x_stride * 2);
        _tile_loadd(5, x1 + b * TILE_K, x_stride * 2);
        _tile_loadd(6, w0 + b * TILE_ELEMS, 64);
        _tile_loadd(7, w1 + b * TILE_ELEMS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float sums[32][32];
    _tile_stored(0, &sums[0][0], 32 * 4);
    _tile_stored(1, &sums[0][16], 32 * 4);
    _tile_stored(2, &sums[16][0], 32 * 4);
    _tile_stored(3, &sums[16][16], 32 * 4);
    if (n < N)
        store(y, &sums[0][0], 32, bias, m, 32, n, N < n + 32 ? N - n : 32, N);
}

/* y [M][N] = x [M][K] (rows x_stride elements apart, K a multiple of 32) times
 * the packed weight of N outputs (N padded to 64 in it), plus bias [N] if not NULL. */
void linear_amx(uint16_t *y, const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                int64_t M, int64_t K, int64_t N, int64_t x_stride, int num_threads) {
    const int64_t groups = (N + GROUP_N - 1) / GROUP_N;
    const int64_t group_elems = 4 * (K / TILE_K) * TILE_ELEMS;
#pragma omp parallel num_threads(num_threads)
    {
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *group = packed + g * group_elems;
            const int64_t n = g * GROUP_N, tiles = K / TILE_K * TILE_ELEMS;
            int64_t m = 0;
            for (; m + 32 <= M; m += 32) { /* every tile 16 rows */
                if (configured != 16) {
                    amx_configure(16);
                    configured = 16;
                }
                pair_rows(y, x, group, group + tiles, bias, m, n, N, K, x_stride);
                pair_rows(y, x, group + 2 * tiles, group + 3 * tiles, bias, m, n + 32, N, K,
                          x_stride);
            }
            for (; m < M; m += 16) {
                const int rows = M - m < 16 ? (int)(M - m) : 16;
                if (rows != configured) {
                    amx_configure(rows);
                    configured = rows;
                }
                group_rows(y, x, group, bias, m, rows, n, N, K, x_stride);
            }
        }
        if (configured)
            _tile_release();
    }
}

#endif /* AMX */

/* rows [m, m + R) of x against one group of 64 outputs from `n` on, R <= DOT_ROWS:
 * the 4 R sums in registers, along k a pair of each row's x broadcast and
 * multiplied by the group's four tile rows for that pair */
static inline __attribute__((always_inline)) void dot_rows(
    uint16_t *y, const uint16_t *x, const uint16_t *group, const uint16_t *bias, int64_t m,
    const int R, int64_t n, int64_t N, int64_t K, int64_t x_stride) {
    const int64_t blocks = K / TILE_K, column = blocks * TILE_ELEMS;
    __m512 sums[DOT_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            sums[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *w = group + b * TILE_ELEMS, *xb = x + m * x_stride + b * TILE_K;
        for (int p = 0; p < TILE_K / 2; p++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + column + p * 32);
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2 * column + p * 32);
            const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 3 * column + p * 32);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, xb + r * x_stride + 2 * p, sizeof pair);
                const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
                sums[r][0] = _mm512_dpbf16_ps(sums[r][0], xr, w0);
                sums[r][1] = _mm512_dpbf16_ps(sums[r][1], xr, w1);
                sums[r][2] = _mm512_dpbf16_ps(sums[r][2], xr, w2);
                sums[r][3] = _mm512_dpbf16_ps(sums[r][3], xr, w3);
            }
        }
    }
    float out[DOT_ROWS][GROUP_N];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(&out[r][16 * j], sums[r][j]);
    store(y, &out[0][0], GROUP_N, bias, m, R, n, N < n + GROUP_N ? N - n : GROUP_N, N);
}

/* linear_amx's product on the same packed weight, without AMX: a task is a
 * group of 64 outputs and up to CHUNK_ROWS rows of x (a prompt's call splits over
 * more threads than its groups), run DOT_ROWS rows at a time (the sums of 6 rows
 * and the 4 weight rows fill 28 of the 32 vector registers); a group's weights
 * stay in L2 for its next rows, and a thread's tasks run a group's chunks in turn. */
void linear_avx512bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                       const uint16_t *bias, int64_t M, int64_t K, int64_t N, int64_t x_stride,
                       int num_threads) {
    const int64_t groups = (N + GROUP_N - 1) / GROUP_N;
    const int64_t group_elems = 4 * (K / TILE_K) * TILE_ELEMS;
    const int64_t chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *group = packed + g * group_elems;
            const int64_t n = g * GROUP_N;
            const int64_t end = (c + 1) * CHUNK_ROWS < M ? (c + 1) * CHUNK_ROWS : M;
            for (int64_t m = c * CHUNK_ROWS; m < end; m += DOT_ROWS) {
                switch (end - m < DOT_ROWS ? (int)(end - m) : DOT_ROWS) {
                case 1: dot_rows(y, x, group, bias, m, 1, n, N, K, x_stride); break;
                case 2: dot_rows(y, x, group, bias, m, 2, n, N, K, x_stride); break;
                case 3: dot_rows(y, x, group, bias, m, 3, n, N, K, x_stride); break;
                case 4: dot_rows(y, x, group, bias, m, 4, n, N, K, x_stride); break;
                case 5: dot_rows(y, x, group, bias, m, 5, n, N, K, x_stride); break;
                default: dot_rows(y, x, group, bias, m, 6, n, N, K, x_stride); break;
                }
            }
        }
    }
}

int has_avx512bf16(void) { return 1; }

#endif /* AVX512-BF16 */

#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__))
void linear_amx(uint16_t *y, const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                int64_t M, int64_t K, int64_t N, int64_t x_stride, int num_threads) {
    (void)y, (void)x, (void)packed, (void)bias, (void)M, (void)K, (void)N, (void)x_stride;
    (void)num_threads;
}
#endif

#if !defined(__AVX512BF16__)
void linear_avx512bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed,
                       const uint16_t *bias, int64_t M, int64_t K, int64_t N, int64_t x_stride,
                       int num_threads) {
    (void)y, (void)x, (void)packed, (void)bias, (void)M, (void)K, (void)N, (void)x_stride;
    (void)num_threads;
}

int has_avx512bf16(void) { return 0; }
#endif
