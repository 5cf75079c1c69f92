/* What EPD's AMX kernels (linear_bf16.c, paged_attention.c) share: the process's
 * leave to use AMX state, and their tile shapes. Where the build has no AMX
 * (-march=native on a CPU without it), amx_init() says 0 and nothing else is
 * defined. cpu_kernels.build() keys its cache on this header too. */
#pragma once
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks the kernel for AMX state (Linux 5.16+); 1 if this process may use it. */
int amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

struct amx_tile_config {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* This thread's tiles, every row 64 bytes: 0-3 (float32 sums) and 4 (the left
 * operand) `rows` rows, 5-7 (right operands: 16 pairs of rows) 16 rows. */
static void amx_configure(int rows) {
    struct amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)(t < 5 ? rows : 16);
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

#else

int amx_init(void) { return 0; }

#endif
