/* What the CPU kernels share: the dtype codes every entry point takes (library.py's
 * DTYPE_CODES holds the same table for Python), bfloat16 <-> float32, INLINE, a thread's
 * place in its OpenMP team and its scratch, and the range-clamped exponentials of the
 * softmax and SiLU loops.
 * A bfloat16 is the upper half of a float32: widening is a shift, narrowing rounds to
 * nearest even as torch does. */
#ifndef PDSERVE_CPU_KERNELS_COMMON_H
#define PDSERVE_CPU_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define DT_F32 0
#define DT_BF16 1
/* weights kept as GGUF blocks (q4_blocks.c): Q4_1, Q8_0 */
#define BLOCKS_Q4_1 1
#define BLOCKS_Q8_0 2
#define INLINE static inline __attribute__((always_inline))

/* This thread's number in its parallel region, and the region's team size (0 and 1 in a
 * build without OpenMP). */
static inline int team_thread(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int team_size(void)
{
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* For a product over `units` independent runs of output (the packed kernels' panels or
 * N-blocks): the threads to ask for (num_threads, no more than the units, at least one),
 * and in the region this thread's contiguous share [*u0, *u1), so each thread streams one
 * run of the packed weights. */
static inline int threads_for(int64_t units, int num_threads)
{
    const int n = num_threads > units ? (int)units : num_threads;
    return n < 1 ? 1 : n;
}

static inline void team_share(int64_t units, int64_t *u0, int64_t *u1)
{
    const int64_t t = team_thread(), nt = team_size();
    *u0 = units * t / nt;
    *u1 = units * (t + 1) / nt;
}

/* The panels' next-panel prefetch (f32_panels.c, bf16_panels.c): a panel's first pass over
 * its rows waits on memory and its later passes (from L2) on the FMAs, so each pass, the
 * first too, asks for a slice of the next panel's lines, spread evenly over its loop, and
 * the next panel's stream overlaps this one's arithmetic. A pass's slice: */
struct panel_prefetch {
    const char *at; /* the slice's first line; NULL: nothing to ask for */
    int64_t lines;  /* lines in the slice */
    int64_t every;  /* iterations of the pass's loop per line asked for (at least 1) */
};

/* Pass `pass` (from 0) of `passes` over a panel, each a loop of n iterations, whose next
 * panel of `panel_lines` 64-byte lines is at `next` (NULL: none). */
static inline struct panel_prefetch panel_prefetch_slice(const void *next, int64_t panel_lines,
                                                         int64_t passes, int64_t pass,
                                                         int64_t n)
{
    const int64_t lines = (panel_lines + passes - 1) / passes;
    const struct panel_prefetch s = {next ? (const char *)next + 64 * lines * pass : NULL,
                                     lines, lines < n ? n / lines : 1};
    return s;
}

/* Where a pass is in its slice: the next iteration that asks, and the next line. */
struct prefetch_cursor {
    int64_t due, line;
};

/* Iteration i of a pass's loop of n: asks for the slice's lines one every `every`
 * iterations from i = 0 (two an iteration where the slice has more than n lines). The
 * cursor starts at {0, 0} and is the pass's own (counters, not a division: one every few
 * iterations cost 6-18 % of the pass). */
INLINE void panel_prefetch_step(struct panel_prefetch s, int64_t i, int64_t n,
                                struct prefetch_cursor *c)
{
    if (!s.at || i != c->due)
        return;
    if (c->line < s.lines)
        __builtin_prefetch(s.at + 64 * c->line++, 0, 3);
    if (n + i < s.lines)
        __builtin_prefetch(s.at + 64 * (n + i), 0, 3);
    c->due += s.every;
}

/* This thread's scratch of at least `floats` floats, grown when asked for more and kept for
 * the thread's life (NULL: no memory). One buffer per source file that calls it (the
 * function is static), so two kernels' scratches never share memory. */
static inline float *thread_scratch(size_t floats)
{
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        free(buf);
        buf = malloc(floats * sizeof(float));
        cap = buf ? floats : 0;
    }
    return buf;
}

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a NaN after truncation */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* A float32 sum into element `at` of y (dtype dt), rounded once for bfloat16. */
static inline void store_sum(void *y, int64_t at, float v, int dt)
{
    if (dt == DT_F32)
        ((float *)y)[at] = v;
    else
        ((uint16_t *)y)[at] = f32_to_bf16(v);
}

/* Eight floats as one value, for the portable loops that must keep their accumulators in
 * registers (written as float arrays indexed in an inner loop, gcc left them on the stack):
 * gcc lowers a vf8 to one AVX register, or two SSE ones. Loads and stores go through
 * memcpy, so no alignment is assumed. */
typedef float vf8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));

