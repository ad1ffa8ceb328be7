/* The exponential race's pieces, shared by the plain race (sampling_noise.c) and the
 * filtered one (sampling_filter.c): the seed stream's hash, its Exp(1) noise at one vocab
 * index, and one logit's score. pdserve.engine.sampling_noise defines them; its torch
 * formulas are the references in the tests.
 *
 * Per element: bits = mix32(key + v * GOLDEN mod 2^32), u = ((bits >> 8) + 0.5) / 2^24,
 * noise = max(-log(u), 2^-25). u is the torch formula's value exactly: float32(b + 0.5)
 * for b < 2^24 is float32(2b + 1) / 2, and an int -> float conversion rounds as the
 * addition does, with no step -ffast-math could re-associate. The top b's u rounds to 1;
 * its noise is 2^-25 (~ -log(1 - 2^-25)), not 0. The log is libmvec's (within a few ulp
 * of torch's). */
#ifndef PDSERVE_CPU_KERNELS_SAMPLING_NOISE_H
#define PDSERVE_CPU_KERNELS_SAMPLING_NOISE_H

#include <math.h>
#include <stdint.h>

#include "common.h" /* exp2_weight */

#define SN_GOLDEN 0x9E3779B9u
#define SN_MUL 0x45D9F3Bu
#define SN_LOG2E 1.44269504088896341f

static inline uint32_t sn_mix32(uint32_t x)
{
    x = ((x >> 16) ^ x) * SN_MUL;
    x = ((x >> 16) ^ x) * SN_MUL;
    return (x >> 16) ^ x;
}

/* Element v of the noise of the row keyed `key`. */
static inline float sn_noise_at(uint32_t key, int64_t v)
{
    const uint32_t bits = sn_mix32(key + (uint32_t)v * SN_GOLDEN);
    return fmaxf(-logf((float)(int32_t)(2 * (bits >> 8) + 1) * 0x1p-25f), 0x1p-25f);
}

/* The race compares softmax(x)_v / noise_v; the softmax's sum is the same for every v of
 * a row, so exp(x_v - max) / noise_v is compared instead (exp2_weight: 0 below 2^-126,
 * where no score can win; a -inf logit, filtered out, scores 0). */
static inline float sn_race_score(float x, float row_max, uint32_t key, int64_t v)
{
    return exp2_weight((x - row_max) * SN_LOG2E) / sn_noise_at(key, v);
}

/* sampling_noise.c: the race over n logits with their vocab indices (NULL: 0..n-1) and
 * their row's max. */
int64_t sn_race(const float *y, const int32_t *idx, int64_t n, float m, uint32_t key);

#endif
