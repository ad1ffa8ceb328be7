/* bfloat16 x @ W^T for batched rows (5 and up) with AVX512-BF16's vdpbf16ps, on CPUs
 * that have it without AMX tiles (AMD's Zen 4 and 5, Intel's Cooper Lake), or with AVX2
 * FMAs on float32 widenings where the CPU has no AVX-512 at all (a section of its own
 * below): the counterpart of amx_linear.c there, for the layer loop and the decode stack's
 * batched form.
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

/* The AVX2 form: a build with AVX2 and FMA but no AVX-512 (AMD's Zen 2 and 3, Intel's
 * Haswell to Comet Lake), where torch's oneDNN has no bfloat16 matmul and F.linear ran at
 * ~20 GFLOP/s on two Zen 3 cores. An AVX-512 CPU without AVX512-BF16 keeps oneDNN's. */
#if !defined(__AVX512BF16__) && !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define BP_AVX2 1
#endif

#define PANEL 32 /* output columns per panel */
#define ROWS 12  /* rows of x per block: 24 accumulators of the 32 vector registers */

/* 1 when this build has a kernel (AVX512-BF16, or the AVX2 form), else 0 (bp_blocks and
 * bp_linear then do nothing). */
int bp_available(void)
{
#if defined(__AVX512BF16__) || defined(BP_AVX2)
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
#elif defined(BP_AVX2)
#include <immintrin.h>

/* AVX2 has no bfloat16 products: both sides are widened to float32, each exactly, and
 * multiplied with FMAs (a product of two bfloat16 is exact in float32).
 * - x is widened once per call, a chunk of rows at a time, into this thread's scratch
 *   (XF_FLOATS). Widening a row's pair in the inner loop instead (a broadcast, then a shift
 *   and an AND per row and k pair) ran at 106-110 GFLOP/s on two Zen 3 cores; from the
 *   widened rows, 173-178, the float32 panels' speed (f32_panels.c).
 * - A 32-byte load of the paired layout holds 8 columns' weights for k and k + 1, one
 *   32-bit lane per column: shifted left 16, the lane is the k weight; with its low half
 *   cleared, the k + 1 one. So no shuffle: one shift or one AND a vector.
 * - As f32_panels.c's AVX2 form, a block is half a panel (16 columns) by up to HALF_ROWS
 *   rows: 10 accumulators, 2 weight vectors, a broadcast and the AND's mask in the 16
 *   registers (6 rows spill: 84-88 GFLOP/s). All k's then all k + 1's of a pair, so only
 *   two weight vectors are live at once.
 * - A panel's later passes ask for the next panel, as the float32 ones do (common.h): a whole
 *   model's projections, alternated against no hints, 0.74 at 6 rows, 0.75 at 16, 0.83 at
 *   32, 0.90 at 64; a decode step of 9 / 16 / 32 rows in process 0.75 / 0.71 / 0.87.
 * Each output is one float32 FMA chain over k in order, rounded once to bfloat16, whatever
 * the chunk, the row block, the run of panels or the thread. */
#define HALF_ROWS 5
#define XF_FLOATS (1 << 18) /* 1 MiB of widened rows a thread: 455 rows at K = 576 */

/* The floats of a thread's scratch at this K (at least a row), and the rows it holds. */
static int64_t scratch_floats(int64_t K)
{
    return K > XF_FLOATS ? K : XF_FLOATS;
}

static int64_t chunk_rows(int64_t K)
{
    return scratch_floats(K) / K;
}

/* 8 float32 lanes to bfloat16, rounded to nearest even as f32_to_bf16 (common.h) is. */
static inline __m128i bf16x8(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    /* a NaN keeps a mantissa bit after the truncation, so it stays a NaN */
    const __m256i kept =
        _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    const __m256i h = _mm256_srli_epi32(kept, 16);
    /* packus narrows within each 128-bit half: lanes 0-3 land in qword 0, 4-7 in qword 2 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
}

/* y[r, 0:16] for the R widened rows at xf (row stride K) over one half panel. */
INLINE void half_rows(const float *xf, const uint16_t *half, int64_t K, uint16_t *y,
                      int64_t y_stride, const int R, struct panel_prefetch pf)
{
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    __m256 lo[HALF_ROWS], hi[HALF_ROWS];
    for (int r = 0; r < R; r++) {
        lo[r] = _mm256_setzero_ps();
        hi[r] = _mm256_setzero_ps();
    }
    struct prefetch_cursor cur = {0, 0};
    for (int64_t k2 = 0; k2 < K / 2; k2++) {
        panel_prefetch_step(pf, k2, K / 2, &cur);
        const __m256i *w = (const __m256i *)(half + k2 * 2 * PANEL);
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w), 16));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w + 1), 16));
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(xf + r * K + 2 * k2);
            lo[r] = _mm256_fmadd_ps(a, e0, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, e1, hi[r]);
        }
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w), odd));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w + 1), odd));
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(xf + r * K + 2 * k2 + 1);
            lo[r] = _mm256_fmadd_ps(a, o0, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, o1, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm_storeu_si128((__m128i *)(y + r * y_stride), bf16x8(lo[r]));
        _mm_storeu_si128((__m128i *)(y + r * y_stride + 8), bf16x8(hi[r]));
    }
}

