/* y = x @ W^T over W kept in the GGUF Q4_1 blocks it was de-quantized from, for a float32
 * or bfloat16 model's decode rows.
 *
 * A Q4_1 block is 32 weights of one row in 20 bytes: a float16 scale d, a float16 offset m,
 * and 16 bytes of 4-bit codes q (byte j: weight j in its low nibble, weight j + 16 in its
 * high one); weight = d * q + m. The float32 model holds exactly those values (the loader
 * de-quantizes in float32, and d * q is exact there: 11 by 4 significant bits), so a row
 * rebuilt here equals the model's row bit for bit (checked per row at load,
 * pdserve.engine.gguf_blocks) and the products are the row GEMV's, summed in its order
 * (below). What changes is the bytes per weight streamed from memory: 0.625 instead of 4 (or
 * of bfloat16's 2: a bfloat16 model holds those values rounded, and they are rounded so
 * here).
 *
 * Per block the 16 values d * q + m (q = 0..15) are built with one FMA, exactly as the
 * loader rounds them, and the 32 weights are looked up from them by their codes.
 *
 * The LM head (the tied embedding) comes as Q8_0: 32 weights in 34 bytes, a float16 scale d
 * and 32 int8 codes q, weight = d * q (exact in float32: 11 by 8 significant bits), 1.06
 * bytes a weight.
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VBMI__)
#define BLOCKS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BLOCKS_AVX2 1
#endif

#define BLOCK_WEIGHTS 32 /* weights per block, both formats */
#define Q41_BYTES 20
#define Q80_BYTES 34
#define BLOCKS_PREFETCH_AHEAD 2048 /* bytes of the block stream asked for ahead, into L1 */
#define BLOCKS_PASS_ROWS 8 /* rows of x one pass over a block row takes */

