/* float32 x @ W^T for batched decode rows (5-64) on AVX-512 FMA, or on AVX2 with FMA (a
 * section of its own below): the float32 counterpart of amx_linear.c, for the layer loop
 * and the decode stack's batched form.
 *
 * W [N, K] is packed once (fp_pack) into panels of 32 output columns, k-major:
 * [N / 32][K][32]. For a block of up to 12 rows of x and one panel, every k loads the
 * panel's 32 weights (two 64-byte vectors) and broadcasts the block's 12 inputs into 24
 * accumulators: 24 FMAs to 2 loads and 12 broadcasts, so the FMA units, not the loads, set
 * the pace. A panel (K x 128 bytes) stays in L2 while every row block passes over it.
 *
 * Each output is one float32 FMA chain over k in order, whatever the row block, the run
 * of panels or the thread: the layer loop and the decode stack get the same bits.
 * Why not oneDNN's matmul: the decode stack can call this inside its one parallel region,
 * which made a whole float32 step of 8-64 rows 0.56-0.80x the layer loop's (session 14),
 * and with its prefetch into L2 it is also faster per call: 1.17-1.48x oneDNN at 8-64 rows
 * (`python -m pdserve.bench.cpu_linear`, docs/benchmarks.md section 6, session 15).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define PANEL 32 /* output columns per panel */
#define ROWS 12  /* rows of x per block: 24 accumulators of the 32 vector registers */
#define PREFETCH_AHEAD 16384 /* bytes of a panel's stream asked into L2 ahead (panel_rows) */

/* 1 when this build has a kernel (AVX-512, or AVX2 with FMA), else 0 (fp_blocks and
 * fp_linear do nothing). */
int fp_available(void)
{
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

/* w [N, K] float32 (N % 32 == 0) into panels [N / 32][K][32]. */
void fp_pack(const float *w, int64_t N, int64_t K, float *packed)
{
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < PANEL; j++)
                packed[(p * K + k) * PANEL + j] = w[(p * PANEL + j) * K + k];
}

#ifdef __AVX512F__
#include <immintrin.h>

/* y[r, 0:32] for the R rows at x (row stride x_stride) over one panel. pf: this is the
 * panel's first row block, the pass that brings it from memory: the weights PREFETCH_AHEAD
 * bytes on (this panel's later k, then the next panel's first) are asked into L2 as it
 * goes, so the stream keeps more loads in flight than the L1's miss buffers hold; later
 * blocks find the panel in L2. A float32 decode step over the stack, alternated step by
 * step with the kernel without it (docs/benchmarks.md section 6, session 15): 8 rows
 * 0.76, 32 rows 0.86, 64 rows 0.92 (8 and 32 KiB ahead: the same within the noise). */
INLINE void panel_rows(const float *x, int64_t x_stride, const float *panel, int64_t K,
                       float *y, int64_t y_stride, const int R, const int pf)
{
    __m512 lo[ROWS], hi[ROWS];
    for (int r = 0; r < R; r++) {
        lo[r] = _mm512_setzero_ps();
        hi[r] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_loadu_ps(panel + k * PANEL);
        const __m512 w1 = _mm512_loadu_ps(panel + k * PANEL + 16);
        if (pf) {
            const char *ahead = (const char *)(panel + k * PANEL) + PREFETCH_AHEAD;
            _mm_prefetch(ahead, _MM_HINT_T1);
            _mm_prefetch(ahead + 64, _MM_HINT_T1);
        }
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(x[r * x_stride + k]);
            lo[r] = _mm512_fmadd_ps(a, w0, lo[r]);
            hi[r] = _mm512_fmadd_ps(a, w1, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * y_stride, lo[r]);
        _mm512_storeu_ps(y + r * y_stride + 16, hi[r]);
    }
}

/* The last M % 12 rows: R a constant in each case, so the loops above unroll. */
static void rest_rows(const float *x, int64_t x_stride, const float *panel, int64_t K, float *y,
                      int64_t y_stride, int R, int pf)
{
    switch (R) {
#define CASE(n)                                                                               \
    case n:                                                                                   \
        if (pf)                                                                               \
            panel_rows(x, x_stride, panel, K, y, y_stride, n, 1);                             \
        else                                                                                  \
            panel_rows(x, x_stride, panel, K, y, y_stride, n, 0);                             \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10)
        CASE(11)
#undef CASE
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2 has 16 vector registers: a block is half a panel (16 columns, two 32-byte vectors)
 * by up to HALF_ROWS rows, 12 accumulators; per k, 2 loads and 6 broadcasts feed 12 FMAs.
 * The same panels and the same chain per output over k in order as the AVX-512 kernel, so
 * both give the same bits. A panel's first pass waits on memory and its later passes on
 * the FMAs; every pass asks for a slice of the next panel (fp_blocks), spread evenly, so
 * the two overlap. No hint for the streaming pass's own panel: on Zen 3 every hint fills
 * L1, and the GEMV's ahead of its own stream cost 1.08-1.17x (gemv.c). A whole model's
 * projections on two Zen 3 cores, alternated against no hints (docs/bench/cpu-s30/
 * panels_ab.c): 0.70 at 6 rows, 0.71 at 9, 0.78 at 16, 0.83 at 32, 0.99 at 64, with the
 * later passes asking (session 30); the streaming pass asking too, against that: 0.85 at 6
 * rows, 0.84 at 9, 0.98-1.01 from 16 on (docs/benchmarks.md section 6, session 32). */
#define HALF_ROWS 6

INLINE void half_rows(const float *x, int64_t x_stride, const float *half, int64_t K, float *y,
                      int64_t y_stride, const int R, struct panel_prefetch pf)
{
    __m256 lo[HALF_ROWS], hi[HALF_ROWS];
    for (int r = 0; r < R; r++) {
        lo[r] = _mm256_setzero_ps();
        hi[r] = _mm256_setzero_ps();
    }
    struct prefetch_cursor cur = {0, 0};
    for (int64_t k = 0; k < K; k++) {
        panel_prefetch_step(pf, k, K, &cur);
        const __m256 w0 = _mm256_loadu_ps(half + k * PANEL);
        const __m256 w1 = _mm256_loadu_ps(half + k * PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * x_stride + k);
            lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * y_stride, lo[r]);
        _mm256_storeu_ps(y + r * y_stride + 8, hi[r]);
    }
}

