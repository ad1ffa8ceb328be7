/* Paged decode attention on the CPU: one query token per sequence attends to its whole
 * cached context, reading K/V rows in place through the block table (no gather).
 *
 * Layouts (all row-major, elements of D contiguous):
 *   query        [B, Hq, D]    batch stride q_stride_b (elements), heads packed
 *   k/v cache    [num_blocks, block_size, Hkv, D]  contiguous
 *   block_tables [B, max_blocks] int32, row stride bt_stride
 *   seq_lens     [B] int32
 *   out          [B, Hq, D]    contiguous, in the query's dtype
 * dtype codes and bf16 conversions: common.h.
 *
 * Work item = (sequence, all or one of its KV heads, all or a range of its tokens): each KV
 * head's G = Hq / Hkv query heads are processed together so every K/V row is read from
 * memory once (the other query heads re-read it from L1). Keys are taken a tile at a time:
 * score the tile for all G heads, update the online softmax (float32), then accumulate the
 * tile's values. A sequence longer than the call's limit (pd_range_tokens) is split into
 * ranges of that many tokens, each leaving its softmax state (max, sum, unnormalised
 * values) in a partial record, merged once all are in (merge_share): one long sequence
 * alone, or beside short ones, keeps every thread busy instead of one. Threads claim the
 * items longest first (claim_order), so no long one is left for the end. The split depends
 * on the lengths only, never on the threads, so any team gives the same bits. The launcher
 * (paged_decode.py) checks shapes and dtypes and calls pd_validate before pd_decode, so
 * pd_decode trusts its arguments.
 *
 * A bfloat16 cache on AVX-512 (head_dim 64 or 128) is widened without conversions: a bf16
 * is the upper half of a float32, so 32 of them widen with one shift (the even elements)
 * and one AND (the odd ones). That leaves each 32 elements split, evens then odds, so q and
 * the accumulators are kept in the same split order and put back in order on output. With
 * AVX512-BF16 and a bf16 query, q.k is one vdpbf16ps per 32 elements on the raw bf16 rows
 * (products of two bf16 are exact in float32, sums are float32), the scale applied to the
 * sums; the softmax weights and p.v stay float32.
 *
 * On AVX2 (head_dim 64 or 128) the same tiles score two or three query heads against four
 * keys at once, each K vector loaded once for those heads (a lone head: eight keys at once),
 * and sum the keys' lanes together (reduce4, reduce8); a bfloat16 row is widened in order.
 * They ask for the next block's lines in address order (struct ahead).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define AVX2_STEPS 1
#include <immintrin.h>
#endif

#include "common.h"

#define TILE 32 /* keys per tile: its rows (<= 32 KiB at D=128) stay in L1 across heads */
#define SPLIT_PARTS 4 /* ranges hold at least total / SPLIT_PARTS of a call's tokens */
#define MIN_RANGE 512 /* tokens: a sequence this short is never split */
/* Position of element i in split order: per 32 elements, the 16 even ones then the 16 odd. */
static inline int split_pos(int i)
{
    return (i & ~31) | ((i & 1) << 4) | ((i >> 1) & 15);
}

struct args {
    const void *q, *k, *v;
    const int32_t *tables, *lens;
    void *out;
    int64_t q_stride_b, bt_stride;
    int B, Hq, Hkv, D, bs, q_dt, kv_dt;
    float scale;
    int hg;         /* KV heads per work item: Hkv (whole rows), or 1 (whole_rows) */
    int limit;      /* a sequence longer than this is split (pd_range_tokens) */
    int items;      /* work items of the call */
    float *partials; /* items records of partial_floats: split sequences' states */
};

/* Per-thread scratch, in floats: q and acc [hg*G*D], scores [G*TILE], m, l, corr [hg*G]. */
static size_t scratch_floats(const struct args *a)
{
    size_t G = (size_t)(a->Hq / a->Hkv), HG = (size_t)a->hg;
    return 2 * HG * G * a->D + G * TILE + 3 * HG * G;
}

/* One split item's record: m [Hq], l [Hq], then the unnormalised acc [Hq][D] in order. */
static size_t partial_floats(int Hq, int D)
{
    return (size_t)Hq * (D + 2);
}

/* The call's limit: total / SPLIT_PARTS tokens rounded up to whole blocks, at least
 * MIN_RANGE. Equal lengths stay whole from SPLIT_PARTS sequences on; one sequence alone is
 * split in up to SPLIT_PARTS. Why these, from the kernel alone on SmolLM2's heads from DRAM
 * on two Zen 3 cores (docs/benchmarks.md section 6, session 33): one sequence of 1,000 and
 * 4,000 tokens 0.79 and 0.71-0.73x, three of 1,000-2,000 0.82-0.86x, two 0.97-1.04x, 4-32
 * sequences 0.96-1.01x. Ranges from 64 tokens on cost 15 % where two of 300 tokens were
 * balanced whole; 2 parts gave up the three sequences' gain, 8 lost more for two. */
int pd_range_tokens(const int32_t *lens, int B, int bs)
{
    int64_t total = 0;
    for (int b = 0; b < B; b++)
        total += lens[b];
    int64_t r = (total + SPLIT_PARTS - 1) / SPLIT_PARTS;
    r = r < MIN_RANGE ? MIN_RANGE : r;
    r = (r + bs - 1) / bs * bs;
    return r > INT32_MAX / 2 ? INT32_MAX / 2 / bs * bs : (int)r;
}

/* A sequence's ranges: limit tokens each, the last one the rest. */
static int ranges_of(int len, int limit)
{
    return (len + limit - 1) / limit;
}

/* Asks for the row at the same place in the next block (pf bytes on) as this one is read,
 * so the next block arrives a line at a time during this block's arithmetic instead of in
 * one burst that fills the core's miss queue and stalls it (a burst of ~200 prefetches per
 * block took 28 % of the kernel's cycles). pf = 0: no next block. */
INLINE void prefetch_row(const void *row, ptrdiff_t pf, const int bytes)
{
    if (pf)
        for (int c = 0; c < bytes; c += 64)
            __builtin_prefetch((const char *)row + pf + c, 0, 2);
}

/* ---- portable tile steps: any D, any dtype, in eight-float vectors (common.h) ---- */

/* s[g][t] = q_g . k_t. Two chains of eight lanes per dot product; a bfloat16 row is
 * widened in registers, not into a buffer. Written as plain loops, gcc kept one chain with
 * a multiply and an add apart, and accum_tile_c's accumulators in memory. 64 rows x 256
 * keys of SmolLM2's heads on AVX2 (Zen 3), against those loops: bfloat16 0.85x on one core
 * and on two; float32, which waits on the cache's reads, 0.95x on two cores and the same
 * on one (docs/benchmarks.md section 6, session 18). */