#ifdef __F16C__
static float half_to_f32(uint16_t h)
{
    return _cvtsh_ss(h);
}
#else
static float half_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        uint32_t mm = man;
        do {
            e++;
            mm <<= 1;
        } while (!(mm & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((mm & 0x3ff) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#endif

/* A Q4_1 row's float32 values: out[K]. */
static void q41_dequant_row(const uint8_t *row, int64_t K, float *out)
{
    for (int64_t b = 0; b < K / BLOCK_WEIGHTS; b++) {
        const uint8_t *p = row + b * Q41_BYTES;
        uint16_t dh, mh;
        memcpy(&dh, p, 2);
        memcpy(&mh, p + 2, 2);
        const float d = half_to_f32(dh), m = half_to_f32(mh);
        for (int j = 0; j < 16; j++) {
            out[b * BLOCK_WEIGHTS + j] = d * (float)(p[4 + j] & 0xf) + m;
            out[b * BLOCK_WEIGHTS + 16 + j] = d * (float)(p[4 + j] >> 4) + m;
        }
    }
}

/* A Q8_0 row's float32 values: out[K]. */
static void q80_dequant_row(const uint8_t *row, int64_t K, float *out)
{
    for (int64_t b = 0; b < K / BLOCK_WEIGHTS; b++) {
        const uint8_t *p = row + b * Q80_BYTES;
        uint16_t dh;
        memcpy(&dh, p, 2);
        const float d = half_to_f32(dh);
        for (int j = 0; j < BLOCK_WEIGHTS; j++)
            out[b * BLOCK_WEIGHTS + j] = d * (float)(int8_t)p[2 + j];
    }
}

/* A row of K weights in blocks of format fmt, in float32: out[K]. */
static void dequant_row(const uint8_t *row, int fmt, int64_t K, float *out)
{
    if (fmt == BLOCKS_Q8_0)
        q80_dequant_row(row, K, out);
    else
        q41_dequant_row(row, K, out);
}

/* Bytes of one row of K weights in blocks of format fmt (BLOCKS_Q4_1 or BLOCKS_Q8_0). */
int64_t blocks_row_bytes(int64_t K, int fmt)
{
    return K / BLOCK_WEIGHTS * (fmt == BLOCKS_Q8_0 ? Q80_BYTES : Q41_BYTES);
}

/* The vector forms' functions for 1-8 rows of x, U accumulators a row as the row GEMV has
 * them (gemv.c): 4 at one row, 2 at two, U34 at three and four (1, or 2 in the AVX2 forms),
 * 1 from five on. 5-8 rows (past the row GEMV's, where a model without blocks runs its
 * packed panels) keep one a row, so that a pass of up to 8 rows de-quantizes each block
 * once. */
#define FOR_ROW_COUNTS_U(DEFINE, NAME, WEIGHTS, BYTES, U34)                                   \
    DEFINE(NAME, WEIGHTS, BYTES, 1, 4)                                                        \
    DEFINE(NAME, WEIGHTS, BYTES, 2, 2)                                                        \
    DEFINE(NAME, WEIGHTS, BYTES, 3, U34)                                                      \
    DEFINE(NAME, WEIGHTS, BYTES, 4, U34)                                                      \
    DEFINE(NAME, WEIGHTS, BYTES, 5, 1)                                                        \
    DEFINE(NAME, WEIGHTS, BYTES, 6, 1)                                                        \
    DEFINE(NAME, WEIGHTS, BYTES, 7, 1)                                                        \
    DEFINE(NAME, WEIGHTS, BYTES, 8, 1)
#define FOR_ROW_COUNTS(DEFINE, NAME, WEIGHTS, BYTES) \
    FOR_ROW_COUNTS_U(DEFINE, NAME, WEIGHTS, BYTES, 1)

#ifdef BLOCKS_AVX512
/* The vector forms sum in the row GEMV's order (gemv.c's dot_row for nb rows of x): U
 * accumulators per row of x (4 at one row, 2 at two, else 1), step s of the row (16
 * weights) into accumulator s % U while a whole group of U steps is left, then into the
 * first; the accumulators added in order (fold_vf16, which -ffast-math cannot re-associate),
 * then across the vector, as gemv.c adds them. A row's blocks then give the GEMV's result
 * bit for bit (tests/test_gguf_blocks.py). */

/* The accumulators' sum, as gemv.c's dot products add them (common.h's fold_vf16). */
#define ACC_SUM_U(U)                                                                          \
    static inline float acc_sum_##U(__m512 *acc)                                              \
    {                                                                                         \
        return _mm512_reduce_add_ps((__m512)fold_vf16((const vf16 *)acc, U));                 \
    }
ACC_SUM_U(1)
ACC_SUM_U(2)
ACC_SUM_U(4)

/* NB rows of U zeroed accumulators. */
#define ACC_ZERO(acc, NB, U)                                                                  \
    for (int r = 0; r < NB; r++)                                                              \
        for (int u = 0; u < U; u++)                                                           \
            acc[r][u] = _mm512_setzero_ps()

/* A Q4_1 block's 32 weights in two vectors: its 16 values d * q + m (q = 0..15) from one FMA,
 * exact as the loader's, looked up by the codes. */
static inline void q41_weights(const uint8_t *p, __m512 *w0, __m512 *w1)
{
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* byte j of the 16 codes into the low byte of dword j */
    const __m512i spread = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1,
                                            0);
    int32_t dm32;
    memcpy(&dm32, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm32));
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_broadcastss_ps(dm),
                                         _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    const __m512i codes = _mm512_permutexvar_epi8(
        spread, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + 4))));
    /* vpermps reads only an index's low 4 bits: the low nibble, then the high one */
    *w0 = _mm512_permutexvar_ps(codes, table);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
}

/* A Q8_0 block's 32 weights, d * q, in two vectors. */
static inline void q80_weights(const uint8_t *p, __m512 *w0, __m512 *w1)
{
    uint16_t dh;
    memcpy(&dh, p, 2);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
    *w0 = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))), d);
    *w1 = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))), d);
}

/* Dot products of one block row with NB rows of x (row stride K): one function per NB and
 * format, so the accumulators are a fixed set of registers. Groups of U steps (U / 2 blocks)
 * while whole groups are left, then the rest into the first accumulator. */
