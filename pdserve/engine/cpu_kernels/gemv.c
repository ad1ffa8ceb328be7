/* y = x @ W^T for the few rows of a decode step: x [M, K], W [N, K] (the model's
 * [out, in] layout), y [M, N], M small (a handful of sequences).
 *
 * At these M a projection is a matrix-vector product: every weight byte is used M times,
 * so the step's time is the time to stream the weights from memory once. oneDNN and MKL
 * are tuned for GEMM: at M = 1 they stream SmolLM2-135M's linears at 8-14 GB/s on this
 * box against ~27 GB/s the memory gives two cores (docs/benchmarks.md section 6). Here each
 * thread walks its own contiguous run of weight rows in memory order and holds x (widened
 * to float32 once, a few KiB, in L1) against each row: a row is read from memory once for
 * up to eight rows of x, and again, from L1, for the next eight.
 *
 * Accumulation is in float32; a bfloat16 result is rounded once. bfloat16 weights are
 * widened in registers (a shift), never in memory.
 *
 * int8 weights (where a `scales` pointer is given): int8 with a float32 scale per Q8_GROUP
 * of a row, scales [N, ceil(K / Q8_GROUP)], 0.53x the bytes of bfloat16 to stream; x is
 * quantized per group too and the products summed in int32 (the section "int8 weights").
 *
 * dtype codes and bf16 conversions: common.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define XB 8 /* rows of x against one weight row per pass (their float32 copies sit in L1) */
#define PARALLEL_MIN_WEIGHTS 65536 /* below this, waking a second thread costs more */
#define Q8_GROUP 64 /* int8 weights per scale along K (pdserve.engine.layers.int8.GROUP) */

#ifdef __AVX512F__
/* The weights PREFETCH_AHEAD bytes past p, into L1: a row ends every 0.6-3 KiB and the
 * next starts where it ended, but the hardware prefetcher alone kept the stream short of
 * what memory gives (a batch-1 pass over SmolLM2-135M's weights in a C harness, two
 * threads, alternated: int8 8.8-10 -> 5.4-6.2 ms, bfloat16 13.3-14.8 -> 8.9-11.4 ms,
 * docs/benchmarks.md section 6, session 11). Past the end of w it touches nothing (a
 * prefetch does not fault). */
#define PREFETCH_AHEAD 4096
/* ... and PREFETCH_L2_AHEAD bytes past p into L2 only: two cores keep only as many loads to
 * memory in flight as their L1 miss buffers hold, so the stream waited on memory's latency;
 * the L2's own queue takes more, and lines then come to L1 from L2. A decode step over the
 * stack, this against the L1 prefetch alone, alternated step by step (docs/benchmarks.md
 * section 6, session 15): batch 1 bfloat16 0.956-0.973, float32 0.933, int8 0.971; float32
 * 3 rows 0.962, bfloat16 4 rows 0.995 (8 and 32 KiB ahead: 0.965 and 0.976 at batch 1). */
#define PREFETCH_L2_AHEAD 16384
static inline void prefetch_w(const char *p)
{
    _mm_prefetch(p + PREFETCH_AHEAD, _MM_HINT_T0);
    _mm_prefetch(p + PREFETCH_L2_AHEAD, _MM_HINT_T1);
}

/* 16 weights from row w at k (masked), widened to float32. */
INLINE __m512 load_w(const void *w, int64_t k, __mmask16 m, int dt)
{
    if (dt == DT_F32)
        return _mm512_maskz_loadu_ps(m, (const float *)w + k);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* out[b] = dot(x[b], w) over K for b < NB: one function per NB, so the accumulators are
 * a fixed set of registers. Each row of x gets U accumulators over interleaved stretches
 * of K: a dot product is a chain of dependent FMAs, and with one chain per row of x a
 * decode step at M = 1-2 waited in part on the instruction's latency (4 cycles for a
 * 512-bit FMA, ~8 for vdpbf16ps on this Xeon). Streaming 135 M weights at M = 1, both
 * versions in one process, alternated (docs/benchmarks.md section 6, session 9): bfloat16
 * 15.3 -> 13.7-14.1 ms with 2-4 chains, float32 25.3 -> 22.3-23.7 ms with 4, near the
 * ~25 GB/s two cores read. From NB x U = 4 chains on, more only costs registers. */