INLINE void score_tile_c(const float *qf, const void *const *krows, int nt, int G, int D,
                         int dt, float *s, ptrdiff_t pf)
{
    const int D16 = D & ~15, D8 = D & ~7;
    for (int t = 0; t < nt; t++) {
        const void *kr = krows[t];
        prefetch_row(kr, pf, D * (dt == DT_F32 ? 4 : 2));
        for (int g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            vf8 a0 = {0}, a1 = {0};
            int d = 0;
            for (; d < D16; d += 16) {
                a0 += load8(qg + d) * load8_dt(kr, d, dt);
                a1 += load8(qg + d + 8) * load8_dt(kr, d + 8, dt);
            }
            if (d < D8) {
                a0 += load8(qg + d) * load8_dt(kr, d, dt);
                d += 8;
            }
            float x = hsum_vf8(a0 + a1);
            for (; d < D; d++)
                x += qg[d] * at_dt(kr, d, dt);
            s[g * TILE + t] = x;
        }
    }
}

/* acc[g] = acc[g] * corr[g] + sum_t s[g][t] * v_t: up to four heads' 16 elements of D held
 * in registers across the tile's rows. */
INLINE void accum_tile_c(float *acc, const float *corr, const void *const *vrows, int nt,
                         int G, int D, int dt, const float *s, ptrdiff_t pf)
{
    for (int t = 0; t < nt; t++)
        prefetch_row(vrows[t], pf, D * (dt == DT_F32 ? 4 : 2));
    const int D16 = D & ~15;
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int ng = G - g0 < 4 ? G - g0 : 4;
        for (int d = 0; d < D16; d += 16) {
            vf8 o[4][2];
            for (int i = 0; i < ng; i++) {
                o[i][0] = load8(acc + (g0 + i) * D + d) * corr[g0 + i];
                o[i][1] = load8(acc + (g0 + i) * D + d + 8) * corr[g0 + i];
            }
            for (int t = 0; t < nt; t++) {
                const vf8 v0 = load8_dt(vrows[t], d, dt), v1 = load8_dt(vrows[t], d + 8, dt);
                for (int i = 0; i < ng; i++) {
                    const float p = s[(g0 + i) * TILE + t];
                    o[i][0] += p * v0;
                    o[i][1] += p * v1;
                }
            }
            for (int i = 0; i < ng; i++) {
                store8(acc + (g0 + i) * D + d, o[i][0]);
                store8(acc + (g0 + i) * D + d + 8, o[i][1]);
            }
        }
        for (int i = 0; i < ng; i++) { /* the last D % 16 elements */
            float *ag = acc + (g0 + i) * D;
            for (int d = D16; d < D; d++) {
                float x = ag[d] * corr[g0 + i];
                for (int t = 0; t < nt; t++)
                    x += s[(g0 + i) * TILE + t] * at_dt(vrows[t], d, dt);
                ag[d] = x;
            }
        }
    }
}

/* ---- AVX-512 tile steps: D = 16 * NV with NV a compile-time constant ---- */
#ifdef __AVX512F__
#define MAX_NV 8 /* fixed-size arrays (not VLAs) so a head's vectors live in registers */

INLINE __m512 load16(const void *row, int i)
{
    return _mm512_loadu_ps((const float *)row + i);
}

