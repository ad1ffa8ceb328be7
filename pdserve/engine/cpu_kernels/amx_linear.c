/* x @ W^T in bfloat16 on Intel AMX for batched decode steps: the projections of 5-64+ rows,
 * where oneDNN's matmul measured ~600-800 GFLOP/s and ~8-12 GB/s of weights on two cores,
 * far from both the tiles' arithmetic and the memory's pace.
 *
 * Weights are packed once (al_pack) into the tiles' B layout: per 16 output columns (an
 * "N-block") and 32 inputs (a "k-step"), 16 rows of 64 bytes where row r holds, for each
 * column n, the pair W[n][2r], W[n][2r + 1]. An N-block is contiguous (K / 32 tiles of
 * 1 KiB), so a thread streams its columns' weights front to back, once per call.
 *
 * A thread takes its columns 32 at a time (two N-blocks) and x 32 rows at a time (two A
 * tiles, loaded straight from x: 32 inputs of a row are 64 contiguous bytes) into four
 * float32 accumulator tiles (C). Every tile has 16 rows, so one tile configuration serves
 * every call: al_linear copies the last partial 16 rows into a zero-padded block; al_blocks
 * (a run of output columns, inside the decode stack's parallel region) reads buffers that have
 * zeroed rows up to the next multiple of 16.
 * Products of bf16 are exact in float32 and sums are float32, as in oneDNN's bf16 matmul.
 *
 * The tiles are usable only after the process asks the kernel for them
 * (arch_prctl(ARCH_REQ_XCOMP_PERM)); al_available does that once and says whether this
 * build and this machine have them. Builds without AMX compile only the stubs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

#define KSTEP 32      /* bf16 inputs per tile row: 64 bytes */
#define NBLOCK 16     /* output columns per B tile */
#define MROWS 16      /* rows per A / C tile */

/* 1 when tiles can be used here (AMX build, CPU and kernel permission), else 0. */
int al_available(void)
{
#ifdef HAVE_AMX
    static int state = -1; /* racing first calls compute the same answer */
    if (state < 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}

/* packed [N / 16][K / 32][16][16][2] from w [N, K] (row-major); N % 16 == K % 32 == 0. */
void al_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed)
{
    const int64_t ks = K / KSTEP;
    for (int64_t nb = 0; nb < N / NBLOCK; nb++)
        for (int64_t kb = 0; kb < ks; kb++) {
            uint16_t *tile = packed + (nb * ks + kb) * (KSTEP * NBLOCK);
            for (int r = 0; r < KSTEP / 2; r++)
                for (int n = 0; n < NBLOCK; n++) {
                    const uint16_t *src = w + (nb * NBLOCK + n) * K + kb * KSTEP + 2 * r;
                    tile[(r * NBLOCK + n) * 2] = src[0];
                    tile[(r * NBLOCK + n) * 2 + 1] = src[1];
                }
        }
}

#ifdef HAVE_AMX
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tmm0-3: C (16 rows x 16 float32), tmm4-5: A (16 rows x 32 bf16), tmm6-7: B (16 rows of
 * 16 column pairs): every tile is 16 rows of 64 bytes. */
static void configure(void)
{
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* Narrows 16 float32 to bf16 (round to nearest even) at y + off. */
INLINE void store_row(uint16_t *y, int64_t off, const float *c)
{
    _mm256_storeu_si256((__m256i *)(y + off), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c)));
}

/* C tiles (m, n) for MB row blocks a[0..MB) (16 rows each, row stride lda bytes) and NB
 * N-blocks w[0..NB): tile m * 2 + n. Each A and B tile loaded serves two products, and the
 * four products of a k-step are independent, so the tiles' pipeline stays full. */
