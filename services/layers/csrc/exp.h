/* e^x in plain arithmetic that the compiler vectorizes, for the kernels that take
 * many (paged_attention.c's softmax, fused_ops.c's SiLU). cpu_kernels.build()
 * keys its cache on this header too. */
#pragma once
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 (a softmax's score less its row's maximum; SiLU's -|x|), as
 * plain arithmetic that vectorizes (libm's expf does not): Cephes' expf, within
 * 2 ulp of it; below -87.3 (a weight under 1e-38) it stays at e^-87.3 instead of
 * going to 0. n = round(x / ln2) by an integer conversion, not floorf, which GCC
 * does not vectorize without -ffast-math: x / ln2 + 127.5 is positive here, so
 * the conversion's truncation floors it, and it is n + 127, 2^n's exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const int32_t biased = (int32_t)(x * 1.44269504088896341f + 127.5f);
    const float n = (float)(biased - 127); /* x = n ln2 + r */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)biased << 23; /* 2^n */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}
