/* The sampler's Exp(1) noise in one pass over [B, V] (pdserve.engine.sampling_noise defines
 * the stream; its torch formula is this kernel's reference in the tests).
 *
 * Per element: bits = mix32(key[r] + v * GOLDEN mod 2^32), u = ((bits >> 8) + 0.5) / 2^24,
 * noise = -log(u). The torch formula spends a dozen int64 passes over [B, V] on it (64 x
 * 49152: ~67 ms a step on two cores, more than the decode step it samples for); here it is
 * uint32 arithmetic in registers and one float32 store.
 *
 * u is the torch formula's value exactly: float32(b + 0.5) for b < 2^24 is
 * float32(2b + 1) / 2, and an int -> float conversion rounds as the addition does, with no
 * step -ffast-math could re-associate. The log is libmvec's (within a few ulp of torch's).
 */
#include <math.h>
#include <stdint.h>

#define GOLDEN 0x9E3779B9u
#define MUL 0x45D9F3Bu
#define SPAN 4096 /* elements per work item: rows are split so one row uses every thread */

static inline uint32_t mix32(uint32_t x)
{
    x = ((x >> 16) ^ x) * MUL;
    x = ((x >> 16) ^ x) * MUL;
    return (x >> 16) ^ x;
}

/* out [B, V] (contiguous) = the noise of rows keyed keys [B] (32-bit stream keys, as
 * sampling_noise.row_keys gives them). */
void sn_exponential_noise(const int64_t *keys, int64_t B, int64_t V, float *out,
                          int num_threads)
{
    const int64_t spans = (V + SPAN - 1) / SPAN;
    const int threads = B * V >= 2 * SPAN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t item = 0; item < B * spans; item++) {
        const int64_t r = item / spans, v0 = (item % spans) * SPAN;
        const int64_t v1 = v0 + SPAN < V ? v0 + SPAN : V;
        const uint32_t key = (uint32_t)keys[r];
        float *o = out + r * V;
#pragma omp simd
        for (int64_t v = v0; v < v1; v++) {
            const uint32_t bits = mix32(key + (uint32_t)v * GOLDEN);
            const float u = (float)(int32_t)(2 * (bits >> 8) + 1) * 0x1p-25f;
            o[v] = -logf(u);
        }
    }
}