#define DEFINE_DOT(NB, U)                                                                     \
    static void dot_row_##NB(const void *w, const float *x, int64_t K, int dt, float *out)   \
    {                                                                                         \
        __m512 acc[NB][U];                                                                    \
        for (int b = 0; b < NB; b++)                                                          \
            for (int u = 0; u < U; u++)                                                       \
                acc[b][u] = _mm512_setzero_ps();                                              \
        int64_t k = 0;                                                                        \
        for (; k + 16 * U <= K; k += 16 * U)                                                  \
            for (int u = 0; u < U; u++) {                                                     \
                const __m512 wv = load_w(w, k + 16 * u, (__mmask16)0xffff, dt);               \
                prefetch_w((const char *)w + (k + 16 * u) * (dt == DT_F32 ? 4 : 2));          \
                for (int b = 0; b < NB; b++)                                                  \
                    acc[b][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + b * K + k + 16 * u),  \
                                                acc[b][u]);                                   \
            }                                                                                 \
        for (; k < K; k += 16) {                                                              \
            const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff                               \
                                            : (__mmask16)((1u << (K - k)) - 1);               \
            const __m512 wv = load_w(w, k, m, dt);                                            \
            for (int b = 0; b < NB; b++)                                                      \
                acc[b][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + b * K + k),      \
                                            acc[b][0]);                                       \
        }                                                                                     \
        for (int b = 0; b < NB; b++)                                                          \
            out[b] = _mm512_reduce_add_ps((__m512)fold_vf16((const vf16 *)acc[b], U));        \
    }
DEFINE_DOT(1, 4)
DEFINE_DOT(2, 2)
DEFINE_DOT(3, 1)
DEFINE_DOT(4, 1)
DEFINE_DOT(5, 1)
DEFINE_DOT(6, 1)
DEFINE_DOT(7, 1)
DEFINE_DOT(8, 1)

#ifdef __AVX512BF16__
/* bfloat16 x bfloat16 with vdpbf16ps: 32 weights a step, x kept in bfloat16 (X_BF16);
 * U accumulators per row of x, as above.
 * BF16_PREFETCH(NB): whether a dot over NB rows of x asks for the weights ahead
 * (prefetch_w). On AMD's Zen 4 (gcc's -march=native names AMD's cores znverN; this gcc
 * calls Zen 4 znver3 with AVX-512) a batch-1 bfloat16 decode step was faster with the
 * hardware prefetchers alone, and slower without ours from 2 rows on: this tree against the
 * one with the prefetch, alternated step by step (docs/benchmarks.md section 6, session
 * 19): batch 1 0.91-0.92; batch 4 1.24 with no prefetch in any row count. */
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define BF16_PREFETCH(NB) ((NB) > 1)
#else
#define BF16_PREFETCH(NB) 1
#endif
#define X_BF16 1
#define DEFINE_DOT_BF16(NB, U)                                                                \
    static void dot_bf16_##NB(const void *wv_, const void *xv_, int64_t K, float *out)       \
    {                                                                                         \
        const uint16_t *w = wv_, *x = xv_;                                                    \
        __m512 acc[NB][U];                                                                    \
        for (int b = 0; b < NB; b++)                                                          \
            for (int u = 0; u < U; u++)                                                       \
                acc[b][u] = _mm512_setzero_ps();                                              \
        int64_t k = 0;                                                                        \
        for (; k + 32 * U <= K; k += 32 * U)                                                  \
            for (int u = 0; u < U; u++) {                                                     \
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);             \
                if (BF16_PREFETCH(NB))                                                        \
                    prefetch_w((const char *)(w + k + 32 * u));                               \
                for (int b = 0; b < NB; b++)                                                  \
                    acc[b][u] = _mm512_dpbf16_ps(                                             \
                        acc[b][u], wv, (__m512bh)_mm512_loadu_si512(x + b * K + k + 32 * u)); \
            }                                                                                 \
        for (; k < K; k += 32) {                                                              \
            const __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu                          \
                                             : (__mmask32)((1ull << (K - k)) - 1);            \
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);                 \
            for (int b = 0; b < NB; b++)                                                      \
                acc[b][0] = _mm512_dpbf16_ps(                                                 \
                    acc[b][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x + b * K + k));     \
        }                                                                                     \
        for (int b = 0; b < NB; b++)                                                          \
            out[b] = _mm512_reduce_add_ps((__m512)fold_vf16((const vf16 *)acc[b], U));        \
    }
