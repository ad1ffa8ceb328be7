/* Session 35: a Q4_1 block's weights by table lookup (the engine's q41_weights, included from
 * q4_blocks.c: one FMA makes the 16 values, vpermb + 2 vpermps look them up) against widening
 * the codes (vpmovzxbd, and / shift, vcvtdq2ps) and one FMA per 16 weights: the same values
 * (fma(q, d, m) either way). One thread, float32 x, one row; ns per block, N rows x K,
 * `nmat` matrices (1: in cache). From the repository root:
 *   gcc -O3 -march=native -ffast-math -fopenmp docs/bench/cpu-s35/q41_cvt.c -o /tmp/q41c \
 *     && /tmp/q41c 1536 40
 */
#include "../../../pdserve/engine/cpu_kernels/q4_blocks.c"

#include <omp.h>
#include <stdio.h>

#define PF 2048

typedef void weights_fn(const uint8_t *p, __m512 *w0, __m512 *w1);

static inline void q41_widened(const uint8_t *p, __m512 *w0, __m512 *w1)
{
    int32_t dm32;
    memcpy(&dm32, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm32));
    const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 4)));
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(raw, _mm512_set1_epi32(15))), d, m);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 4)), d, m);
}

/* One row's dot product with x over nb blocks, four accumulators; `weights` is a constant at
 * each call, so each caller gets its own inlined loop. */
static inline __attribute__((always_inline)) float dot(const uint8_t *row, const float *x,
                                                       int nb, weights_fn *weights)
{
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (int b = 0; b < nb; b += 2)
        for (int j = 0; j < 2; j++) {
            const uint8_t *p = row + (b + j) * Q41_BYTES;
            _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
            __m512 w0, w1;
            weights(p, &w0, &w1);
            a[2 * j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + (b + j) * 32), a[2 * j]);
            a[2 * j + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + (b + j) * 32 + 16),
                                           a[2 * j + 1]);
        }
    return _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

static float dot_table(const uint8_t *row, const float *x, int nb)
{
    return dot(row, x, nb, q41_weights);
}

static float dot_widened(const uint8_t *row, const float *x, int nb)
{
    return dot(row, x, nb, q41_widened);
}

int main(int argc, char **argv)
{
    const int K = argc > 1 ? atoi(argv[1]) : 576, N = 576, nb = K / 32, reps = 400;
    const int nmat = argc > 2 ? atoi(argv[2]) : 1;
    const size_t mb = (size_t)N * nb * Q41_BYTES;
    uint8_t *w = aligned_alloc(64, mb * nmat);
    for (size_t i = 0; i < mb * nmat; i++)
        w[i] = (uint8_t)((i * 2654435761u) >> 13);
    for (size_t blk = 0; blk < (size_t)nmat * N * nb; blk++) { /* sane float16 d, m */
        const uint16_t d = 0x2000 + (blk % 97), m = 0xA000 + (blk % 89);
        memcpy(w + blk * Q41_BYTES, &d, 2);
        memcpy(w + blk * Q41_BYTES + 2, &m, 2);
    }
    float *x = aligned_alloc(64, K * 4);
    for (int i = 0; i < K; i++)
        x[i] = (i % 17) * 0.01f - 0.05f;
    const char *names[] = {"table  ", "widened"};
    for (int r = 0; r < 4; r++)
        for (int mode = 0; mode < 2; mode++) {
            double t = omp_get_wtime();
            float s = 0;
            for (int k = 0; k < reps; k++) {
                const size_t o = (size_t)(k % nmat) * mb;
                for (int n = 0; n < N; n++) {
                    const uint8_t *ro = w + o + (size_t)n * nb * Q41_BYTES;
                    s += mode == 0 ? dot_table(ro, x, nb) : dot_widened(ro, x, nb);
                }
            }
            t = omp_get_wtime() - t;
            printf("%s %.3f ns/block (sum %.9g)\n", names[mode],
                   t / ((double)reps * N * nb) * 1e9, s);
        }
}
