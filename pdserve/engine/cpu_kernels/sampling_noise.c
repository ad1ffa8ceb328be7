/* The sampler's Exp(1) noise in one pass over [B, V], and the exponential race drawn with it
 * without materialising it (pdserve.engine.sampling_noise defines both; its torch formulas
 * are this file's references in the tests). The per-element formulas are in
 * sampling_noise.h.
 *
 * The torch formula of the noise spends a dozen int64 passes over [B, V] (64 x 49152: ~67
 * ms a step on two cores, more than the decode step it samples for); here it is uint32
 * arithmetic in registers and one float32 store.
 */
#include <math.h>
#include <stdint.h>

#include "sampling_noise.h"

#define SPAN 4096 /* elements per work item: rows are split so one row uses every thread */

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
        for (int64_t v = v0; v < v1; v++)
            o[v] = sn_noise_at(key, v);
    }
}

/* The race over n logits y whose vocab indices are idx (NULL: 0..n-1), against their row's
 * max m: the index with the largest score, the lowest on a tie. */
int64_t sn_race(const float *y, const int32_t *idx, int64_t n, float m, uint32_t key)
{
    float score[256];
    float best = -1.f;
    int64_t arg = 0;
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        const int c = n - i0 < 256 ? (int)(n - i0) : 256;
        if (idx) {
#pragma omp simd
            for (int j = 0; j < c; j++)
                score[j] = sn_race_score(y[i0 + j], m, key, idx[i0 + j]);
        } else {
#pragma omp simd
            for (int j = 0; j < c; j++)
                score[j] = sn_race_score(y[i0 + j], m, key, i0 + j);
        }
        for (int j = 0; j < c; j++) {
            const int64_t v = idx ? idx[i0 + j] : i0 + j;
            if (score[j] > best || (score[j] == best && v < arg)) {
                best = score[j];
                arg = v;
            }
        }
    }
    return arg;
}

/* The race over one row of logits x [V]. */
static int64_t race_row(const float *x, int64_t V, uint32_t key)
{
    float m = x[0];
    for (int64_t v = 1; v < V; v++)
        m = x[v] > m ? x[v] : m;
    return sn_race(x, NULL, V, m, key);
}

/* tokens[r] = argmax_v softmax(logits[r])_v / noise_v for each row r of logits [B, V]
 * (contiguous float32): the exponential race, an exact draw from softmax(logits[r]). Ties
 * go to the lowest v, as argmax's do.
 * One row per work item: its two passes over V stay in cache, and no [B, V] noise or
 * probabilities are written (on two cores the torch formula's four [B, V] temporaries cost
 * more in page faults than in arithmetic). */
void sn_exponential_race(const float *logits, const int64_t *keys, int64_t B, int64_t V,
                         int64_t *tokens, int num_threads)
{
    const int threads = B > 1 && B * V >= 2 * SPAN ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < B; r++)
        tokens[r] = race_row(logits + r * V, V, (uint32_t)keys[r]);
}