DEFINE_DOT_BF16(1, 4)
DEFINE_DOT_BF16(2, 2)
DEFINE_DOT_BF16(3, 1)
DEFINE_DOT_BF16(4, 1)
DEFINE_DOT_BF16(5, 1)
DEFINE_DOT_BF16(6, 1)
DEFINE_DOT_BF16(7, 1)
DEFINE_DOT_BF16(8, 1)
#endif

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (AMD's Zen 2 and 3, Intel before AVX-512): the same dot products, 8 weights a
 * vector. The portable loop below computes one row of x at a time, re-reading the weight
 * row per row of x, with one chain of adds. Against it, a float32 decode step of
 * SmolLM2-135M on two Zen 3 cores: 0.76x at 4 rows, the same at 1 row (1.00-1.03x; both
 * read the weights at ~26 GB/s of the ~31 the memory gives). The AVX-512 section's
 * prefetches (into L1 4 and 16 KiB ahead) made that step 1.17x slower here, one 2 KiB
 * ahead 1.08x, 1 KiB 1.00x: float32 takes none. bfloat16 and int8, more work per byte,
 * gain from one 1-2 KiB ahead (BF16_PREFETCH_AHEAD; docs/benchmarks.md section 6,
 * session 18). */
/* As the AVX-512 DEFINE_DOT, for float32 weights (bfloat16 ones take DEFINE_DOT_BF16_SPLIT's
 * below): NB rows of x, U chains each; the last K % 8 in scalar code. Two chains a row at
 * three and four rows, where AVX-512 keeps one: the GGUF blocks' GEMV (q4_blocks.c) sums
 * in this order, and at one chain a row it waited on the FMA's latency there (its block of
 * 32 weights is four dependent FMAs a chain; q4_blocks.c). */
#define DEFINE_DOT8(NB, U)                                                                    \
    static void dot_row_##NB(const void *w_, const float *x, int64_t K, int dt, float *out)  \
    {                                                                                         \
        const float *w = w_;                                                                  \
        (void)dt;                                                                             \
        __m256 acc[NB][U];                                                                    \
        for (int b = 0; b < NB; b++)                                                          \
            for (int u = 0; u < U; u++)                                                       \
                acc[b][u] = _mm256_setzero_ps();                                              \
        int64_t k = 0;                                                                        \
        for (; k + 8 * U <= K; k += 8 * U) {                                                  \
            for (int u = 0; u < U; u++) {                                                     \
                const __m256 wv = _mm256_loadu_ps(w + k + 8 * u);                             \
                for (int b = 0; b < NB; b++)                                                  \
                    acc[b][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * K + k + 8 * u),   \
                                                acc[b][u]);                                   \
            }                                                                                 \
        }                                                                                     \
        for (; k + 8 <= K; k += 8) {                                                          \
            const __m256 wv = _mm256_loadu_ps(w + k);                                         \
            for (int b = 0; b < NB; b++)                                                      \
                acc[b][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * K + k), acc[b][0]);   \
        }                                                                                     \
        for (int b = 0; b < NB; b++) {                                                        \
            float s = fold_vf8(acc[b], U);                                                    \
            for (int64_t j = k; j < K; j++)                                                   \
                s += w[j] * x[b * K + j];                                                     \
            out[b] = s;                                                                       \
        }                                                                                     \
    }
DEFINE_DOT8(1, 4)
DEFINE_DOT8(2, 2)
DEFINE_DOT8(3, 2)
DEFINE_DOT8(4, 2)
DEFINE_DOT8(5, 1)
DEFINE_DOT8(6, 1)
DEFINE_DOT8(7, 1)
DEFINE_DOT8(8, 1)

/* bfloat16 weights, 16 at a time: a 32-byte load holds them in pairs, so a shift by 16
 * gives the even ones as float32 and an AND the odd ones, against x widened in the same
 * split order (gv_widen, X_SPLIT16): one load, a shift and an AND for 16 weights, where
 * widening 8 at a time takes two loads, two widenings and two shifts. E accumulators per
 * row of x (the even and the odd products apart, or together), U blocks of 16 a pass; the
 * last K % 16, left in order by gv_widen, in scalar code. A bfloat16 decode step against
 * 8 at a time (step_ab.py, Zen 3): 0.983-0.989 at 1 row, 0.930 at 4 (docs/benchmarks.md
 * section 6, session 18). */
