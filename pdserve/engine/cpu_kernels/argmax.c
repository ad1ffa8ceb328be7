/* Greedy decoding's argmax over the rows of float32 logits [R, V], as torch.argmax(-1)
 * answers it: the first index of the largest value, and the first NaN where a row has one.
 *
 * torch's CPU argmax walks a 49k vocabulary at ~0.5 ns an element (64 rows: ~4 ms of a
 * ~90 ms bfloat16 decode step). Here a row is two vector passes: its max, then the first
 * index holding it. NaNs are found from the bits (integer compares), which -ffast-math
 * leaves alone; float compares only ever see rows without them.
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define PARALLEL_MIN_ELEMS 65536

static inline int is_nan_bits(uint32_t u)
{
    return (u & 0x7fffffffu) > 0x7f800000u;
}

static int64_t first_nan(const float *x, int64_t V)
{
    for (int64_t v = 0; v < V; v++) {
        uint32_t u;
        memcpy(&u, x + v, sizeof u);
        if (is_nan_bits(u))
            return v;
    }
    return -1;
}

static int64_t row_argmax(const float *x, int64_t V)
{
    int64_t v = 0;
    float best;
#ifdef __AVX512F__
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    if (V >= 16) {
        __m512 mx = _mm512_loadu_ps(x);
        __mmask16 nan = 0;
        for (; v + 16 <= V; v += 16) {
            const __m512 a = _mm512_loadu_ps(x + v);
            nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), abs_mask), inf);
            mx = _mm512_max_ps(mx, a);
        }
        if (nan)
            return first_nan(x, V);
        best = _mm512_reduce_max_ps(mx);
    } else {
        best = x[0];
    }
#else
    best = x[0];
#endif
    for (int64_t t = v; t < V; t++) {
        uint32_t u;
        memcpy(&u, x + t, sizeof u);
        if (is_nan_bits(u))
            return first_nan(x, V);
        best = x[t] > best ? x[t] : best;
    }
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 b = _mm512_set1_ps(best);
    for (; i + 16 <= V; i += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), b, _CMP_EQ_OQ);
        if (eq)
            return i + __builtin_ctz(eq);
    }
#endif
    for (; i < V; i++)
        if (x[i] == best)
            return i;
    return 0; /* not reached: best is one of the row's values */
}

/* out[r] = argmax of row r of x [R, V] (row stride `stride` elements), V >= 1. */
void am_argmax_rows(const float *x, int64_t R, int64_t V, int64_t stride, int64_t *out,
                    int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (R * V >= PARALLEL_MIN_ELEMS && num_threads > 1 && R > 1)
    for (int64_t r = 0; r < R; r++)
        out[r] = row_argmax(x + r * stride, V);
}