/* Elements i..i+31 of a bf16 row as float32: the even ones in *even, the odd in *odd. */
INLINE void widen32(const void *row, int i, __m512 *even, __m512 *odd)
{
    const __m512i x = _mm512_loadu_si512((const uint16_t *)row + i);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Lane j of the result = the sum of p[j]'s 16 lanes. Summing 16 vectors together with
 * unpacks and lane shuffles takes ~45 instructions where 16 separate horizontal sums take
 * ~150; the per-key reductions were the kernel's largest cost. */
INLINE __m512 reduce16(const __m512 *p)
{
    __m512 r[8], w[4];
    for (int i = 0; i < 8; i++) /* lanes: [a0+a2, b0+b2, a1+a3, b1+b3] per 128 bits */
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                             _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* [k0, k1, k2, k3] partial sums per 128 bits */
        __m512d c = _mm512_castps_pd(r[2 * i]), d = _mm512_castps_pd(r[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    /* then across the four 128-bit lanes: 0x88 takes lanes 0,2 and 0xDD lanes 1,3 */
    __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                              _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88),
                              _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

/* float32 cache */
INLINE void score_tile_simd(const float *qf, const void *const *krows, int nt, int G,
                            const int NV, float *s, ptrdiff_t pf)
{
    for (int g = 0; g < G; g++) {
        __m512 qv[MAX_NV];
        for (int v = 0; v < NV; v++)
            qv[v] = _mm512_loadu_ps(qf + g * NV * 16 + v * 16);
        for (int c = 0; c < nt; c += 16) {
            __m512 p[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                p[j] = _mm512_setzero_ps();
                if (c + j < nt) {
                    if (g == 0)
                        prefetch_row(krows[c + j], pf, NV * 64);
                    for (int v = 0; v < NV; v++)
                        p[j] = _mm512_fmadd_ps(qv[v], load16(krows[c + j], v * 16), p[j]);
                }
            }
            _mm512_storeu_ps(s + g * TILE + c, reduce16(p));
        }
    }
}

INLINE void accum_tile_simd(float *acc, const float *corr, const void *const *vrows, int nt,
                            int G, const int NV, const float *s, ptrdiff_t pf)
{
    for (int g = 0; g < G; g++) {
        float *ag = acc + g * NV * 16;
        const float *sg = s + g * TILE;
        /* two accumulator sets: consecutive keys do not wait on each other's FMA */
        __m512 a0[MAX_NV], a1[MAX_NV];
        const __m512 cv = _mm512_set1_ps(corr[g]);
        for (int v = 0; v < NV; v++) {
            a0[v] = _mm512_mul_ps(_mm512_loadu_ps(ag + v * 16), cv);
            a1[v] = _mm512_setzero_ps();
        }
        int t = 0;
        for (; t + 1 < nt; t += 2) {
            if (g == 0) {
                prefetch_row(vrows[t], pf, NV * 64);
                prefetch_row(vrows[t + 1], pf, NV * 64);
            }
            const __m512 p0 = _mm512_set1_ps(sg[t]), p1 = _mm512_set1_ps(sg[t + 1]);
            for (int v = 0; v < NV; v++) {
                a0[v] = _mm512_fmadd_ps(p0, load16(vrows[t], v * 16), a0[v]);
                a1[v] = _mm512_fmadd_ps(p1, load16(vrows[t + 1], v * 16), a1[v]);
            }
        }
        if (t < nt) {
            if (g == 0)
                prefetch_row(vrows[t], pf, NV * 64);
            const __m512 p0 = _mm512_set1_ps(sg[t]);
            for (int v = 0; v < NV; v++)
                a0[v] = _mm512_fmadd_ps(p0, load16(vrows[t], v * 16), a0[v]);
        }
        for (int v = 0; v < NV; v++)
            _mm512_storeu_ps(ag + v * 16, _mm512_add_ps(a0[v], a1[v]));
    }
}

/* bf16 cache, q (scaled float32) in split order */
INLINE void score_tile_split(const float *qf, const void *const *krows, int nt, int G,
                             const int NV, float *s, ptrdiff_t pf)
{
    for (int g = 0; g < G; g++) {
        __m512 qv[MAX_NV];
        for (int v = 0; v < NV; v++)
            qv[v] = _mm512_loadu_ps(qf + g * NV * 16 + v * 16);
        for (int c = 0; c < nt; c += 16) {
            __m512 p[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                p[j] = _mm512_setzero_ps();
                if (c + j < nt) {
                    if (g == 0)
                        prefetch_row(krows[c + j], pf, NV * 32);
                    for (int v = 0; v < NV; v += 2) {
                        __m512 e, o;
                        widen32(krows[c + j], v * 16, &e, &o);
                        p[j] = _mm512_fmadd_ps(qv[v], e, p[j]);
                        p[j] = _mm512_fmadd_ps(qv[v + 1], o, p[j]);
                    }
                }
            }
            _mm512_storeu_ps(s + g * TILE + c, reduce16(p));
        }
    }
}

#ifdef __AVX512BF16__
/* bf16 cache and bf16 query (raw, in order, unscaled): vdpbf16ps multiplies pairs of bf16
 * exactly and adds them in float32 (it flushes float32 denormals, below 1.2e-38, to zero). */
INLINE void score_tile_dp(const uint16_t *qb, const void *const *krows, int nt, int G,
                          const int NV, float qscale, float *s, ptrdiff_t pf)
{
    const __m512 sc = _mm512_set1_ps(qscale);
    for (int g = 0; g < G; g++) {
        __m512bh qv[MAX_NV / 2];
        for (int v = 0; v < NV / 2; v++)
            qv[v] = (__m512bh)_mm512_loadu_si512(qb + g * NV * 16 + v * 32);
        for (int c = 0; c < nt; c += 16) {
            __m512 p[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                p[j] = _mm512_setzero_ps();
                if (c + j < nt) {
                    if (g == 0)
                        prefetch_row(krows[c + j], pf, NV * 32);
                    for (int v = 0; v < NV / 2; v++)
                        p[j] = _mm512_dpbf16_ps(
                            p[j], qv[v],
                            (__m512bh)_mm512_loadu_si512((const uint16_t *)krows[c + j] + v * 32));
                }
            }
            _mm512_storeu_ps(s + g * TILE + c, _mm512_mul_ps(reduce16(p), sc));
        }
    }
}
#endif

/* NH query heads at once, their accumulators (split order) in registers, so each V row is
 * loaded and widened once for all of them rather than once per head. NH * NV <= 16. */
INLINE void accum_heads_split(float *acc, const float *corr, const void *const *vrows, int nt,
                              const int NH, const int NV, const float *s, ptrdiff_t pf)
{
    const int D = 16 * NV;
    const int TWO = NH * NV < 8; /* too few chains to hide FMA latency: a second set */
    __m512 a0[16], a1[8], p0[4], p1[4];
    for (int h = 0; h < NH; h++) {
        const __m512 cv = _mm512_set1_ps(corr[h]);
        for (int v = 0; v < NV; v++) {
            a0[h * NV + v] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + v * 16), cv);
            if (TWO)
                a1[h * NV + v] = _mm512_setzero_ps();
        }
    }
    int t = 0;
    if (TWO)
        for (; t + 1 < nt; t += 2) {
            prefetch_row(vrows[t], pf, NV * 32);
            prefetch_row(vrows[t + 1], pf, NV * 32);
            for (int h = 0; h < NH; h++) {
                p0[h] = _mm512_set1_ps(s[h * TILE + t]);
                p1[h] = _mm512_set1_ps(s[h * TILE + t + 1]);
            }
            for (int v = 0; v < NV; v += 2) {
                __m512 e0, o0, e1, o1;
                widen32(vrows[t], v * 16, &e0, &o0);
                widen32(vrows[t + 1], v * 16, &e1, &o1);
                for (int h = 0; h < NH; h++) {
                    a0[h * NV + v] = _mm512_fmadd_ps(p0[h], e0, a0[h * NV + v]);
                    a0[h * NV + v + 1] = _mm512_fmadd_ps(p0[h], o0, a0[h * NV + v + 1]);
                    a1[h * NV + v] = _mm512_fmadd_ps(p1[h], e1, a1[h * NV + v]);
                    a1[h * NV + v + 1] = _mm512_fmadd_ps(p1[h], o1, a1[h * NV + v + 1]);
                }
            }
        }
    for (; t < nt; t++) {
        prefetch_row(vrows[t], pf, NV * 32);
        for (int h = 0; h < NH; h++)
            p0[h] = _mm512_set1_ps(s[h * TILE + t]);
        for (int v = 0; v < NV; v += 2) {
            __m512 e, o;
            widen32(vrows[t], v * 16, &e, &o);
            for (int h = 0; h < NH; h++) {
                a0[h * NV + v] = _mm512_fmadd_ps(p0[h], e, a0[h * NV + v]);
                a0[h * NV + v + 1] = _mm512_fmadd_ps(p0[h], o, a0[h * NV + v + 1]);
            }
        }
    }
    for (int h = 0; h < NH; h++)
        for (int v = 0; v < NV; v++)
            _mm512_storeu_ps(acc + h * D + v * 16,
                             TWO ? _mm512_add_ps(a0[h * NV + v], a1[h * NV + v])
                                 : a0[h * NV + v]);
}

/* The G heads in groups of at most 16 / NV, each group size a compile-time constant. */
INLINE void accum_tile_split(float *acc, const float *corr, const void *const *vrows, int nt,
                             int G, const int NV, const float *s, ptrdiff_t pf)
{
    const int NHMAX = 16 / NV;
    for (int g = 0; g < G;) {
        const int nh = G - g < NHMAX ? G - g : NHMAX;
        float *ag = acc + g * NV * 16;
        const float *cg = corr + g, *sg = s + g * TILE;
        if (NHMAX >= 4 && nh == 4)
            accum_heads_split(ag, cg, vrows, nt, 4, NV, sg, g ? 0 : pf);
        else if (NHMAX >= 3 && nh == 3)
            accum_heads_split(ag, cg, vrows, nt, 3, NV, sg, g ? 0 : pf);
        else if (nh == 2)
            accum_heads_split(ag, cg, vrows, nt, 2, NV, sg, g ? 0 : pf);
        else
            accum_heads_split(ag, cg, vrows, nt, 1, NV, sg, g ? 0 : pf);
        g += nh;
    }
}
#endif /* __AVX512F__ */

/* ---- AVX2 tile steps: D = 8 * NV with NV a compile-time multiple of 8, rows of either
 * dtype widened in order (a bfloat16 row: vpmovzxwd and a shift per 8 elements). The
 * portable steps sum each key's eight lanes on their own (hsum_vf8) and took 0.19-0.25 ms
 * a layer for one sequence of 1,000 tokens on a Zen 3, reading K/V at 6-8 GB/s of the
 * ~21 a core streams. */
#ifdef AVX2_STEPS
/* common.h's load8_dt in intrinsics: through load8_dt's memcpy and convertvector, gcc kept
 * a bfloat16 row's load apart from its vpmovzxwd, and 64 x 256 bfloat16 took 0.96 ms a
 * layer from the cache against 0.62 this way. */
INLINE __m256 load8v(const void *row, int i, const int dt)
{
    if (dt == DT_F32)
        return _mm256_loadu_ps((const float *)row + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The next block's K and V lines, asked for one at a time in address order wherever this
 * block's reads ask (ahead_step), where the AVX-512 steps ask for each read line's
 * counterpart (prefetch_row): in that order, head by head and the values in halves, the
 * AVX2 steps read the cache from DRAM at 16-17 GB/s, in address order at 21-25. Whole rows
 * (an item with every KV head) alternate K's lines and V's; an item with some heads asks
 * for all its K lines, then its V lines, which measured faster there (the kernel alone on
 * SmolLM2's heads on a Zen 3, each order against the others, docs/benchmarks.md section 6,
 * session 32). */
struct ahead {
    const char *kv[2]; /* the next block's first row of this item's heads in K, in V */
    size_t stride;     /* bytes from one token's row to the next */
    int next, lines;   /* the next line asked for, of 2 * lines (K's and V's) */
    int whole;         /* whole rows, one run of lines each: K's and V's alternate */
    int shift;         /* else one head's part of a row, 1 << shift lines (D 64 or 128) */
};

/* The next block of this item: its first row in K and V (k NULL: none), rows of row_bytes
 * each, stride bytes apart (whole rows when row_bytes == stride). */
INLINE void ahead_start(struct ahead *nx, const char *k, const char *v, size_t stride,
                        int row_bytes, int rows)
{
    *nx = (struct ahead){{k, v}, stride, 0, k ? rows * row_bytes / 64 : 0,
                         (size_t)row_bytes == stride, __builtin_ctz((unsigned)row_bytes / 64)};
}

/* A pass's own copy of the cursor (nx NULL: a pass that asks for none), which the compiler
 * keeps in registers: stepped through the pointer, each line asked for read and wrote the
 * struct in memory, and the steps cost more than the reads they overlap when the cache
 * was in L3. ahead_put hands the position back. */
INLINE struct ahead ahead_take(const struct ahead *nx)
{
    return nx ? *nx : (struct ahead){{NULL, NULL}, 0, 0, 0, 1, 0};
}

INLINE void ahead_put(struct ahead *nx, const struct ahead *a)
{
    if (nx)
        nx->next = a->next;
}

/* One line more of the next block, where a line of this block's row starts at byte off. */
INLINE void ahead_step(struct ahead *nx, int off)
{
    if (off % 64 || nx->next >= 2 * nx->lines)
        return;
    const int i = nx->next++;
    if (nx->whole) {
        __builtin_prefetch(nx->kv[i & 1] + 64 * (size_t)(i >> 1), 0, 2);
    } else {
        const int on_v = i >= nx->lines, j = on_v ? i - nx->lines : i;
        __builtin_prefetch(nx->kv[on_v] + (size_t)(j >> nx->shift) * nx->stride +
                               64 * (size_t)(j & ((1 << nx->shift) - 1)),
                           0, 2);
    }
}

/* Lane j of the result = the sum of p[j]'s 8 lanes (reduce16's scheme at half width). */
INLINE __m256 reduce8(const __m256 *p)
{
    __m256 r[4], w[2];
    for (int i = 0; i < 4; i++) /* per 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3] */
        r[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                             _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128 bits: keys 4i..4i+3, each over 4 lanes */
        __m256d c = _mm256_castps_pd(r[2 * i]), d = _mm256_castps_pd(r[2 * i + 1]);
        w[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(c, d)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(c, d)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20),
                         _mm256_permute2f128_ps(w[0], w[1], 0x31));
}

/* One query head's scores, eight keys at a time, one accumulator each, q's vector loaded
 * once for the eight (q does not fit the 16 registers beside them at D = 128). A short last
 * group repeats its first row, and the repeats' scores are never read. The next block's
 * lines are asked for one at a time between the loads that use this block's (here, in
 * score_heads_avx2 and in accum_heads_avx2): asked for a row at a time, as the AVX-512
 * steps do, the K/V reads overlapped the arithmetic less, and one sequence of 3,000 tokens
 * took 0.48 ms a layer on a Zen 3 against 0.38. */
INLINE void score_head_avx2(const float *q, const void *const *krows, int nt, const int NV,
                            const int dt, float *s, struct ahead *nx)
{
    const int vbytes = dt == DT_F32 ? 32 : 16; /* one vector's share of a row */
    struct ahead ah = ahead_take(nx);
    for (int c = 0; c < nt; c += 8) {
        const int n = nt - c < 8 ? nt - c : 8;
        const void *kr[8];
        for (int j = 0; j < 8; j++)
            kr[j] = krows[c + (j < n ? j : 0)];
        __m256 p[8];
        for (int j = 0; j < 8; j++)
            p[j] = _mm256_setzero_ps();
        for (int v = 0; v < NV; v++) {
            const __m256 qv = _mm256_loadu_ps(q + v * 8);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                ahead_step(&ah, v * vbytes);
                p[j] = _mm256_fmadd_ps(qv, load8v(kr[j], v * 8, dt), p[j]);
            }
        }
        _mm256_storeu_ps(s + c, reduce8(p)); /* c + 8 <= TILE */
    }
    ahead_put(nx, &ah);
}

/* Lane j of the result = the sum of p[j]'s 8 lanes, for four vectors. */
INLINE __m128 reduce4(const __m256 *p)
{
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* NH (2 or 3) query heads' scores at once, four keys at a time: each K vector is loaded once
 * for the NH heads' FMAs (4 * NH chains), where scoring one head at a time (above) loads
 * it once per head. A short last group repeats its first row, as there. */
INLINE void score_heads_avx2(const float *qf, const void *const *krows, int nt, const int NH,
                             const int NV, const int dt, float *s, struct ahead *nx)
{
    const int vbytes = dt == DT_F32 ? 32 : 16;
    struct ahead ah = ahead_take(nx);
    for (int c = 0; c < nt; c += 4) {
        const int n = nt - c < 4 ? nt - c : 4;
        const void *kr[4];
        for (int j = 0; j < 4; j++)
            kr[j] = krows[c + (j < n ? j : 0)];
        __m256 p[3][4];
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < 4; j++)
                p[h][j] = _mm256_setzero_ps();
        for (int v = 0; v < NV; v++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                ahead_step(&ah, v * vbytes);
                const __m256 k = load8v(kr[j], v * 8, dt);
                for (int h = 0; h < NH; h++)
                    p[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (h * NV + v) * 8), k, p[h][j]);
            }
        for (int h = 0; h < NH; h++)
            _mm_storeu_ps(s + h * TILE + c, reduce4(p[h])); /* c + 4 <= TILE */
    }
    ahead_put(nx, &ah);
}

/* The G heads' scores: three or two heads a pass (threes where G allows, else one three and
 * then twos), the next block's lines asked for in the first pass only. A lone head takes
 * eight keys at a time: four chains would wait on the FMA's latency. */
INLINE void score_tile_grouped_avx2(const float *qf, const void *const *krows, int nt, int G,
                                    const int NV, const int dt, float *s, struct ahead *nx)
{
    if (G == 1) {
        score_head_avx2(qf, krows, nt, NV, dt, s, nx);
        return;
    }
    for (int g = 0; g < G;) {
        const int nh = G % 3 == 0 || (G % 2 && g == 0) ? 3 : 2;
        const float *qg = qf + g * NV * 8;
        if (nh == 3)
            score_heads_avx2(qg, krows, nt, 3, NV, dt, s + g * TILE, g ? NULL : nx);
        else
            score_heads_avx2(qg, krows, nt, 2, NV, dt, s + g * TILE, g ? NULL : nx);
        g += nh;
    }
}

/* NH heads' DC vectors of D at a time held in registers (NH * DC <= 12, the rest for the
 * weights and a row's vector), so each V vector is loaded once for the NH heads. */
INLINE void accum_heads_avx2(float *acc, const float *corr, const void *const *vrows, int nt,
                             const int NH, const int NV, const int DC, const int dt,
                             const float *s, struct ahead *nx)
{
    const int D = 8 * NV, vbytes = dt == DT_F32 ? 32 : 16;
    struct ahead ah = ahead_take(nx);
    for (int v0 = 0; v0 < NV; v0 += DC) {
        __m256 a[12];
        for (int h = 0; h < NH; h++) {
            const __m256 cv = _mm256_set1_ps(corr[h]);
            for (int i = 0; i < DC; i++)
                a[h * DC + i] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + (v0 + i) * 8), cv);
        }
        for (int t = 0; t < nt; t++) {
            __m256 p[3];
            for (int h = 0; h < NH; h++)
                p[h] = _mm256_broadcast_ss(s + h * TILE + t);
            for (int i = 0; i < DC; i++) {
                ahead_step(&ah, (v0 + i) * vbytes);
                const __m256 x = load8v(vrows[t], (v0 + i) * 8, dt);
                for (int h = 0; h < NH; h++)
                    a[h * DC + i] = _mm256_fmadd_ps(p[h], x, a[h * DC + i]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < DC; i++)
                _mm256_storeu_ps(acc + h * D + (v0 + i) * 8, a[h * DC + i]);
    }
    ahead_put(nx, &ah);
}

/* The G heads three at a time (12 accumulators of four vectors each); a lone head takes
 * eight vectors, so eight FMA chains still hide the FMA's latency. */
INLINE void accum_tile_avx2(float *acc, const float *corr, const void *const *vrows, int nt,
                            int G, const int NV, const int dt, const float *s, struct ahead *nx)
{
    for (int g = 0; g < G;) {
        const int nh = G - g < 3 ? G - g : 3;
        float *ag = acc + g * NV * 8;
        const float *cg = corr + g, *sg = s + g * TILE;
        struct ahead *p = g ? NULL : nx;
        if (nh == 3)
            accum_heads_avx2(ag, cg, vrows, nt, 3, NV, 4, dt, sg, p);
        else if (nh == 2)
            accum_heads_avx2(ag, cg, vrows, nt, 2, NV, 4, dt, sg, p);
        else
            accum_heads_avx2(ag, cg, vrows, nt, 1, NV, 8, dt, sg, p);
        g += nh;
    }
}
#endif /* AVX2_STEPS */

/* Turns a tile's scores into probabilities against the running max; corr[g] is what the
 * accumulator so far must be scaled by. The corrections of up to 16 heads come from one
 * 16-lane exp2 (libmvec; the lanes past G compute exp2(0), unused): a scalar exp2f per head
 * and tile, called from AVX-512 code, took 3.5 % of a 64-row bfloat16 decode step (perf),
 * 7x the time of the tiles' vector calls. */
static inline void softmax_tile(float *s, int nt, int G, int first, float *m, float *l,
                                float *corr)
{
    for (int g0 = 0; g0 < G; g0 += 16) {
        const int n = G - g0 < 16 ? G - g0 : 16;
        float mx[16], diff[16] = {0}, c[16];
        for (int j = 0; j < n; j++) {
            const float *sg = s + (g0 + j) * TILE;
            float x = first ? sg[0] : m[g0 + j];
            for (int t = 0; t < nt; t++)
                x = sg[t] > x ? sg[t] : x;
            mx[j] = x;
            /* no -inf sentinel for an empty history: -ffast-math assumes finite values */
            diff[j] = first ? 0.f : m[g0 + j] - x;
        }
#pragma omp simd
        for (int i = 0; i < 16; i++)
            c[i] = exp2_weight(diff[i]);
        for (int j = 0; j < n; j++) {
            const int g = g0 + j;
            float *sg = s + g * TILE;
            corr[g] = first ? 0.f : c[j];
            float sum = 0.f;
            for (int t = 0; t < nt; t++) {
                sg[t] = exp2_weight(sg[t] - mx[j]);
                sum += sg[t];
            }
            l[g] = l[g] * corr[g] + sum;
            m[g] = mx[j];
        }
    }
}

/* One work item: sequence b's tokens [t_begin, t_end) (t_begin on a block's start), KV
 * heads [h0, h0 + a->hg). Block by block, each head's tile is scored, softmaxed and
 * accumulated, and the next block's rows fetched as these are read. The result goes to the
 * output, or with part (a split sequence's item) the softmax state to that record. With
 * all heads in one item the block's rows form one contiguous run; per-head items read rows
 * strided by Hkv * D from scattered blocks and measured ~20% slower.
 * Inlined into one copy per (head_dim, dtype) pair below: constants let the compiler keep
 * a head's accumulators in registers and drop the dtype branches. NV > 0 selects the
 * vector steps, AVX-512's for D = 16 * NV or AVX2's for D = 8 * NV; NV = 0 the portable
 * ones for any D. QDP (AVX512-BF16 builds, bf16 query and cache) scores with vdpbf16ps on
 * the query as given. */
INLINE void decode_item(const struct args *a, int b, int h0, int t_begin, int t_end,
                        float *part, float *scratch, const int D, const int NV, const int dt,
                        const int QDP)
{
    (void)NV, (void)QDP; /* only the AVX-512 and AVX2 builds read them */
#ifdef __AVX512F__
    const int split = NV && dt == DT_BF16; /* q and acc in split order (see the top) */
#else
    const int split = 0;
#endif
    const int G = a->Hq / a->Hkv, HG = a->hg, Hkv = a->Hkv, bs = a->bs;
    const size_t esize = dt == DT_F32 ? 4 : 2, row_stride = (size_t)Hkv * D * esize;
    float *qf = scratch, *acc = qf + HG * G * D, *s = acc + HG * G * D, *m = s + G * TILE;
    float *l = m + HG * G, *corr = l + HG * G;
    const void *krows[TILE], *vrows[TILE];
    /* exp2 of log2(e)-scaled scores: one multiply folded into q instead of one per key */
    const float qscale = a->scale * 1.4426950408889634f;
    const int64_t q0 = (int64_t)b * a->q_stride_b + (int64_t)h0 * G * D;
    const uint16_t *qb = (const uint16_t *)a->q + q0; /* read only when QDP */
    (void)qb;

    if (!QDP) /* vdpbf16ps scores read the query as given */
        for (int i = 0; i < HG * G * D; i++) {
            const float x = at_dt(a->q, q0 + i, a->q_dt);
            /* D is a multiple of 32 when split, so the order is per 32 of the flat index */
            qf[split ? split_pos(i) : i] = x * qscale;
        }
    memset(acc, 0, sizeof(float) * HG * G * D);
    for (int i = 0; i < HG * G; i++)
        l[i] = 0.f;

    const int32_t *table = a->tables + (int64_t)b * a->bt_stride;
    const int len = t_end; /* as far as this item reads */
    int first = 1;
    for (int start = t_begin; start < len; start += bs) {
        const int n = len - start < bs ? len - start : bs;
        /* token 0 of this block for KV head h0; token t is t * row_stride further */
        const size_t off = (((size_t)table[start / bs] * bs) * Hkv + h0) * D * esize;
        /* the next block is elsewhere in memory (the hardware prefetchers cannot guess
         * where): each row read asks for its counterpart there, into L2 (locality 2:
         * prefetcht1; measured on a Zen 4 from DRAM, 3-25% faster than into L1). */
        const ptrdiff_t pf =
            start + bs < len
                ? (ptrdiff_t)((((size_t)table[start / bs + 1] * bs) * Hkv + h0) * D * esize) -
                      (ptrdiff_t)off
                : 0;
#ifdef AVX2_STEPS
        /* the AVX2 steps ask for the next block in address order (struct ahead) */
        struct ahead nx;
        ahead_start(&nx, pf ? (const char *)a->k + off + pf : NULL,
                    (const char *)a->v + off + pf, row_stride, (int)(HG * D * esize),
                    len - start - bs < bs ? len - start - bs : bs);
#endif
        for (int t0 = 0; t0 < n; t0 += TILE) {
            const int nt = n - t0 < TILE ? n - t0 : TILE;
            for (int hl = 0; hl < HG; hl++) {
                const char *kb = (const char *)a->k + off + hl * D * esize;
                const char *vb = (const char *)a->v + off + hl * D * esize;
                for (int t = 0; t < nt; t++) {
                    krows[t] = kb + (t0 + t) * row_stride;
                    vrows[t] = vb + (t0 + t) * row_stride;
                }
                const float *qh = qf + hl * G * D;
                float *ah = acc + hl * G * D, *mh = m + hl * G, *lh = l + hl * G;
                float *ch = corr + hl * G;
#ifdef __AVX512F__
                if (NV && dt == DT_F32) {
                    score_tile_simd(qh, krows, nt, G, NV, s, pf);
                    softmax_tile(s, nt, G, first, mh, lh, ch);
                    accum_tile_simd(ah, ch, vrows, nt, G, NV, s, pf);
                } else if (NV) {
#ifdef __AVX512BF16__
                    if (QDP)
                        score_tile_dp(qb + hl * G * D, krows, nt, G, NV, qscale, s, pf);
                    else
#endif
                        score_tile_split(qh, krows, nt, G, NV, s, pf);
                    softmax_tile(s, nt, G, first, mh, lh, ch);
                    accum_tile_split(ah, ch, vrows, nt, G, NV, s, pf);
                } else
#elif defined(AVX2_STEPS)
                if (NV) {
                    score_tile_grouped_avx2(qh, krows, nt, G, NV, dt, s, &nx);
                    softmax_tile(s, nt, G, first, mh, lh, ch);
                    accum_tile_avx2(ah, ch, vrows, nt, G, NV, dt, s, &nx);
                } else
#endif
                {
                    score_tile_c(qh, krows, nt, G, D, dt, s, pf);
                    softmax_tile(s, nt, G, first, mh, lh, ch);
                    accum_tile_c(ah, ch, vrows, nt, G, D, dt, s, pf);
                }
            }
            first = 0;
        }
    }

    if (part) { /* whole rows (h0 0): the record holds every head, acc put in order */
        for (int i = 0; i < HG * G; i++) {
            part[i] = m[i];
            part[a->Hq + i] = l[i];
            float *pa = part + 2 * a->Hq + (size_t)i * D;
            const float *ai = acc + i * D;
            for (int d = 0; d < D; d++)
                pa[d] = ai[split ? split_pos(d) : d];
        }
        return;
    }
    const int64_t o0 = ((int64_t)b * a->Hq + (int64_t)h0 * G) * D;
    for (int i = 0; i < HG * G; i++) {
        const float inv = 1.f / l[i];
        const float *ai = acc + i * D;
        if (a->q_dt == DT_F32) {
            float *o = (float *)a->out + o0 + (int64_t)i * D;
            for (int d = 0; d < D; d++)
                o[d] = ai[split ? split_pos(d) : d] * inv;
        } else {
            uint16_t *o = (uint16_t *)a->out + o0 + (int64_t)i * D;
            for (int d = 0; d < D; d++)
                o[d] = f32_to_bf16(ai[split ? split_pos(d) : d] * inv);
        }
    }
}

typedef void (*item_fn)(const struct args *, int, int, int, int, float *, float *);
#define ITEM(name, D, NV, DT, QDP)                                                           \
    static void name(const struct args *a, int b, int h0, int t0, int t1, float *part,      \
                     float *s)                                                              \
    {                                                                                       \
        decode_item(a, b, h0, t0, t1, part, s, D, NV, DT, QDP);                             \
    }
#if defined(__AVX512F__) || defined(AVX2_STEPS)
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
ITEM(item_d64_f32, 64, 64 / LANES, DT_F32, 0)
ITEM(item_d64_bf16, 64, 64 / LANES, DT_BF16, 0)
ITEM(item_d128_f32, 128, 128 / LANES, DT_F32, 0)
ITEM(item_d128_bf16, 128, 128 / LANES, DT_BF16, 0)
#endif
#ifdef __AVX512BF16__
ITEM(item_d64_bf16_dp, 64, 4, DT_BF16, 1)
ITEM(item_d128_bf16_dp, 128, 8, DT_BF16, 1)
#endif
ITEM(item_any_f32, a->D, 0, DT_F32, 0)
ITEM(item_any_bf16, a->D, 0, DT_BF16, 0)

static item_fn pick_item(int D, int q_dt, int kv_dt)
{
    (void)D, (void)q_dt; /* only the vector builds have per-D and per-query copies */
#ifdef __AVX512BF16__
    if (q_dt == DT_BF16 && kv_dt == DT_BF16 && (D == 64 || D == 128))
        return D == 64 ? item_d64_bf16_dp : item_d128_bf16_dp;
#endif
#if defined(__AVX512F__) || defined(AVX2_STEPS)
    if (D == 64)
        return kv_dt == DT_F32 ? item_d64_f32 : item_d64_bf16;
    if (D == 128)
        return kv_dt == DT_F32 ? item_d128_f32 : item_d128_bf16;
#endif
    return kv_dt == DT_F32 ? item_any_f32 : item_any_bf16;
}

/* 0 when every sequence's length is in [1, max_blocks * block_size] and every block it
 * uses is in [0, num_blocks). Otherwise 1 (bad length) or 2 (bad block id), with the
 * sequence in *bad_row and the offending value in *bad_value. */
int pd_validate(const int32_t *lens, const int32_t *tables, int64_t bt_stride, int B,
                int max_blocks, int block_size, int64_t num_blocks, int *bad_row,
                int64_t *bad_value)
{
    for (int b = 0; b < B; b++) {
        const int64_t len = lens[b];
        if (len < 1 || len > (int64_t)max_blocks * block_size) {
            *bad_row = b;
            *bad_value = len;
            return 1;
        }
        const int32_t *row = tables + (int64_t)b * bt_stride;
        for (int64_t i = 0; i < (len + block_size - 1) / block_size; i++) {
            if (row[i] < 0 || row[i] >= num_blocks) {
                *bad_row = b;
                *bad_value = row[i];
                return 2;
            }
        }
    }
    return 0;
}

/* The redo side of claim_items (pd_decode_team_redo): the flags of the call's items, how a
 * thread waits for one a sibling holds, and the tests' hook between a claim and its work. */
struct redo {
    uint8_t *flags;
    int (*wait)(const uint8_t *);
    void (*claimed)(void);
};

/* Item i's sequence, first KV head and token range. first[] (B + 1 entries, a thread's
 * own) holds each sequence's first item, or is NULL where no sequence is split (item i:
 * sequence i / (Hkv / hg), the heads from (i % (Hkv / hg)) * hg). */
static void locate(const struct args *a, const int32_t *first, int i, int *b, int *h0,
                   int *t0, int *t1)
{
    if (!first) {
        const int per_seq = a->Hkv / a->hg;
        *b = i / per_seq, *h0 = (i % per_seq) * a->hg, *t0 = 0, *t1 = a->lens[*b];
        return;
    }
    *h0 = 0; /* split calls take whole rows */
    int lo = 0, hi = a->B - 1; /* the last sequence whose first item is <= i */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= i)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int len = a->lens[lo];
    *b = lo, *t0 = (i - first[lo]) * a->limit;
    *t1 = *t0 + a->limit < len ? *t0 + a->limit : len;
}