#define DEFINE_BLOCKS_DOT(NAME, WEIGHTS, BYTES, NB, U)                                        \
    static void NAME##_##NB(const uint8_t *row, const float *x, int64_t K, float *out)       \
    {                                                                                         \
        __m512 acc[NB][U];                                                                    \
        ACC_ZERO(acc, NB, U);                                                                 \
        const int64_t blocks = K / BLOCK_WEIGHTS;                                             \
        int64_t b = 0;                                                                        \
        if (U > 1)                                                                            \
            for (const int64_t grouped = K / 16 / U * U / 2; b < grouped; b += U / 2)         \
                for (int j = 0; j < U / 2; j++) {                                             \
                    const uint8_t *p = row + (b + j) * BYTES;                                 \
                    _mm_prefetch((const char *)p + BLOCKS_PREFETCH_AHEAD, _MM_HINT_T0);       \
                    __m512 w0, w1;                                                            \
                    WEIGHTS(p, &w0, &w1);                                                     \
                    for (int r = 0; r < NB; r++) {                                            \
                        const float *xr = x + r * K + (b + j) * BLOCK_WEIGHTS;                \
                        acc[r][2 * j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr),              \
                                                        acc[r][2 * j]);                       \
                        acc[r][2 * j + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16),     \
                                                            acc[r][2 * j + 1]);               \
                    }                                                                         \
                }                                                                             \
        for (; b < blocks; b++) {                                                             \
            const uint8_t *p = row + b * BYTES;                                               \
            _mm_prefetch((const char *)p + BLOCKS_PREFETCH_AHEAD, _MM_HINT_T0);               \
            __m512 w0, w1;                                                                    \
            WEIGHTS(p, &w0, &w1);                                                             \
            for (int r = 0; r < NB; r++) {                                                    \
                const float *xr = x + r * K + b * BLOCK_WEIGHTS;                              \
                acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);              \
                acc[r][0] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][0]);         \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < NB; r++)                                                          \
            out[r] = acc_sum_##U(acc[r]);                                                     \
    }
FOR_ROW_COUNTS(DEFINE_BLOCKS_DOT, q41_dot, q41_weights, Q41_BYTES)
FOR_ROW_COUNTS(DEFINE_BLOCKS_DOT, q80_dot, q80_weights, Q80_BYTES)

/* Keeps v in a register here: gcc would otherwise fold each use of a loaded x vector into
 * its FMA as a memory operand, a load per FMA, which two block rows at once are to halve. */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

/* Dot products of two block rows (row_bytes apart) with NB (5-8) rows of x, out [2][NB],
 * one accumulator per pair of rows as the one-block-row form at those counts: each x
 * vector is loaded once for two FMAs, where one block row's pass is a load per FMA (a
 * 4-row pass ran at ~50 GFLOP/s a core, this one at 70-90). Not for 1-4 rows: there the
 * sums must stay the row GEMV's bit for bit, and its final adds compile alike only in code
 * written alike. */
