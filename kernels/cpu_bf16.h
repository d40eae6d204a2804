/* bf16 helpers shared by the C kernels (kernels/cbuild.py expands this include). */
#ifndef QD_CPU_BF16_H
#define QD_CPU_BF16_H

#include <stdint.h>
#include <string.h>

/* bf16 -> fp32 (exact). */
static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even; every NaN becomes the quiet NaN 0x7fc0. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