/* Computes item i: into the output, or into its record where its sequence is split. */
static void run_item(const struct args *a, item_fn item, const int32_t *first, int i,
                     float *scratch)
{
    int b, h0, t0, t1;
    locate(a, first, i, &b, &h0, &t0, &t1);
    const int whole = t0 == 0 && t1 == a->lens[b];
    float *part = whole ? NULL : a->partials + (size_t)i * partial_floats(a->Hq, a->D);
    item(a, b, h0, t0, t1, part, scratch);
}

/* Sequence b's output from its n records at rec: each head's states rescaled to the largest
 * max (log2 units, as the items keep them) and summed in item order, then normalised. */
static void merge_sequence(const struct args *a, int b, const float *rec, int n)
{
    const int Hq = a->Hq, D = a->D;
    const size_t pf = partial_floats(Hq, D);
    for (int h = 0; h < Hq; h++) {
        float mx = rec[h];
        for (int j = 1; j < n; j++)
            mx = rec[j * pf + h] > mx ? rec[j * pf + h] : mx;
        float acc[D], l = 0.f;
        memset(acc, 0, sizeof acc);
        for (int j = 0; j < n; j++) {
            const float *r = rec + j * pf, w = exp2_weight(r[h] - mx);
            l += r[Hq + h] * w;
            const float *ra = r + 2 * Hq + (size_t)h * D;
            for (int d = 0; d < D; d++)
                acc[d] += ra[d] * w;
        }
        const float inv = 1.f / l;
        const int64_t o0 = ((int64_t)b * Hq + h) * D;
        if (a->q_dt == DT_F32)
            for (int d = 0; d < D; d++)
                ((float *)a->out)[o0 + d] = acc[d] * inv;
        else
            for (int d = 0; d < D; d++)
                ((uint16_t *)a->out)[o0 + d] = f32_to_bf16(acc[d] * inv);
    }
}