#define X_SPLIT16 1
/* How far ahead the bfloat16 and int8 dot products ask for their weights (into L1, one hint
 * per 64 bytes). These do more work per byte than float32's, and without the hint a core
 * kept fewer loads to memory in flight: one core's GEMV read float32 weights at 16.3 GB/s,
 * bfloat16 at 13.9, int8 at 11.4. A decode step at 1 row against none (step_ab.py, Zen 3):
 * bfloat16 0.913-0.925 at 1 KiB ahead (512 B and 2 KiB: 1.06x and 1.05x that), int8
 * 0.89-0.905 at 1 KiB and 0.948x that at 2 KiB (4 KiB: 1.06-1.07x 2 KiB's). float32 gained
 * nothing at 1 KiB (1.00) and lost at 2 KiB and more (see above). */
#define BF16_PREFETCH_AHEAD 1024
#define DEFINE_DOT_BF16_SPLIT(NB, E, U)                                                       \
    static void dot_bf16_##NB(const void *w_, const void *x_, int64_t K, float *out)         \
    {                                                                                         \
        const uint16_t *w = w_;                                                               \
        const float *x = x_;                                                                  \
        const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);                              \
        __m256 acc[NB][E * U];                                                                \
        for (int b = 0; b < NB; b++)                                                          \
            for (int u = 0; u < E * U; u++)                                                   \
                acc[b][u] = _mm256_setzero_ps();                                              \
        const int64_t K16 = K & ~(int64_t)15;                                                 \
        int64_t k = 0;                                                                        \
        for (; k + 16 * U <= K16; k += 16 * U)                                                \
            for (int u = 0; u < U; u++) {                                                     \
                if (!(u & 1)) /* one hint per 64 bytes */                                     \
                    _mm_prefetch((const char *)(w + k + 16 * u) + BF16_PREFETCH_AHEAD,        \
                                 _MM_HINT_T0);                                                \
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k + 16 * u));     \
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));             \
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, odd));             \
                for (int b = 0; b < NB; b++) {                                                \
                    const float *xb = x + b * K + k + 16 * u;                                 \
                    acc[b][E * u] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xb), acc[b][E * u]);  \
                    acc[b][E * u + E - 1] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xb + 8),      \
                                                            acc[b][E * u + E - 1]);           \
                }                                                                             \
            }                                                                                 \
        for (; k < K16; k += 16) {                                                            \
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));                  \
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));                 \
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, odd));                 \
            for (int b = 0; b < NB; b++) {                                                    \
                acc[b][0] = _mm256_fmadd_ps(we, _mm256_loadu_ps(x + b * K + k), acc[b][0]);   \
                acc[b][0] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(x + b * K + k + 8),           \
                                            acc[b][0]);                                       \
            }                                                                                 \
        }                                                                                     \
        for (int b = 0; b < NB; b++) {                                                        \
            for (int u = 1; u < E * U; u++)                                                   \
                acc[b][0] = _mm256_add_ps(acc[b][0], acc[b][u]);                              \
            float s = hsum_vf8(acc[b][0]);                                                       \
            for (int64_t j = K16; j < K; j++)                                                 \
                s += bf16_to_f32(w[j]) * x[b * K + j];                                        \
            out[b] = s;                                                                       \
        }                                                                                     \
    }
DEFINE_DOT_BF16_SPLIT(1, 2, 2)
DEFINE_DOT_BF16_SPLIT(2, 2, 1)
DEFINE_DOT_BF16_SPLIT(3, 2, 1)
DEFINE_DOT_BF16_SPLIT(4, 2, 1)
DEFINE_DOT_BF16_SPLIT(5, 1, 1)
DEFINE_DOT_BF16_SPLIT(6, 1, 1)
DEFINE_DOT_BF16_SPLIT(7, 1, 1)
DEFINE_DOT_BF16_SPLIT(8, 1, 1)
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* Either section's dot products by rows of x; bfloat16 weights go to the section's own
 * (X_BF16: x kept in bfloat16; X_SPLIT16: x in float32, split per 16), where it has them. */
