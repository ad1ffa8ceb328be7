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

#if defined(__AVX512F__) || defined(__AVX2__)
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
#elif defined(__AVX2__)
    /* the same passes 8 wide: the portable loops took 0.10 ms a row of 49k on a Zen 3
     * core, 2.9 ms for 64 rows (docs/benchmarks.md section 6, session 27) */
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    if (V >= 8) {
        __m256 mx = _mm256_loadu_ps(x);
        __m256i nan = _mm256_setzero_si256();
        for (; v + 8 <= V; v += 8) {
            const __m256 a = _mm256_loadu_ps(x + v);
            nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(
                _mm256_and_si256(_mm256_castps_si256(a), abs_mask), inf));
            mx = _mm256_max_ps(mx, a);
        }
        if (!_mm256_testz_si256(nan, nan))
            return first_nan(x, V);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        best = _mm_cvtss_f32(m4);
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
#elif defined(__AVX2__)
    const __m256 b = _mm256_set1_ps(best);
    for (; i + 8 <= V; i += 8) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
        if (eq)
            return i + __builtin_ctz((unsigned)eq);
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