/* The split sequences b with b % nt == t merged into the output, once every record is in. */
static void merge_share(const struct args *a, int t, int nt)
{
    for (int b = 0, i = 0; b < a->B; b++) {
        const int n = ranges_of(a->lens[b], a->limit);
        if (n > 1 && b % nt == t)
            merge_sequence(a, b, a->partials + (size_t)i * partial_floats(a->Hq, a->D), n);
        i += n;
    }
}

/* The tokens item i reads (first: as locate takes it). */
static int item_tokens(const struct args *a, const int32_t *first, int i)
{
    int b, h0, t0, t1;
    locate(a, first, i, &b, &h0, &t0, &t1);
    return t1 - t0;
}

static int descending(const void *x, const void *y)
{
    const int64_t u = *(const int64_t *)x, v = *(const int64_t *)y;
    return (u < v) - (u > v);
}

/* order[j]: the item claimed j-th, longest first (equal ones in item order), the greedy
 * that leaves the least for the last thread: claimed in item order, a sequence of 1,839
 * tokens behind two ranges of 1,056 kept one thread busy 2,895 tokens long against the
 * other's 1,053. Every thread of a call computes the same order. keys: items int64s. */
static void claim_order(const struct args *a, const int32_t *first, int64_t *keys,
                        int32_t *order)
{
    for (int i = 0; i < a->items; i++)
        keys[i] = (int64_t)item_tokens(a, first, i) << 32 | (uint32_t)(INT32_MAX - i);
    qsort(keys, (size_t)a->items, sizeof *keys, descending);
    for (int j = 0; j < a->items; j++)
        order[j] = INT32_MAX - (int32_t)(keys[j] & 0xffffffff);
}