#define DEFINE_BLOCKS_DOT_PAIR(NAME, WEIGHTS, BYTES, NB)                                      \
    static void NAME##_pair_##NB(const uint8_t *row, int64_t row_bytes, const float *x,      \
                                 int64_t K, float *out)                                       \
    {                                                                                         \
        __m512 acc[2][NB];                                                                    \
        for (int c = 0; c < 2; c++)                                                           \
            for (int r = 0; r < NB; r++)                                                      \
                acc[c][r] = _mm512_setzero_ps();                                              \
        for (int64_t b = 0; b < K / BLOCK_WEIGHTS; b++) {                                     \
            __m512 w0[2], w1[2];                                                              \
            for (int c = 0; c < 2; c++) {                                                     \
                const uint8_t *p = row + c * row_bytes + b * BYTES;                           \
                _mm_prefetch((const char *)p + BLOCKS_PREFETCH_AHEAD, _MM_HINT_T0);           \
                WEIGHTS(p, &w0[c], &w1[c]);                                                   \
            }                                                                                 \
            for (int r = 0; r < NB; r++) {                                                    \
                const float *xr = x + r * K + b * BLOCK_WEIGHTS;                              \
                __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);               \
                IN_REGISTER(x0);                                                              \
                IN_REGISTER(x1);                                                              \
                for (int c = 0; c < 2; c++) {                                                 \
                    acc[c][r] = _mm512_fmadd_ps(w0[c], x0, acc[c][r]);                        \
                    acc[c][r] = _mm512_fmadd_ps(w1[c], x1, acc[c][r]);                        \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int c = 0; c < 2; c++)                                                           \
            for (int r = 0; r < NB; r++)                                                      \
                out[c * NB + r] = _mm512_reduce_add_ps(acc[c][r]);                            \
    }
#define FOR_PAIR_COUNTS(DEFINE, NAME, WEIGHTS, BYTES)                                         \
    DEFINE(NAME, WEIGHTS, BYTES, 5)                                                           \
    DEFINE(NAME, WEIGHTS, BYTES, 6)                                                           \
    DEFINE(NAME, WEIGHTS, BYTES, 7)                                                           \
    DEFINE(NAME, WEIGHTS, BYTES, 8)
FOR_PAIR_COUNTS(DEFINE_BLOCKS_DOT_PAIR, q41_dot, q41_weights, Q41_BYTES)
FOR_PAIR_COUNTS(DEFINE_BLOCKS_DOT_PAIR, q80_dot, q80_weights, Q80_BYTES)

/* Dot products of one block row (format fmt) with nb <= BLOCKS_PASS_ROWS rows of x (row
 * stride K), or of two (row_bytes apart; pair, for nb > 4): out [1 or 2][nb]. */
static void row_dot(const uint8_t *row, int64_t row_bytes, int pair, int fmt, const float *x,
                    int64_t K, int nb, float *out)
{
    typedef void (*dot)(const uint8_t *, const float *, int64_t, float *);
    typedef void (*dot2)(const uint8_t *, int64_t, const float *, int64_t, float *);
    static const dot q41[BLOCKS_PASS_ROWS] = {q41_dot_1, q41_dot_2, q41_dot_3, q41_dot_4,
                                              q41_dot_5, q41_dot_6, q41_dot_7, q41_dot_8};
    static const dot q80[BLOCKS_PASS_ROWS] = {q80_dot_1, q80_dot_2, q80_dot_3, q80_dot_4,
                                              q80_dot_5, q80_dot_6, q80_dot_7, q80_dot_8};
    static const dot2 q41_pair[4] = {q41_dot_pair_5, q41_dot_pair_6, q41_dot_pair_7,
                                     q41_dot_pair_8};
    static const dot2 q80_pair[4] = {q80_dot_pair_5, q80_dot_pair_6, q80_dot_pair_7,
                                     q80_dot_pair_8};
    if (pair)
        (fmt == BLOCKS_Q8_0 ? q80_pair : q41_pair)[nb - 5](row, row_bytes, x, K, out);
    else
        (fmt == BLOCKS_Q8_0 ? q80 : q41)[nb - 1](row, x, K, out);
}
#endif

#ifdef BLOCKS_AVX2
/* AVX2 (AMD's Zen 2 and 3, Intel before AVX-512): float32 only, summed in gemv.c's
 * DEFINE_DOT8 order (8 weights a step; U accumulators per row of x, 4 at one row, 2 at two
 * to four, else 1; step s into accumulator s % U; a block is 4 steps, so every group of U
 * steps is whole), the accumulators added by fold_vf8 as gemv.c adds them: a row's blocks
 * give its GEMV's result bit for bit (tests/test_gguf_blocks.py).
 *
 * No table lookup here: vpermps takes 8 entries, a Q4_1 block has 16 values. Each weight is
 * its code widened to float32 and d * q + m in one FMA (exact as the loader's: d * q is
 * exact in float32). At one row of x a block costs ~3.5 ns of a Zen 3 core, in cache or
 * not: the stream is bound by these instructions, not by memory, and a prefetch ahead
 * (256 B to 2 KiB) changed nothing. */

/* A Q4_1 block's 32 weights, w[0..3] = weights 0-7, 8-15, 16-23, 24-31. */
static inline void q41_weights8(const uint8_t *p, __m256 *w)
{
    int32_t dm32;
    memcpy(&dm32, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm32));
    const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    const __m256i nib = _mm256_set1_epi32(0xf);
    /* codes of bytes 0-7 and 8-15, one a dword: low nibbles weights j, high ones j + 16 */
    const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 4)));
    const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 12)));
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c0, nib)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c1, nib)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)), d, m);
}

/* A Q8_0 block's 32 weights, d * q, in four vectors. */
static inline void q80_weights8(const uint8_t *p, __m256 *w)
{
    uint16_t dh;
    memcpy(&dh, p, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64((const __m128i *)(p + 2 + 8 * i)))),
                             d);
}

/* Dot products of one block row with NB rows of x (row stride K), out[NB]: one function per
 * NB and format, the accumulators a fixed set of registers. */