static inline vf8 load8(const float *p)
{
    vf8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, vf8 v)
{
    memcpy(p, &v, sizeof v);
}

/* Elements d..d+7 of a float32 or bfloat16 row, as float32. */
static inline vf8 load8_dt(const void *row, int64_t d, int dt)
{
    if (dt == DT_F32)
        return load8((const float *)row + d);
    vh8 h;
    memcpy(&h, (const uint16_t *)row + d, sizeof h);
    const vu8 u = __builtin_convertvector(h, vu8) << 16;
    vf8 v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The sum of a vector's 8 floats (an AVX2 __m256 is one too): the halves added, then
 * their halves, then the last two. */
static inline float hsum_vf8(vf8 v)
{
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* A dot product's U accumulators added in order, acc[0] first, then hsum_vf8. Each partial
 * sum passes an empty asm, which -ffast-math cannot re-associate across: left free, gcc
 * added four accumulators as (a1 + a2 + a3) + a0 where a tail loop followed and as
 * (a0 + a1) + (a2 + a3) where none did, so two dot products written apart (gemv.c's over
 * rows, q4_blocks.c's over blocks) summed the same products differently. */
static inline float fold_vf8(const vf8 *acc, int U)
{
    vf8 s = acc[0];
    for (int u = 1; u < U; u++) {
        s += acc[u];
        __asm__("" : "+v"(s));
    }
    return hsum_vf8(s);
}

#ifdef __AVX512F__
typedef float vf16 __attribute__((vector_size(64)));

/* fold_vf8's order for AVX-512's accumulators: acc[0] + acc[1] + ..., each partial sum
 * through an empty asm (the caller adds the lanes). Left free, gcc added four of them as
 * a0 + ((a1 + a2) + a3) in gemv.c and q4_blocks.c alike only while their loops had the same
 * shape: a Q4_1 layout tried in session 34 reshaped the blocks' loops, gcc added
 * (a1 + a3) + (a0 + a2) there, and the two GEMVs no longer agreed bit for bit. */
static inline vf16 fold_vf16(const vf16 *acc, int U)
{
    vf16 s = acc[0];
    for (int u = 1; u < U; u++) {
        s += acc[u];
        __asm__("" : "+v"(s));
    }
    return s;
}
#endif

/* Element i of a float32 or bfloat16 row, as float32 (the scalar tails of the vector loops). */
static inline float at_dt(const void *row, int64_t i, int dt)
{
    return dt == DT_F32 ? ((const float *)row)[i] : bf16_to_f32(((const uint16_t *)row)[i]);
}

/* glibc's vector exp2f / expf (libmvec: what the `omp simd` loops call under -ffast-math)
 * hand the whole vector to a scalar fallback when any one lane is outside the range whose
 * result is a normal float (|x| > 126 for exp2f, > ~88 for expf): 5-8x the time per
 * element. Softmax meets that on every masked score and every peaked row, SiLU on any gate
 * past +-88 (SmolLM2 has them: silu_mul ran at 0.8 ms for 64 rows instead of 40 us). The
 * argument is clamped so every lane stays on the fast path. */

/* 2^x for x <= 0 (a softmax weight): 0 below -126, where it underflows anyway. */
static inline float exp2_weight(float x)
{
    const float e = exp2f(fmaxf(x, -126.f));
    return x < -126.f ? 0.f : e;
}

/* x * sigmoid(x); past +-80 the result is x or 0 to float precision (|x| e^-80 < 2e-35). */
static inline float silu(float x)
{
    return x / (1.f + expf(fminf(fmaxf(-x, -80.f), 80.f)));
}

#endif