/* Work items of one call, claimed one at a time from *next by every thread that calls this
 * with the same arguments, in claim_order. Dynamic claiming: sequences differ in length,
 * so a static split would leave a thread idle while another finishes the long ones. With
 * redo, each item is flagged once written, and a thread out of items computes any its
 * siblings hold that redo->wait gives up on; then it merges every split sequence itself
 * (the same values whoever writes them). Without redo the caller merges once all items are
 * in (merge_share). Returns 0, or -1 when this thread's scratch memory could not be
 * allocated (its items are left to the others; the caller reports the failure). */
static int claim_items(const struct args *a, int *next, const struct redo *redo)
{
    const item_fn item = pick_item(a->D, a->q_dt, a->kv_dt);
    const int split = a->hg == a->Hkv && a->items > a->B;
    /* common.h's, kept per thread: allocated per call, the team's threads met at malloc's
     * lock at every layer of a decode step, all arriving at attention together (the process
     * has one arena, pdserve.engine.heap_tuning, and a thread that finds the lock taken
     * sleeps on it). After the item's floats: the sort keys (int64, so at an even float),
     * the claim order, and where split each sequence's first item (all four bytes each). */
    const size_t sf = (scratch_floats(a) + 1) / 2 * 2, n = (size_t)a->items;
    float *scratch = thread_scratch(sf + 2 * n + n + (split ? (size_t)a->B + 1 : 0));
    if (!scratch)
        return -1;
    int64_t *keys = (int64_t *)(scratch + sf);
    int32_t *order = (int32_t *)(scratch + sf + 2 * n), *first = NULL;
    if (split) {
        first = order + n;
        for (int b = 0, i = 0; b <= a->B; b++) {
            first[b] = i;
            i += b < a->B ? ranges_of(a->lens[b], a->limit) : 0;
        }
    }
    claim_order(a, first, keys, order);
    for (;;) {
        const int j = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (j >= a->items)
            break;
        if (redo)
            redo->claimed();
        run_item(a, item, first, order[j], scratch);
        if (redo)
            __atomic_store_n(&redo->flags[order[j]], 1, __ATOMIC_RELEASE);
    }
    if (!redo)
        return 0;
    for (int i = 0; i < a->items; i++)
        if (!redo->wait(&redo->flags[i])) {
            run_item(a, item, first, i, scratch);
            __atomic_store_n(&redo->flags[i], 1, __ATOMIC_RELEASE);
        }
    if (split)
        merge_share(a, 0, 1);
    return 0;
}