#define DEFINE_BLOCKS_DOT8(NAME, WEIGHTS, BYTES, NB, U)                                       \
    static void NAME##_##NB(const uint8_t *row, const float *x, int64_t K, float *out)       \
    {                                                                                         \
        __m256 acc[NB][U];                                                                    \
        for (int r = 0; r < NB; r++)                                                          \
            for (int u = 0; u < U; u++)                                                       \
                acc[r][u] = _mm256_setzero_ps();                                              \
        for (int64_t b = 0; b < K / BLOCK_WEIGHTS; b++) {                                     \
            __m256 w[4];                                                                      \
            WEIGHTS(row + b * BYTES, w);                                                      \
            for (int s = 0; s < 4; s++)                                                       \
                for (int r = 0; r < NB; r++)                                                  \
                    acc[r][s % U] = _mm256_fmadd_ps(                                          \
                        w[s], _mm256_loadu_ps(x + r * K + b * BLOCK_WEIGHTS + 8 * s),         \
                        acc[r][s % U]);                                                       \
        }                                                                                     \
        for (int r = 0; r < NB; r++)                                                          \
            out[r] = fold_vf8(acc[r], U);                                                     \
    }
/* U as gemv.c's DEFINE_DOT8 has it: two at three and four rows. At one accumulator a row,
 * each block is four dependent FMAs a row (16 cycles of latency on a Zen 3): a whole
 * model's blocks took 12.0-12.3 ms at 3 rows and 13.1-13.2 at 4, with two 9.6-9.8 and
 * 11.3-11.7 (docs/bench/cpu-s31/blocks_ab.c, two Zen 3 cores). From five rows on there are
 * chains enough, and two a row spill registers (6 rows: 1.08x). */
FOR_ROW_COUNTS_U(DEFINE_BLOCKS_DOT8, q41_dot8, q41_weights8, Q41_BYTES, 2)
FOR_ROW_COUNTS_U(DEFINE_BLOCKS_DOT8, q80_dot8, q80_weights8, Q80_BYTES, 2)

static void row_dot8(const uint8_t *row, int fmt, const float *x, int64_t K, int nb,
                     float *out)
{
    typedef void (*dot)(const uint8_t *, const float *, int64_t, float *);
    static const dot q41[BLOCKS_PASS_ROWS] = {q41_dot8_1, q41_dot8_2, q41_dot8_3, q41_dot8_4,
                                              q41_dot8_5, q41_dot8_6, q41_dot8_7, q41_dot8_8};
    static const dot q80[BLOCKS_PASS_ROWS] = {q80_dot8_1, q80_dot8_2, q80_dot8_3, q80_dot8_4,
                                              q80_dot8_5, q80_dot8_6, q80_dot8_7, q80_dot8_8};
    (fmt == BLOCKS_Q8_0 ? q80 : q41)[nb - 1](row, x, K, out);
}
#endif

#if defined(BLOCKS_AVX512) && defined(__AVX512BF16__)
#define BLOCKS_BF16_AVX512 1
/* A bfloat16 model holds the float32 values rounded to bfloat16 (nearest, even), and so
 * they are rounded here (vcvtneps2bf16 rounds so; no block value is subnormal in float32):
 * a Q4_1 block's 16 values once, then its 32 weights looked up as words; a Q8_0 block's 32.
 * x stays bfloat16, and pairs are multiplied on vdpbf16ps as gemv.c's dot_bf16 does, in its
 * order (U accumulators, step = one block of 32). */
static inline __m512bh q41_weights_bf16(const uint8_t *p)
{
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* byte j of the 16 codes into the low byte of words j and j + 16 */
    const __m512i spread = _mm512_set_epi16(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1,
                                            0, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                            1, 0);
    /* words j < 16 take the low nibble, words j + 16 the high one; vpermw reads an index's
     * low 5 bits and the table is in both halves, so bit 4 does not matter */
    const __m512i shift = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    int32_t dm32;
    memcpy(&dm32, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm32));
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_broadcastss_ps(dm),
                                         _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    const __m512i table16 = _mm512_broadcast_i64x4((__m256i)_mm512_cvtneps_pbh(table));
    const __m512i codes = _mm512_permutexvar_epi8(
        spread, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + 4))));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(codes, shift), table16);
}

static inline __m512bh q80_weights_bf16(const uint8_t *p)
{
    __m512 w0, w1;
    q80_weights(p, &w0, &w1);
    return _mm512_cvtne2ps_pbh(w1, w0); /* w0 in the low half */
}

