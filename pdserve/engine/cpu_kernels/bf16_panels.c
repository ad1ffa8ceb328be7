/* bfloat16 x @ W^T for batched decode rows (5-64) with AVX512-BF16's vdpbf16ps, on CPUs
 * that have it without AMX tiles (AMD's Zen 4 and 5, Intel's Cooper Lake): the counterpart
 * of amx_linear.c there, for the layer loop and the decode stack's batched form.
 *
 * W [N, K] (K even) is packed once (bp_pack) into panels of 32 output columns, k-pair
 * major: [N / 32][K / 2][32][2], so that one 64-byte vector holds 16 columns' weights for
 * two consecutive k, as vdpbf16ps pairs them. For a block of up to 12 rows of x and one
 * panel, every k pair loads the panel's two vectors and broadcasts each row's (x[2k],
 * x[2k+1]) into 24 accumulators, as f32_panels.c does per k: 24 vdpbf16ps (64 multiply-adds
 * each) to 2 loads and 12 broadcasts.
 *
 * Each output is one float32 chain over the k pairs in order, rounded to bfloat16 once,
 * whatever the row block, the run of panels or the thread: the layer loop and the decode
 * stack get the same bits. Why not oneDNN's matmul: per call it is as fast (both run the
 * vdpbf16ps units near their peak at 64 rows), but this one runs inside the decode stack's
 * one parallel region, where a bfloat16 step has no Python, no per-op dispatch and no
 * region per op (docs/benchmarks.md section 6, session 19).
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

#define PANEL 32 /* output columns per panel */
#define ROWS 12  /* rows of x per block: 24 accumulators of the 32 vector registers */

/* 1 when this build has the kernel (AVX512-BF16), else 0 (bp_blocks and bp_linear then do
 * nothing). */
int bp_available(void)
{
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* w [N, K] bfloat16 (N % 32 == 0, K even) into panels [N / 32][K / 2][32][2]. */
void bp_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed)
{
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t k2 = 0; k2 < K / 2; k2++)
            for (int j = 0; j < PANEL; j++)
                for (int e = 0; e < 2; e++)
                    packed[((p * (K / 2) + k2) * PANEL + j) * 2 + e] =
                        w[(p * PANEL + j) * K + 2 * k2 + e];
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* y[r, 0:32] for the R rows at x (row stride x_stride) over one panel. */
INLINE void panel_rows(const uint16_t *x, int64_t x_stride, const uint16_t *panel, int64_t K,
                       uint16_t *y, int64_t y_stride, const int R)
{
    __m512 lo[ROWS], hi[ROWS];
    for (int r = 0; r < R; r++) {
        lo[r] = _mm512_setzero_ps();
        hi[r] = _mm512_setzero_ps();
    }
    for (int64_t k2 = 0; k2 < K / 2; k2++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * PANEL + PANEL);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + 2 * k2, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            lo[r] = _mm512_dpbf16_ps(lo[r], a, w0);
            hi[r] = _mm512_dpbf16_ps(hi[r], a, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i *)(y + r * y_stride), (__m256i)_mm512_cvtneps_pbh(lo[r]));
        _mm256_storeu_si256((__m256i *)(y + r * y_stride + 16),
                            (__m256i)_mm512_cvtneps_pbh(hi[r]));
    }
}

/* Every row of x over one panel, in blocks as even as ROWS allows (16 rows as 8 + 8, not
 * 12 + 4); R a constant in each call, so the loops unroll. */
static void panel_all_rows(const uint16_t *x, int64_t x_stride, int64_t M,
                           const uint16_t *panel, int64_t K, uint16_t *y, int64_t y_stride)
{
    const int64_t blocks = (M + ROWS - 1) / ROWS;
    for (int64_t b = 0, m = 0; b < blocks; b++) {
        const int64_t R = (M - m) / (blocks - b) + ((M - m) % (blocks - b) != 0);
        const uint16_t *xr = x + m * x_stride;
        uint16_t *yr = y + m * y_stride;
        switch (R) {
#define CASE(n)                                                                               \
    case n: panel_rows(xr, x_stride, panel, K, yr, y_stride, n); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10)
            CASE(11)
#undef CASE
        default: panel_rows(xr, x_stride, panel, K, yr, y_stride, ROWS); break;
        }
        m += R;
    }
}
#endif

/* Output columns [32 * p0, 32 * p1) of y [M, N] (row stride y_stride) = x [M, K] (row
 * stride x_stride) @ W^T, W packed by bp_pack: one thread's run (the decode stack hands
 * runs out). */
void bp_blocks(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
               int64_t K, uint16_t *y, int64_t y_stride, int64_t p0, int64_t p1)
{
#ifdef __AVX512BF16__
    for (int64_t p = p0; p < p1; p++)
        panel_all_rows(x, x_stride, M, packed + p * K * PANEL, K, y + p * PANEL, y_stride);
#else
    (void)x, (void)x_stride, (void)M, (void)packed, (void)K, (void)y, (void)y_stride, (void)p0,
        (void)p1;
#endif
}

/* y [M, N] (contiguous) = x [M, K] @ W^T over the packed panels, each thread a contiguous
 * run of panels. Returns 0, or -1 where this build lacks the kernel (nothing written). */
int bp_linear(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
              int64_t N, int64_t K, uint16_t *y, int num_threads)
{
    if (!bp_available())
        return -1;
    const int64_t panels = N / PANEL;
#pragma omp parallel num_threads(threads_for(panels, num_threads))
    {
        int64_t p0, p1;
        team_share(panels, &p0, &p1);
        bp_blocks(x, x_stride, M, packed, K, y, N, p0, p1);
    }
    return 0;
}