/* Where no sequence is split: whether a work item takes all KV heads of a sequence (whole
 * rows: contiguous reads, and the AVX2 steps ask for the next block in address order)
 * rather than one head. Yes with four sequences a thread or more, and with fewer while the
 * threads stay evenly loaded (no sequence longer than 1.25x an even share of all the
 * tokens); a short sequence alone, or a longer one among shorter ones, is split by heads.
 * Whole rows against one head each, the kernel alone on SmolLM2's heads from DRAM on two
 * Zen 3 cores: 0.66-0.86x at 2-7 sequences of 256-1,000 tokens (docs/benchmarks.md section
 * 6, session 32). Either way each head's values are the same. */
static int whole_rows(const int32_t *lens, int B, int num_threads)
{
    if (B >= 4 * num_threads)
        return 1;
    int64_t total = 0, longest = 0;
    for (int b = 0; b < B; b++) {
        total += lens[b];
        longest = lens[b] > longest ? lens[b] : longest;
    }
    return 4 * longest * num_threads <= 5 * total;
}

static struct args make_args(const void *q, int64_t q_stride_b, const void *k, const void *v,
                             const int32_t *tables, int64_t bt_stride, const int32_t *lens,
                             void *out, int B, int Hq, int Hkv, int D, int block_size,
                             float scale, int q_dt, int kv_dt, int num_threads,
                             float *partials)
{
    const int limit = pd_range_tokens(lens, B, block_size);
    int items = 0;
    for (int b = 0; b < B; b++)
        items += ranges_of(lens[b], limit);
    const int hg = items > B || whole_rows(lens, B, num_threads) ? Hkv : 1;
    if (items == B)
        items = B * (Hkv / hg);
    const struct args a = {q, k, v, tables, lens, out, q_stride_b, bt_stride,
                           B, Hq, Hkv, D, block_size, q_dt, kv_dt, scale, hg, limit,
                           items, partials};
    return a;
}