static void dot_row(const void *w, const float *x, int64_t K, int nb, int dt, float out[XB])
{
#if defined(X_BF16) || defined(X_SPLIT16)
    if (dt == DT_BF16) {
        switch (nb) {
        case 1: dot_bf16_1(w, x, K, out); break;
        case 2: dot_bf16_2(w, x, K, out); break;
        case 3: dot_bf16_3(w, x, K, out); break;
        case 4: dot_bf16_4(w, x, K, out); break;
        case 5: dot_bf16_5(w, x, K, out); break;
        case 6: dot_bf16_6(w, x, K, out); break;
        case 7: dot_bf16_7(w, x, K, out); break;
        default: dot_bf16_8(w, x, K, out); break;
        }
        return;
    }
#endif
    switch (nb) {
    case 1: dot_row_1(w, x, K, dt, out); break;
    case 2: dot_row_2(w, x, K, dt, out); break;
    case 3: dot_row_3(w, x, K, dt, out); break;
    case 4: dot_row_4(w, x, K, dt, out); break;
    case 5: dot_row_5(w, x, K, dt, out); break;
    case 6: dot_row_6(w, x, K, dt, out); break;
    case 7: dot_row_7(w, x, K, dt, out); break;
    default: dot_row_8(w, x, K, dt, out); break;
    }
}
#else
static void dot_row(const void *w, const float *x, int64_t K, int nb, int dt, float out[XB])
{
    for (int b = 0; b < nb; b++) {
        float s = 0.f;
        if (dt == DT_F32) {
            const float *wr = (const float *)w;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; k++)
                s += wr[k] * x[b * K + k];
        } else {
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; k++)
                s += at_dt(w, k, dt) * x[b * K + k];
        }
        out[b] = s;
    }
}
#endif

/* ---- int8 weights ----
 * W [N, K] as int8 q with a float32 scale sw per Q8_GROUP of a row; x quantized the same
 * way per step (gv_widen with q8): per row of x and group, xq = round(x * 127 / amax) and
 * sx = amax / 127. Then y[b, n] = sum over groups of sx * sw * (xq . q), the dot products
 * exact in int32. Where the CPU has AVX512-VNNI, vpdpbusd takes 64 of them an instruction
 * (unsigned x signed bytes: the weights are offset by 128 in registers, and each group's
 * accumulator starts at -128 * sum(xq) to take the offset back out); the float path of the
 * first version (widen 16 weights, scale, FMA) ran at 6-13 G weights/s on one core, short
 * of what memory delivers; this one 22 (docs/benchmarks.md section 6, session 11). */

static inline int64_t q8_groups(int64_t K)
{
    return (K + Q8_GROUP - 1) / Q8_GROUP;
}

/* gv_widen's q8 layout of x [M, K] in one buffer: init [M][G][16] int32 (lane 0 of each:
 * -128 * sum of the group's xq), xq [M][G * Q8_GROUP] int8 (zero past K), sx [M][G]. */
struct q8x {
    int32_t *init;
    int8_t *xq;
    float *sx;
    int64_t G;
};

static struct q8x q8x_in(void *buf, int64_t M, int64_t K)
{
    const int64_t G = q8_groups(K);
    struct q8x v = {buf, NULL, NULL, G};
    v.xq = (int8_t *)(v.init + M * G * 16);
    v.sx = (float *)(v.xq + M * G * Q8_GROUP);
    return v;
}

/* Bytes of gv_widen's buffer for x [M, K]. */
size_t gv_xbuf_bytes(int64_t M, int64_t K, int q8)
{
    if (!q8)
        return (size_t)(M * K) * sizeof(float);
    return (size_t)(M * q8_groups(K)) * (16 * sizeof(int32_t) + Q8_GROUP + sizeof(float));
}

/* One group of one row: n values of s (dtype dt) quantized into q (Q8_GROUP bytes, zero
 * past n); returns the scale, *sum the sum of q. 127 / amax is divided in double, so the
 * torch reference (pdserve.engine.layers.int8) gets the same quotient whatever the
 * compiler does to float division here. */