/* Every row of x over one half panel, in blocks as even as HALF_ROWS allows (16 rows as
 * 6 + 5 + 5, not 6 + 6 + 4); R a constant in each call, so the loops unroll. Half h's
 * row blocks are the panel's passes after half 0's: the very first streams the panel, and
 * each, that one too, asks for a slice of the next panel (next: NULL for none). */
static void half_panel(const float *x, int64_t x_stride, int64_t M, const float *half,
                       int64_t K, float *y, int64_t y_stride, const float *next, int h)
{
    const int64_t blocks = (M + HALF_ROWS - 1) / HALF_ROWS;
    for (int64_t b = 0, m = 0; b < blocks; b++) {
        const int64_t R = (M - m) / (blocks - b) + ((M - m) % (blocks - b) != 0);
        const float *xr = x + m * x_stride;
        float *yr = y + m * y_stride;
        const struct panel_prefetch pf =
            panel_prefetch_slice(next, 2 * K, 2 * blocks, h * blocks + b, K);
        switch (R) {
        case 1: half_rows(xr, x_stride, half, K, yr, y_stride, 1, pf); break;
        case 2: half_rows(xr, x_stride, half, K, yr, y_stride, 2, pf); break;
        case 3: half_rows(xr, x_stride, half, K, yr, y_stride, 3, pf); break;
        case 4: half_rows(xr, x_stride, half, K, yr, y_stride, 4, pf); break;
        case 5: half_rows(xr, x_stride, half, K, yr, y_stride, 5, pf); break;
        default: half_rows(xr, x_stride, half, K, yr, y_stride, HALF_ROWS, pf); break;
        }
        m += R;
    }
}
#endif

/* Output columns [32 * p0, 32 * p1) of y [M, N] (row stride y_stride) = x [M, K] (row
 * stride x_stride) @ W^T, W packed by fp_pack: one thread's run (the decode stack hands
 * runs out). */
void fp_blocks(const float *x, int64_t x_stride, int64_t M, const float *packed, int64_t K,
               float *y, int64_t y_stride, int64_t p0, int64_t p1, int64_t panels)
{
#ifdef __AVX512F__
    (void)panels;
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = packed + p * K * PANEL;
        int64_t m = 0;
        for (; m + ROWS <= M; m += ROWS) {
            if (m == 0)
                panel_rows(x, x_stride, panel, K, y + p * PANEL, y_stride, ROWS, 1);
            else
                panel_rows(x + m * x_stride, x_stride, panel, K, y + m * y_stride + p * PANEL,
                           y_stride, ROWS, 0);
        }
        if (m < M)
            rest_rows(x + m * x_stride, x_stride, panel, K, y + m * y_stride + p * PANEL,
                      y_stride, (int)(M - m), m == 0);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* a panel's passes: half 0's row blocks, then half 1's (the L2 brings both halves'
     * lines on the first: it takes lines in pairs) */
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = packed + p * K * PANEL;
        const float *next = p + 1 < panels ? panel + K * PANEL : NULL;
        for (int h = 0; h < 2; h++)
            half_panel(x, x_stride, M, panel + 16 * h, K, y + p * PANEL + 16 * h, y_stride,
                       next, h);
    }
#else
    (void)x, (void)x_stride, (void)M, (void)packed, (void)K, (void)y, (void)y_stride, (void)p0,
        (void)p1, (void)panels;
#endif
}

/* y [M, N] (contiguous) = x [M, K] @ W^T over the packed panels, each thread a contiguous
 * run of panels. Returns 0, or -1 where this build lacks the kernel (nothing written). */
int fp_linear(const float *x, int64_t x_stride, int64_t M, const float *packed, int64_t N,
              int64_t K, float *y, int num_threads)
{
    if (!fp_available())
        return -1;
    const int64_t panels = N / PANEL;
#pragma omp parallel num_threads(threads_for(panels, num_threads))
    {
        int64_t p0, p1;
        team_share(panels, &p0, &p1);
        fp_blocks(x, x_stride, M, packed, K, y, N, p0, p1, panels);
    }
    return 0;
}