#define DEFINE_BLOCKS_DOT_BF16(NAME, WEIGHTS, BYTES, NB, U)                                   \
    static void NAME##_##NB(const uint8_t *row, const uint16_t *x, int64_t K, float *out)    \
    {                                                                                         \
        __m512 acc[NB][U];                                                                    \
        ACC_ZERO(acc, NB, U);                                                                 \
        const int64_t blocks = K / BLOCK_WEIGHTS;                                             \
        int64_t b = 0;                                                                        \
        for (const int64_t grouped = blocks / U * U; b < grouped; b += U)                     \
            for (int j = 0; j < U; j++) {                                                     \
                const uint8_t *p = row + (b + j) * BYTES;                                     \
                _mm_prefetch((const char *)p + BLOCKS_PREFETCH_AHEAD, _MM_HINT_T0);           \
                const __m512bh w = WEIGHTS(p);                                                \
                for (int r = 0; r < NB; r++)                                                  \
                    acc[r][j] = _mm512_dpbf16_ps(                                             \
                        acc[r][j], w,                                                         \
                        (__m512bh)_mm512_loadu_si512(x + r * K + (b + j) * BLOCK_WEIGHTS));   \
            }                                                                                 \
        for (; b < blocks; b++) {                                                             \
            const uint8_t *p = row + b * BYTES;                                               \
            const __m512bh w = WEIGHTS(p);                                                    \
            for (int r = 0; r < NB; r++)                                                      \
                acc[r][0] = _mm512_dpbf16_ps(                                                 \
                    acc[r][0], w, (__m512bh)_mm512_loadu_si512(x + r * K + b * BLOCK_WEIGHTS)); \
        }                                                                                     \
        for (int r = 0; r < NB; r++)                                                          \
            out[r] = acc_sum_##U(acc[r]);                                                     \
    }
FOR_ROW_COUNTS(DEFINE_BLOCKS_DOT_BF16, q41_dot_bf16, q41_weights_bf16, Q41_BYTES)
FOR_ROW_COUNTS(DEFINE_BLOCKS_DOT_BF16, q80_dot_bf16, q80_weights_bf16, Q80_BYTES)

static void row_dot_bf16(const uint8_t *row, int fmt, const uint16_t *x, int64_t K, int nb,
                         float *out)
{
    typedef void (*dot)(const uint8_t *, const uint16_t *, int64_t, float *);
    static const dot q41[BLOCKS_PASS_ROWS] = {
        q41_dot_bf16_1, q41_dot_bf16_2, q41_dot_bf16_3, q41_dot_bf16_4,
        q41_dot_bf16_5, q41_dot_bf16_6, q41_dot_bf16_7, q41_dot_bf16_8};
    static const dot q80[BLOCKS_PASS_ROWS] = {
        q80_dot_bf16_1, q80_dot_bf16_2, q80_dot_bf16_3, q80_dot_bf16_4,
        q80_dot_bf16_5, q80_dot_bf16_6, q80_dot_bf16_7, q80_dot_bf16_8};
    (fmt == BLOCKS_Q8_0 ? q80 : q41)[nb - 1](row, x, K, out);
}
#endif

/* Any CPU: each block de-quantized (rounded to bfloat16 for dt DT_BF16), then multiplied
 * with x (float32, or bfloat16 for DT_BF16). For tests, and builds without a vector form for
 * dt (blocks_fast: the engine does not stream blocks there). */
static void scalar_dot(const uint8_t *row, int fmt, const void *x, int dt, int64_t K, int nb,
                       float *out)
{
    const int64_t bytes = blocks_row_bytes(BLOCK_WEIGHTS, fmt);
    float w[BLOCK_WEIGHTS];
    for (int r = 0; r < nb; r++)
        out[r] = 0.0f;
    for (int64_t b = 0; b < K / BLOCK_WEIGHTS; b++) {
        dequant_row(row + b * bytes, fmt, BLOCK_WEIGHTS, w);
        for (int r = 0; r < nb; r++) {
            float s = 0.0f;
            for (int j = 0; j < BLOCK_WEIGHTS; j++) {
                const int64_t at = r * K + b * BLOCK_WEIGHTS + j;
                if (dt == DT_BF16)
                    s += bf16_to_f32(f32_to_bf16(w[j])) * bf16_to_f32(((const uint16_t *)x)[at]);
                else
                    s += w[j] * ((const float *)x)[at];
            }
            out[r] += s;
        }
    }
}