static float quantize_group(const void *s, int64_t n, int dt, int8_t *q, int32_t *sum)
{
    float v[Q8_GROUP], amax = 0.f;
    for (int64_t i = 0; i < n; i++) {
        v[i] = at_dt(s, i, dt);
        const float a = v[i] < 0 ? -v[i] : v[i];
        amax = a > amax ? a : amax;
    }
    memset(q, 0, Q8_GROUP);
    *sum = 0;
    if (amax == 0.f)
        return 1.f;
    const float inv = (float)(127.0 / (double)amax);
    int32_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        float r = nearbyintf(v[i] * inv); /* half to even, as torch.round */
        r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
        q[i] = (int8_t)r;
        total += q[i];
    }
    *sum = total;
    return amax / 127.f;
}

static void q8_prepare(const void *x, int64_t x_stride, void *buf, int64_t M, int64_t K, int dt)
{
    const struct q8x v = q8x_in(buf, M, K);
    const size_t es = dt == DT_F32 ? 4 : 2;
    for (int64_t b = 0; b < M; b++)
        for (int64_t g = 0; g < v.G; g++) {
            const int64_t k0 = g * Q8_GROUP, n = K - k0 < Q8_GROUP ? K - k0 : Q8_GROUP;
            const int64_t r = b * v.G + g;
            int32_t sum;
            v.sx[r] = quantize_group((const char *)x + (size_t)(b * x_stride + k0) * es, n, dt,
                                     v.xq + r * Q8_GROUP, &sum);
            memset(v.init + r * 16, 0, 16 * sizeof(int32_t));
            v.init[r * 16] = -128 * sum;
        }
}

#ifdef __AVX512VNNI__
#define DEFINE_DOT_Q8(NB)                                                                     \
    static void dot_q8_##NB(const int8_t *w, const float *sw, const struct q8x *v,           \
                            int64_t b0, int64_t K, float *out)                                \
    {                                                                                         \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                    \
        const int64_t full = K / Q8_GROUP;                                                    \
        __m512 acc[NB];                                                                       \
        for (int b = 0; b < NB; b++)                                                          \
            acc[b] = _mm512_setzero_ps();                                                     \
        for (int64_t g = 0; g < v->G; g++) {                                                  \
            __m512i wv = g < full ? _mm512_loadu_si512(w + g * Q8_GROUP)                      \
                                  : _mm512_maskz_loadu_epi8(                                  \
                                        (__mmask64)((1ull << (K - g * Q8_GROUP)) - 1),        \
                                        w + g * Q8_GROUP);                                    \
            wv = _mm512_xor_si512(wv, flip);                                                  \
            prefetch_w((const char *)(w + g * Q8_GROUP));                                     \
            for (int b = 0; b < NB; b++) {                                                    \
                const int64_t r = (b0 + b) * v->G + g;                                        \
                const __m512i d = _mm512_dpbusd_epi32(                                        \
                    _mm512_loadu_si512(v->init + r * 16), wv,                                 \
                    _mm512_loadu_si512(v->xq + r * Q8_GROUP));                                \
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d),                               \
                                         _mm512_set1_ps(sw[g] * v->sx[r]), acc[b]);           \
            }                                                                                 \
        }                                                                                     \
        for (int b = 0; b < NB; b++)                                                          \
            out[b] = _mm512_reduce_add_ps(acc[b]);                                            \
    }
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 has no vpdpbusd; vpmaddubsw multiplies unsigned by signed bytes and adds pairs into
 * saturating int16. So |w| (unsigned, at most 128) times xq with w's sign (xq is within
 * +-127): a pair is at most 2 * 128 * 127 = 32512, no saturation, and the sums stay exact;
 * vpmaddwd then adds pairs of those into int32. |w| is taken once per group for every row
 * of x. A group past K is read from a zero-padded copy (the row ends there). */
