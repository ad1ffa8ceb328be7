/* What the CPU kernels share: the dtype codes every entry point takes (library.py's
 * DTYPE_CODES holds the same table for Python), bfloat16 <-> float32, and INLINE.
 * A bfloat16 is the upper half of a float32: widening is a shift, narrowing rounds to
 * nearest even as torch does. */
#ifndef PDSERVE_CPU_KERNELS_COMMON_H
#define PDSERVE_CPU_KERNELS_COMMON_H

#include <stdint.h>
#include <string.h>

#define DT_F32 0
#define DT_BF16 1
#define INLINE static inline __attribute__((always_inline))

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a NaN after truncation */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

#endif