/* Whether this build streams blocks for a model of dtype dt faster than its rows: a vector
 * form (AVX-512 with VBMI, or float32 on AVX2 with FMA and F16C; for bfloat16 AVX512-BF16).
 * Elsewhere the scalar form is slower than the rows, and the engine keeps the rows. */
int blocks_fast(int dt)
{
#ifdef BLOCKS_BF16_AVX512
    if (dt == DT_BF16)
        return 1;
#endif
#if defined(BLOCKS_AVX512) || defined(BLOCKS_AVX2)
    if (dt == DT_F32)
        return 1;
#endif
    (void)dt;
    return 0;
}

/* Dot products of one block row, or of two where a vector form takes pairs (float32, 5-8
 * rows of x: `pair` asks, the return says whether they were), with nb <= BLOCKS_PASS_ROWS
 * rows of x (row stride K, dtype dt): out [1 or 2][nb]. */
static int any_row_dot(const uint8_t *row, int64_t row_bytes, int pair, int fmt, const void *x,
                       int dt, int64_t K, int nb, float *out)
{
#ifdef BLOCKS_BF16_AVX512
    if (dt == DT_BF16) {
        row_dot_bf16(row, fmt, x, K, nb, out);
        return 0;
    }
#endif
#ifdef BLOCKS_AVX512
    if (dt == DT_F32) {
        pair = pair && nb > 4;
        row_dot(row, row_bytes, pair, fmt, x, K, nb, out);
        return pair;
    }
#endif
#ifdef BLOCKS_AVX2
    if (dt == DT_F32) {
        row_dot8(row, fmt, x, K, nb, out);
        return 0;
    }
#endif
    (void)row_bytes;
    (void)pair;
    scalar_dot(row, fmt, x, dt, K, nb, out);
    return 0;
}

/* Columns [n0, n1) of y [M, N] (row stride y_stride, dtype dt) for the M rows of x (dtype
 * dt, [M, K], as the decode stack prepares them: bfloat16 stays bfloat16); w: N rows of
 * K / 32 blocks of format fmt. M <= BLOCKS_PASS_ROWS rows of x per pass (the rows of a
 * decode step's GEMV), more in passes of that many; two columns a pass where it can. */
void blocks_rows(const void *x, const uint8_t *w, int fmt, void *y, int64_t y_stride,
                 int64_t M, int64_t n0, int64_t n1, int64_t K, int dt)
{
    const int64_t row_bytes = blocks_row_bytes(K, fmt);
    const size_t es = dt == DT_F32 ? 4 : 2;
    for (int64_t n = n0, cols; n < n1; n += cols) {
        cols = n + 1 < n1 ? 2 : 1;
        for (int64_t b0 = 0; b0 < M; b0 += BLOCKS_PASS_ROWS) {
            const int nb = M - b0 < BLOCKS_PASS_ROWS ? (int)(M - b0) : BLOCKS_PASS_ROWS;
            const char *xb = (const char *)x + (size_t)(b0 * K) * es;
            float out[2 * BLOCKS_PASS_ROWS];
            if (!any_row_dot(w + n * row_bytes, row_bytes, cols == 2, fmt, xb, dt, K, nb, out)
                && cols == 2)
                any_row_dot(w + (n + 1) * row_bytes, row_bytes, 0, fmt, xb, dt, K, nb,
                            out + nb);
            for (int c = 0; c < cols; c++)
                for (int b = 0; b < nb; b++)
                    store_sum(y, (b0 + b) * y_stride + n + c, out[c * nb + b], dt);
        }
    }
}

/* y [M, N] = x [M, K] @ W^T, x and y of dtype dt and contiguous, W as blocks of format fmt;
 * K a multiple of 32. For tests and harnesses (the decode stack calls blocks_rows). */
void blocks_linear(const void *x, const uint8_t *w, int fmt, void *y, int64_t M, int64_t N,
                   int64_t K, int dt, int num_threads)
{
    const int threads = N * K >= 65536 && num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t n0, n1;
        team_share(N, &n0, &n1);
        blocks_rows(x, w, fmt, y, N, M, n0, n1, K, dt);
    }
}

/* The rows of w [N, K / 32 blocks of format fmt] in float32: out [N, K]. */
void blocks_dequant(const uint8_t *w, int fmt, int64_t N, int64_t K, float *out)
{
    const int64_t row_bytes = blocks_row_bytes(K, fmt);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        dequant_row(w + n * row_bytes, fmt, K, out + n * K);
}