#define Q8_PREFETCH_AHEAD 2048 /* as BF16_PREFETCH_AHEAD, measured for int8 */
INLINE __m256i q8_dot32(__m256i aw, __m256i w, const int8_t *xq)
{
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

#define DEFINE_DOT_Q8(NB)                                                                     \
    static void dot_q8_##NB(const int8_t *w, const float *sw, const struct q8x *v,           \
                            int64_t b0, int64_t K, float *out)                                \
    {                                                                                         \
        const int64_t full = K / Q8_GROUP;                                                    \
        __m256 acc[NB];                                                                       \
        for (int b = 0; b < NB; b++)                                                          \
            acc[b] = _mm256_setzero_ps();                                                     \
        for (int64_t g = 0; g < v->G; g++) {                                                  \
            int8_t pad[Q8_GROUP];                                                             \
            const int8_t *wg = w + g * Q8_GROUP;                                              \
            if (g >= full) {                                                                  \
                memset(pad, 0, sizeof pad);                                                   \
                memcpy(pad, wg, (size_t)(K - g * Q8_GROUP));                                  \
                wg = pad;                                                                     \
            }                                                                                 \
            _mm_prefetch((const char *)wg + Q8_PREFETCH_AHEAD, _MM_HINT_T0);                  \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)wg);                       \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + 32));                \
            const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);       \
            for (int b = 0; b < NB; b++) {                                                    \
                const int64_t r = (b0 + b) * v->G + g;                                        \
                const int8_t *xq = v->xq + r * Q8_GROUP;                                      \
                const __m256i d = _mm256_add_epi32(q8_dot32(a0, w0, xq),                      \
                                                   q8_dot32(a1, w1, xq + 32));                \
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),                               \
                                         _mm256_set1_ps(sw[g] * v->sx[r]), acc[b]);           \
            }                                                                                 \
        }                                                                                     \
        for (int b = 0; b < NB; b++)                                                          \
            out[b] = hsum_vf8(acc[b]);                                                           \
    }
#endif

#if defined(__AVX512VNNI__) || (defined(__AVX2__) && defined(__FMA__))
DEFINE_DOT_Q8(1)
DEFINE_DOT_Q8(2)
DEFINE_DOT_Q8(3)
DEFINE_DOT_Q8(4)
DEFINE_DOT_Q8(5)
DEFINE_DOT_Q8(6)
DEFINE_DOT_Q8(7)
DEFINE_DOT_Q8(8)
static void dot_q8(const int8_t *w, const float *sw, const struct q8x *v, int64_t b0, int nb,
                   int64_t K, float out[XB])
{
    switch (nb) {
    case 1: dot_q8_1(w, sw, v, b0, K, out); break;
    case 2: dot_q8_2(w, sw, v, b0, K, out); break;
    case 3: dot_q8_3(w, sw, v, b0, K, out); break;
    case 4: dot_q8_4(w, sw, v, b0, K, out); break;
    case 5: dot_q8_5(w, sw, v, b0, K, out); break;
    case 6: dot_q8_6(w, sw, v, b0, K, out); break;
    case 7: dot_q8_7(w, sw, v, b0, K, out); break;
    default: dot_q8_8(w, sw, v, b0, K, out); break;
    }
}
#else
static void dot_q8(const int8_t *w, const float *sw, const struct q8x *v, int64_t b0, int nb,
                   int64_t K, float out[XB])
{
    for (int b = 0; b < nb; b++) {
        float s = 0.f;
        for (int64_t g = 0; g < v->G; g++) {
            const int64_t k0 = g * Q8_GROUP, n = K - k0 < Q8_GROUP ? K - k0 : Q8_GROUP;
            const int64_t r = (b0 + b) * v->G + g;
            const int8_t *xq = v->xq + r * Q8_GROUP;
            int32_t d = 0;
#pragma omp simd reduction(+ : d)
            for (int64_t i = 0; i < n; i++)
                d += (int32_t)xq[i] * (int32_t)w[k0 + i];
            s += (float)d * (sw[g] * v->sx[r]);
        }
        out[b] = s;
    }
}
#endif

/* Element `at` of the prepared x (gv_widen): float32, or bfloat16 where X_BF16. */
static inline const float *x_rows(const float *xf, int64_t at, int dt)
{
#ifdef X_BF16
    if (dt == DT_BF16)
        return (const float *)((const uint16_t *)xf + at);
#endif
    (void)dt;
    return xf + at;
}

/* Columns [n0, n1) of y (rows of w) for every row of x; xf is x as gv_widen prepared it,
 * [M, K]. w holds dtype dt, or int8 where scales (per row, one per Q8_GROUP) is given. Each
 * column's sums are the same whichever run of columns it is computed in (the decode stack
 * hands runs out to whichever thread is free). One weight row at a time, in memory order:
 * a single sequential stream is what the hardware prefetcher follows best (measured on one
 * core at M = 1: 20 GB/s, against 9-11 GB/s for 2, 4 or 8 rows read side by side). */