INLINE void block(const char *const *a, const int64_t *lda, const char *const *w,
                  const char *next, int64_t ks, const int MB, const int NB)
{
    _tile_zero(0);
    if (NB > 1)
        _tile_zero(1);
    if (MB > 1)
        _tile_zero(2);
    if (MB > 1 && NB > 1)
        _tile_zero(3);
    for (int64_t kb = 0; kb < ks; kb++) {
        const char *b0 = w[0] + kb * 1024, *b1 = w[NB - 1] + kb * 1024;
        if (next) /* the next columns' weights, as much per k-step as these take */
            for (int c = 0; c < NB * 1024; c += 64)
                __builtin_prefetch(next + kb * NB * 1024 + c, 0, 2);
        _tile_loadd(6, b0, 64);
        _tile_loadd(4, a[0] + kb * 64, lda[0]);
        _tile_dpbf16ps(0, 4, 6);
        if (NB > 1) {
            _tile_loadd(7, b1, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (MB > 1) {
            _tile_loadd(5, a[1] + kb * 64, lda[1]);
            _tile_dpbf16ps(2, 5, 6);
            if (NB > 1)
                _tile_dpbf16ps(3, 5, 7);
        }
    }
}
#endif

#ifdef HAVE_AMX
/* N-blocks [nb0, nb1) of y = x @ W^T (columns 16 * nb0 up to 16 * nb1). Each block's
 * sums are the same whichever run of blocks it is computed in. Rows at and past the last
 * multiple of 16 come from `tail` (16 zero-padded rows of K) when it is given; NULL: x
 * itself has readable rows up to the next multiple of 16. after: NULL, or the packed
 * weights of the N-blocks the caller computes next, prefetched during the last pair. */
static void blocks(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *tail,
                   const uint16_t *packed, int64_t K, uint16_t *y, int64_t y_stride,
                   int64_t nb0, int64_t nb1, const uint16_t *after)
{
    const int64_t ks = K / KSTEP, full = M / MROWS * MROWS;
    if (nb0 >= nb1)
        return;
    float c[4][MROWS * NBLOCK] __attribute__((aligned(64)));
    configure();
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
        const int nbs = nb + 1 < nb1 ? 2 : 1;
        const char *w[2];
        for (int j = 0; j < 2; j++)
            w[j] = (const char *)(packed + (nb + (j < nbs ? j : 0)) * ks * KSTEP * NBLOCK);
        /* the thread's next two N-blocks follow these in memory */
        const char *next = nb + 2 < nb1 ? w[0] + (int64_t)nbs * ks * 1024
                                        : (const char *)after;
        for (int64_t m0 = 0; m0 < M; m0 += 2 * MROWS) {
            const char *a[2];
            int64_t lda[2];
            int mb = 0;
            for (; mb < 2 && m0 + mb * MROWS < M; mb++) {
                const int64_t r0 = m0 + mb * MROWS;
                const int from_tail = tail && r0 >= full;
                a[mb] = from_tail ? (const char *)tail : (const char *)(x + r0 * x_stride);
                lda[mb] = (from_tail ? K : x_stride) * 2;
            }
            if (mb == 2 && nbs == 2)
                block(a, lda, w, m0 ? NULL : next, ks, 2, 2);
            else if (mb == 2)
                block(a, lda, w, m0 ? NULL : next, ks, 2, 1);
            else if (nbs == 2)
                block(a, lda, w, m0 ? NULL : next, ks, 1, 2);
            else
                block(a, lda, w, m0 ? NULL : next, ks, 1, 1);
            _tile_stored(0, c[0], 64);
            if (nbs > 1)
                _tile_stored(1, c[1], 64);
            if (mb > 1)
                _tile_stored(2, c[2], 64);
            if (mb > 1 && nbs > 1)
                _tile_stored(3, c[3], 64);
            for (int ct = 0; ct < 2 * mb; ct++) { /* C tile ct: row block ct / 2, column ct % 2 */
                const int ti = ct / 2, tn = ct % 2;
                if (tn >= nbs)
                    continue;
                for (int r = 0; r < MROWS && m0 + ti * MROWS + r < M; r++)
                    store_row(y, (m0 + ti * MROWS + r) * y_stride + (nb + tn) * NBLOCK,
                              c[ct] + r * NBLOCK);
            }
        }
    }
    _tile_release();
}
#endif

/* Output columns [16 * nb0, 16 * nb1) of al_linear, for one thread of an enclosing parallel
 * region (the decode stack's, which hands the blocks out): x must have readable rows up to
 * the next multiple of 16 past M (their products land in no output row); y [M, N] has row
 * stride y_stride. next_nb: the first N-block of the run this thread computes next (its
 * weights are prefetched), or -1. */
void al_blocks(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
               int64_t K, uint16_t *y, int64_t y_stride, int64_t nb0, int64_t nb1,
               int64_t next_nb)
{
#ifdef HAVE_AMX
    blocks(x, x_stride, M, NULL, packed, K, y, y_stride, nb0, nb1,
           next_nb < 0 ? NULL : packed + next_nb * (K / KSTEP) * KSTEP * NBLOCK);
#else
    (void)x, (void)x_stride, (void)M, (void)packed, (void)K, (void)y, (void)y_stride,
        (void)nb0, (void)nb1, (void)next_nb;
#endif
}

/* y [M, N] (bf16, row stride N) = x [M, K] (bf16, row stride x_stride elements) @ W^T
 * with W packed by al_pack. Returns 0; -1 when AMX is unavailable or scratch memory could
 * not be had (nothing written). */
int al_linear(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
              int64_t N, int64_t K, uint16_t *y, int num_threads)
{
#ifdef HAVE_AMX
    if (!al_available())
        return -1;
    const int64_t nblocks = N / NBLOCK, full = M / MROWS * MROWS, rest = M - full;
    /* the last partial 16 rows, zero-padded, so every A tile has 16 rows */
    uint16_t *tail = NULL;
    if (rest) {
        tail = calloc((size_t)MROWS * K, sizeof(uint16_t));
        if (!tail)
            return -1;
        for (int64_t r = 0; r < rest; r++)
            memcpy(tail + r * K, x + (full + r) * x_stride, (size_t)K * sizeof(uint16_t));
    }
#pragma omp parallel num_threads(threads_for(nblocks, num_threads))
    {
        int64_t b0, b1;
        team_share(nblocks, &b0, &b1);
        blocks(x, x_stride, M, tail, packed, K, y, N, b0, b1, NULL);
    }
    free(tail);
    return 0;
#else
    (void)x, (void)x_stride, (void)M, (void)packed, (void)N, (void)K, (void)y,
        (void)num_threads;
    return -1;
#endif
}