/* The most work items a call of B sequences has: one a KV head each, or where sequences are
 * split, at most ceil(len / limit) ranges each with the limit at least total / SPLIT_PARTS,
 * so at most SPLIT_PARTS ranges past each sequence's first (and as many partial records). */
static int max_ranges(int B)
{
    return B + SPLIT_PARTS;
}

int pd_max_items(int B, int Hkv)
{
    return B * Hkv > max_ranges(B) ? B * Hkv : max_ranges(B);
}

/* Floats of the partial records a call of B sequences may write (pd_decode_team's and
 * pd_decode_team_redo's partials). */
int64_t pd_partials_floats(int B, int Hq, int D)
{
    return (int64_t)max_ranges(B) * (int64_t)partial_floats(Hq, D);
}

/* Whether a call over these lengths splits a sequence: its team then merges after its
 * items (pd_decode_team_merge). */
int pd_splits(const int32_t *lens, int B, int block_size)
{
    const int limit = pd_range_tokens(lens, B, block_size);
    for (int b = 0; b < B; b++)
        if (lens[b] > limit)
            return 1;
    return 0;
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
int pd_decode(const void *q, int64_t q_stride_b, const void *k, const void *v,
              const int32_t *tables, int64_t bt_stride, const int32_t *lens, void *out, int B,
              int Hq, int Hkv, int D, int block_size, float scale, int q_dt, int kv_dt,
              int num_threads)
{
    if (num_threads < 1)
        num_threads = 1;
    float *partials = NULL;
    if (pd_splits(lens, B, block_size)) {
        partials = malloc((size_t)pd_partials_floats(B, Hq, D) * sizeof(float));
        if (!partials)
            return -1;
    }
    const struct args a = make_args(q, q_stride_b, k, v, tables, bt_stride, lens, out, B, Hq,
                                    Hkv, D, block_size, scale, q_dt, kv_dt, num_threads,
                                    partials);
    int next = 0, failed = 0;
    if (num_threads > a.items)
        num_threads = a.items;
#pragma omp parallel num_threads(num_threads)
    {
        if (claim_items(&a, &next, NULL))
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        if (partials) {
#pragma omp barrier
            merge_share(&a, omp_get_thread_num(), omp_get_num_threads());
        }
    }
    free(partials);
    return failed ? -1 : 0;
}

/* pd_decode's work shared by the nt threads of an enclosing parallel region, each calling
 * it with the same arguments and the same *next (zero before the first of them arrives).
 * Where pd_splits, partials holds pd_partials_floats and the outputs of split sequences are
 * written by pd_decode_team_merge, which the team calls once every thread is through here.
 * Returns what claim_items returns for this thread. */
int pd_decode_team(const void *q, int64_t q_stride_b, const void *k, const void *v,
                   const int32_t *tables, int64_t bt_stride, const int32_t *lens, void *out,
                   int B, int Hq, int Hkv, int D, int block_size, float scale, int q_dt,
                   int kv_dt, int nt, int *next, float *partials)
{
    const struct args a = make_args(q, q_stride_b, k, v, tables, bt_stride, lens, out, B, Hq,
                                    Hkv, D, block_size, scale, q_dt, kv_dt, nt, partials);
    return claim_items(&a, next, NULL);
}

/* Thread t of nt: its share of the split sequences' outputs, from the records pd_decode_team
 * left in partials (the same arguments). */
void pd_decode_team_merge(const void *q, int64_t q_stride_b, const int32_t *tables,
                          int64_t bt_stride, const int32_t *lens, void *out, int B, int Hq,
                          int Hkv, int D, int block_size, int q_dt, int kv_dt, int t, int nt,
                          float *partials)
{
    const struct args a = make_args(q, q_stride_b, NULL, NULL, tables, bt_stride, lens, out, B,
                                    Hq, Hkv, D, block_size, 1.f, q_dt, kv_dt, nt, partials);
    merge_share(&a, t, nt);
}

/* pd_decode_team's work where no thread waits on another (decode_stack.c's GEMV form).
 * Items are claimed from *next as there; each item, once written (its output rows, or its
 * partial record), is flagged in flags[item] (pd_max_items of them, zeroed before the first
 * thread arrives). A thread with no item left to claim goes through the items others
 * claimed: for each one not flagged, wait(flag) gives its taker a moment, and if it returns
 * 0 the thread computes the item itself; then it writes every split sequence's output from
 * the records. Every value is the same whoever computes it. claimed() is called between
 * claiming an item and computing it (the tests' way to make a thread lose its core there).
 * partials: pd_partials_floats, not shared with any call another thread may still be in.
 * On return (0) every output is written and visible to this thread; -1 when its scratch
 * memory could not be allocated (nothing computed here). */
int pd_decode_team_redo(const void *q, int64_t q_stride_b, const void *k, const void *v,
                        const int32_t *tables, int64_t bt_stride, const int32_t *lens,
                        void *out, int B, int Hq, int Hkv, int D, int block_size, float scale,
                        int q_dt, int kv_dt, int nt, int *next, uint8_t *flags,
                        int (*wait)(const uint8_t *), void (*claimed)(void), float *partials)
{
    const struct args a = make_args(q, q_stride_b, k, v, tables, bt_stride, lens, out, B, Hq,
                                    Hkv, D, block_size, scale, q_dt, kv_dt, nt, partials);
    const struct redo redo = {flags, wait, claimed};
    return claim_items(&a, next, &redo);
}