void gv_rows(const float *xf, const void *w, const float *scales, void *y, int64_t y_stride,
             int64_t M, int64_t n0, int64_t n1, int64_t K, int dt)
{
    const size_t row_bytes = (size_t)K * (scales ? 1 : dt == DT_F32 ? 4 : 2);
    const struct q8x q8x = q8x_in((void *)xf, M, K); /* used where scales is given */
    for (int64_t n = n0; n < n1; n++) {
        const void *wr = (const char *)w + (size_t)n * row_bytes;
        for (int64_t b0 = 0; b0 < M; b0 += XB) {
            const int nb = M - b0 < XB ? (int)(M - b0) : XB;
            float out[XB];
            if (scales) {
                dot_q8(wr, scales + n * q8x.G, &q8x, b0, nb, K, out);
            } else {
                dot_row(wr, x_rows(xf, b0 * K, dt), K, nb, dt, out);
            }
            for (int b = 0; b < nb; b++)
                store_sum(y, (b0 + b) * y_stride + n, out[b], dt);
        }
    }
}

/* x [M, K] (row stride x_stride, dtype dt) prepared in xf (gv_xbuf_bytes(M, K, q8)) for
 * the dot products: widened to float32 (a bfloat16 x in split order per 16 where the AVX2
 * dot products read it so, X_SPLIT16), kept in bfloat16 where the bf16 dot products take
 * it (X_BF16), or quantized for int8 weights (q8: struct q8x). */
void gv_widen(const void *x, int64_t x_stride, float *xf, int64_t M, int64_t K, int dt, int q8)
{
    if (q8) {
        q8_prepare(x, x_stride, xf, M, K, dt);
        return;
    }
    for (int64_t b = 0; b < M; b++) {
#ifdef X_BF16
        if (dt == DT_BF16) {
            memcpy((uint16_t *)xf + b * K, (const uint16_t *)x + b * x_stride,
                   (size_t)K * sizeof(uint16_t));
            continue;
        }
#endif
        if (dt == DT_F32) {
            memcpy(xf + b * K, (const float *)x + b * x_stride, (size_t)K * sizeof(float));
            continue;
        }
        const uint16_t *s = (const uint16_t *)x + b * x_stride;
        float *d = xf + b * K;
        int64_t k = 0;
#ifdef X_SPLIT16
        for (; k + 16 <= K; k += 16) /* per 16: the 8 even elements, then the 8 odd */
            for (int i = 0; i < 8; i++) {
                d[k + i] = bf16_to_f32(s[k + 2 * i]);
                d[k + 8 + i] = bf16_to_f32(s[k + 2 * i + 1]);
            }
#endif
#pragma omp simd
        for (int64_t j = k; j < K; j++)
            d[j] = bf16_to_f32(s[j]);
    }
}

/* Thread t of nt's share of y = xf @ w^T: one contiguous run of rows, one stream per core.
 * Called inside a parallel region by every thread of it. scales: NULL, or int8 w's. */
void gv_part(const float *xf, const void *w, const float *scales, void *y, int64_t y_stride,
             int64_t M, int64_t N, int64_t K, int dt, int t, int nt)
{
    const int64_t per = (N + nt - 1) / nt;
    const int64_t n0 = t * per;
    const int64_t n1 = n0 + per < N ? n0 + per : N;
    if (n0 < n1)
        gv_rows(xf, w, scales, y, y_stride, M, n0, n1, K, dt);
}

/* y [M, N] (row stride y_stride) = x [M, K] (row stride x_stride) @ w [N, K]^T, x and y of
 * dtype dt, w contiguous: of dtype dt, or int8 with float32 scales [N, ceil(K / Q8_GROUP)]
 * where scales is not NULL. Returns 0, or -1 when the float32 copy of x cannot be allocated. */
int gv_linear(const void *x, int64_t x_stride, const void *w, const float *scales, void *y,
              int64_t y_stride, int64_t M, int64_t N, int64_t K, int dt, int num_threads)
{
    float *xf = malloc(gv_xbuf_bytes(M, K, scales != NULL));
    if (!xf)
        return -1;
    gv_widen(x, x_stride, xf, M, K, dt, scales != NULL);
    const int threads = N * K >= PARALLEL_MIN_WEIGHTS && num_threads > 1
                            ? (N < num_threads ? (int)N : num_threads) : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    gv_part(xf, w, scales, y, y_stride, M, N, K, dt, team_thread(), team_size());
    free(xf);
    return 0;
}