/* Every widened row over one half panel, in blocks as even as HALF_ROWS allows; R a
 * constant in each call, so the loops unroll. Half h's row blocks are the panel's passes
 * after half 0's, and every pass asks for a slice of the next panel (NULL: none) as
 * f32_panels.c's do (common.h). */
static void half_panel(const float *xf, int64_t M, const uint16_t *half, int64_t K,
                       uint16_t *y, int64_t y_stride, const uint16_t *next, int h)
{
    const int64_t blocks = (M + HALF_ROWS - 1) / HALF_ROWS;
    for (int64_t b = 0, m = 0; b < blocks; b++) {
        const int64_t R = (M - m) / (blocks - b) + ((M - m) % (blocks - b) != 0);
        const float *xr = xf + m * K;
        uint16_t *yr = y + m * y_stride;
        const struct panel_prefetch pf =
            panel_prefetch_slice(next, K, 2 * blocks, h * blocks + b, K / 2);
        switch (R) {
        case 1: half_rows(xr, half, K, yr, y_stride, 1, pf); break;
        case 2: half_rows(xr, half, K, yr, y_stride, 2, pf); break;
        case 3: half_rows(xr, half, K, yr, y_stride, 3, pf); break;
        case 4: half_rows(xr, half, K, yr, y_stride, 4, pf); break;
        default: half_rows(xr, half, K, yr, y_stride, HALF_ROWS, pf); break;
        }
        m += R;
    }
}
#endif

/* This thread's scratch for bp_blocks at this K and any smaller, made now: 0, or -1 with no
 * memory. The decode stack calls it in each thread before its first projection, so a step
 * that cannot have it fails before it writes anything. */
int bp_reserve(int64_t K)
{
#ifdef BP_AVX2
    return thread_scratch((size_t)scratch_floats(K)) ? 0 : -1;
#else
    (void)K;
    return 0;
#endif
}

/* Output columns [32 * p0, 32 * p1) of y [M, N] (row stride y_stride) = x [M, K] (row
 * stride x_stride) @ W^T, W packed by bp_pack: one thread's run (the decode stack hands
 * runs out). Returns 0, or -1 with no memory for the widened rows (the AVX2 form; nothing
 * written). */
int bp_blocks(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
              int64_t K, uint16_t *y, int64_t y_stride, int64_t p0, int64_t p1, int64_t panels)
{
#ifdef __AVX512BF16__
    (void)panels;
    for (int64_t p = p0; p < p1; p++)
        panel_all_rows(x, x_stride, M, packed + p * K * PANEL, K, y + p * PANEL, y_stride);
#elif defined(BP_AVX2)
    const int64_t rows = chunk_rows(K);
    float *xf = thread_scratch((size_t)scratch_floats(K));
    if (!xf)
        return -1;
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t c = M - m0 < rows ? M - m0 : rows;
        for (int64_t r = 0; r < c; r++)
            for (int64_t k = 0; k < K; k++)
                xf[r * K + k] = bf16_to_f32(x[(m0 + r) * x_stride + k]);
        for (int64_t p = p0; p < p1; p++) {
            const uint16_t *panel = packed + p * K * PANEL;
            const uint16_t *next = p + 1 < panels ? panel + K * PANEL : NULL;
            for (int h = 0; h < 2; h++) /* a half is 32 elements into a k pair's row */
                half_panel(xf, c, panel + 32 * h, K, y + m0 * y_stride + p * PANEL + 16 * h,
                           y_stride, next, h);
        }
    }
#else
    (void)x, (void)x_stride, (void)M, (void)packed, (void)K, (void)y, (void)y_stride, (void)p0,
        (void)p1, (void)panels;
#endif
    return 0;
}

/* y [M, N] (contiguous) = x [M, K] @ W^T over the packed panels, each thread a contiguous
 * run of panels. Returns 0; -1 where this build lacks the kernel (nothing written); -2 no
 * memory for the widened rows (the AVX2 form). */
int bp_linear(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
              int64_t N, int64_t K, uint16_t *y, int num_threads)
{
    if (!bp_available())
        return -1;
    const int64_t panels = N / PANEL;
    int rc = 0;
#pragma omp parallel num_threads(threads_for(panels, num_threads))
    {
        int64_t p0, p1;
        team_share(panels, &p0, &p1);
        if (bp_blocks(x, x_stride, M, packed, K, y, N, p0, p1, panels))
            __atomic_store_n(&rc, -2, __ATOMIC_RELAXED);
    }
    return rc;
}
