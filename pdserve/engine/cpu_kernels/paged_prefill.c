/* Prefill attention over the paged cache on the CPU, flash-attention style: each chunk of
 * query tokens attends to its sequence's cached prefix and causally to itself, reading
 * K/V through the block table (no gather into a padded copy, no mask tensor).
 *
 * Layouts (row-major, elements of D contiguous):
 *   query        [T, Hq, D]   token stride q_stride (elements), heads packed
 *   k/v cache    [num_blocks, block_size, Hkv, D]  contiguous
 *   block_tables [P, max_blocks] int32, row stride bt_stride, one row per chunk
 *   query_start  [P+1] int32, chunk p owns query rows query_start[p]..query_start[p+1]-1
 *   seq_lens     [P] int32, context length after the chunk (cached prefix + chunk)
 *   out          [T, Hq, D]   contiguous, in the query's dtype
 * dtype codes and bf16 conversions: common.h.
 *
 * Work item = (chunk, KV head, tile of consecutive query tokens). The tile's rows are its
 * tokens x the G = Hq / Hkv query heads sharing that KV head, so each K/V row fetched from
 * the cache serves up to ROWS query rows instead of one (the decode kernel's case). Keys go
 * a tile of BK at a time, widened to float32, with a float32 online softmax in base 2.
 * Only the tiles that reach past a row's own position are masked.
 *
 * With AVX-512 or AVX2 (item_t) Q and the output accumulator are held transposed,
 * [D][rows], so every vector spans 16 (AVX2: 8) query rows: scores are K elements
 * broadcast against Q columns, the softmax's max / sum / rescale are plain vector ops
 * across rows, and p.V is V elements broadcast against P columns. Without either (pf_item,
 * also for G > ROWS) rows go one at a time against a transposed K tile. The launcher
 * (paged_prefill.py) validates tables and lengths with pd_validate first, so this trusts
 * its arguments. Requires D % 16 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VECTOR_ROWS 1
#include <immintrin.h>
#endif

#include "common.h"

#define BK 32   /* keys per tile */
#define ROWS 64 /* query rows (tokens x grouped heads) per work item, at most */
#define RB 8    /* the portable path pads rows to a multiple of this */
/* Masked scores and the softmax's starting maximum: finite, since -ffast-math assumes no
 * infinities; exp2f of anything this negative is 0. */
#define NEG_BIG (-1e30f)

struct pf_args {
    const void *q, *k, *v;
    const int32_t *tables, *qstart, *lens;
    void *out;
    int64_t q_stride, bt_stride;
    int P, Hq, Hkv, D, bs, q_dt, kv_dt, G, BQ, rmax;
    float qscale; /* softmax scale * log2(e): exponentials are exp2 */
};

static inline void widen_row(float *dst, const void *src, int D, int dt, float mul)
{
    if (dt == DT_F32) {
        const float *s = (const float *)src;
#pragma omp simd
        for (int d = 0; d < D; d++)
            dst[d] = s[d] * mul;
    } else {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int d = 0; d < D; d++) {
            uint32_t u = (uint32_t)s[d] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            dst[d] = f * mul;
        }
    }
}

#ifdef VECTOR_ROWS

/* The vector steps' ops, VW float32 lanes each: AVX-512's 16 or AVX2's 8. RGMAX: the row
 * vectors a scores / accumulate pass holds (AVX2's 16 registers take four keys or four
 * elements of D against two; AVX-512's 32 take them against four). */
#ifdef __AVX512F__
#define VW 16
#define RGMAX 4
typedef __m512 vfw;
typedef __m512i viw;
INLINE vfw vw_load(const float *p) { return _mm512_load_ps(p); }
INLINE void vw_store(float *p, vfw x) { _mm512_store_ps(p, x); }
INLINE vfw vw_set1(float x) { return _mm512_set1_ps(x); }
INLINE vfw vw_add(vfw a, vfw b) { return _mm512_add_ps(a, b); }
INLINE vfw vw_sub(vfw a, vfw b) { return _mm512_sub_ps(a, b); }
INLINE vfw vw_mul(vfw a, vfw b) { return _mm512_mul_ps(a, b); }
INLINE vfw vw_div(vfw a, vfw b) { return _mm512_div_ps(a, b); }
INLINE vfw vw_max(vfw a, vfw b) { return _mm512_max_ps(a, b); }
INLINE vfw vw_fmadd(vfw a, vfw b, vfw c) { return _mm512_fmadd_ps(a, b, c); }
INLINE viw vw_loadi(const int32_t *p) { return _mm512_loadu_si512(p); }
INLINE void vw_storeu(float *p, vfw x) { _mm512_storeu_ps(p, x); }
/* s where key k is visible to the lane's row (k <= last), NEG_BIG where it is not */
INLINE vfw vw_hide_after(vfw s, viw last, int k)
{
    const __mmask16 hide = _mm512_cmplt_epi32_mask(last, _mm512_set1_epi32(k));
    return _mm512_mask_mov_ps(s, hide, _mm512_set1_ps(NEG_BIG));
}
INLINE int vw_any_not_one(vfw x) { return _mm512_cmpneq_ps_mask(x, _mm512_set1_ps(1.f)) != 0; }
/* 2^round(x), exactly (vscalefps: 0 far below the float range) */
INLINE vfw vw_round(vfw x)
{
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
INLINE vfw vw_scale(vfw p, vfw n) { return _mm512_scalef_ps(p, n); }
INLINE vfw vw_exp2_domain(vfw x) { return x; }
#else
#define VW 8
#define RGMAX 2
typedef __m256 vfw;
typedef __m256i viw;
INLINE vfw vw_load(const float *p) { return _mm256_load_ps(p); }
INLINE void vw_store(float *p, vfw x) { _mm256_store_ps(p, x); }
INLINE vfw vw_set1(float x) { return _mm256_set1_ps(x); }
INLINE vfw vw_add(vfw a, vfw b) { return _mm256_add_ps(a, b); }
INLINE vfw vw_sub(vfw a, vfw b) { return _mm256_sub_ps(a, b); }
INLINE vfw vw_mul(vfw a, vfw b) { return _mm256_mul_ps(a, b); }
INLINE vfw vw_div(vfw a, vfw b) { return _mm256_div_ps(a, b); }
INLINE vfw vw_max(vfw a, vfw b) { return _mm256_max_ps(a, b); }
INLINE vfw vw_fmadd(vfw a, vfw b, vfw c) { return _mm256_fmadd_ps(a, b, c); }
INLINE viw vw_loadi(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE void vw_storeu(float *p, vfw x) { _mm256_storeu_ps(p, x); }
INLINE vfw vw_hide_after(vfw s, viw last, int k)
{
    const __m256i hide = _mm256_cmpgt_epi32(_mm256_set1_epi32(k), last);
    return _mm256_blendv_ps(s, _mm256_set1_ps(NEG_BIG), _mm256_castsi256_ps(hide));
}
INLINE int vw_any_not_one(vfw x)
{
    return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(1.f), _CMP_NEQ_UQ)) != 0;
}
INLINE vfw vw_round(vfw x)
{
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n for n in [-127, 127], n built in the exponent field, where 2^-127 is 0 */
INLINE vfw vw_scale(vfw p, vfw n)
{
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* x at or above -127, so vw_scale's n is (2^x below it is 0 to float precision) */
INLINE vfw vw_exp2_domain(vfw x) { return _mm256_max_ps(x, _mm256_set1_ps(-127.f)); }
#endif
#define MAX_RV (ROWS / VW)

/* 2^x for x <= 0 (a softmax weight, the running max subtracted): 2^round(x) times a
 * degree-6 polynomial for 2^f, f in [-0.5, 0.5] (Taylor; relative error ~1e-7). NEG_BIG
 * gives 0. */
INLINE vfw vw_exp2(vfw x)
{
    x = vw_exp2_domain(x);
    const vfw n = vw_round(x);
    const vfw f = vw_sub(x, n);
    vfw p = vw_set1(1.5403530393381606e-4f);
    p = vw_fmadd(p, f, vw_set1(1.3333558146428443e-3f));
    p = vw_fmadd(p, f, vw_set1(9.618129107628477e-3f));
    p = vw_fmadd(p, f, vw_set1(5.550410866482158e-2f));
    p = vw_fmadd(p, f, vw_set1(0.2402265069591007f));
    p = vw_fmadd(p, f, vw_set1(0.6931471805599453f));
    p = vw_fmadd(p, f, vw_set1(1.f));
    return vw_scale(p, n);
}

/* A vector loaded once into a register for the several FMAs that use it. Left to itself,
 * gcc folds the load into every one of them (four loads for four FMAs, in scores_t and
 * accumulate_t alike); the empty asm makes the loaded value opaque, so it cannot. One
 * 512-token prompt of SmolLM2's heads, float32, two threads on a Zen 4: 2.38-2.42 ->
 * 2.09-2.41 ms a layer (bfloat16 2.67 -> 2.33). */
INLINE vfw load_once(const float *p)
{
    vfw x = vw_load(p);
    __asm__("" : "+v"(x));
    return x;
}

/* St[j][r] = Q[r] . K[j] for keys j < BK, row vectors v0..v0+RG-1 of W = RV * VW rows: Qt
 * is Q transposed [D][W], K rows [BK][D] float32. Four keys x RG vectors per pass. */
INLINE void scores_rg(const float *restrict Qt, const float *restrict K, float *restrict St,
                      int D, int W, int v0, const int RG)
{
    for (int j = 0; j < BK; j += 4) {
        vfw a[4][RGMAX];
        for (int jj = 0; jj < 4; jj++)
            for (int v = 0; v < RG; v++)
                a[jj][v] = vw_set1(0.f);
        const float *k0 = K + (j + 0) * D, *k1 = K + (j + 1) * D, *k2 = K + (j + 2) * D,
                    *k3 = K + (j + 3) * D;
        for (int d = 0; d < D; d++) {
            const vfw b0 = vw_set1(k0[d]), b1 = vw_set1(k1[d]), b2 = vw_set1(k2[d]),
                      b3 = vw_set1(k3[d]);
            for (int v = 0; v < RG; v++) {
                const vfw q = load_once(Qt + d * W + VW * (v0 + v));
                a[0][v] = vw_fmadd(b0, q, a[0][v]);
                a[1][v] = vw_fmadd(b1, q, a[1][v]);
                a[2][v] = vw_fmadd(b2, q, a[2][v]);
                a[3][v] = vw_fmadd(b3, q, a[3][v]);
            }
        }
        for (int jj = 0; jj < 4; jj++)
            for (int v = 0; v < RG; v++)
                vw_store(St + (j + jj) * W + VW * (v0 + v), a[jj][v]);
    }
}

/* Ot[d][r] += sum_j P[j][r] * V[j][d]: four dims x RG vectors per pass. */
INLINE void accumulate_rg(const float *restrict P, const float *restrict V,
                          float *restrict Ot, int D, int W, int v0, const int RG)
{
    for (int d = 0; d < D; d += 4) {
        vfw a[4][RGMAX];
        for (int dd = 0; dd < 4; dd++)
            for (int v = 0; v < RG; v++)
                a[dd][v] = vw_load(Ot + (d + dd) * W + VW * (v0 + v));
        for (int j = 0; j < BK; j++) {
            const float *vr = V + j * D + d;
            const vfw b0 = vw_set1(vr[0]), b1 = vw_set1(vr[1]), b2 = vw_set1(vr[2]),
                      b3 = vw_set1(vr[3]);
            for (int v = 0; v < RG; v++) {
                const vfw pv = load_once(P + j * W + VW * (v0 + v));
                a[0][v] = vw_fmadd(b0, pv, a[0][v]);
                a[1][v] = vw_fmadd(b1, pv, a[1][v]);
                a[2][v] = vw_fmadd(b2, pv, a[2][v]);
                a[3][v] = vw_fmadd(b3, pv, a[3][v]);
            }
        }
        for (int dd = 0; dd < 4; dd++)
            for (int v = 0; v < RG; v++)
                vw_store(Ot + (d + dd) * W + VW * (v0 + v), a[dd][v]);
    }
}

/* The RV row vectors RGMAX at a time (the last group smaller when RGMAX does not divide RV),
 * each group size a compile-time constant. */
INLINE void scores_t(const float *restrict Qt, const float *restrict K, float *restrict St,
                     int D, const int RV)
{
    for (int v0 = 0; v0 < RV; v0 += RGMAX) {
        if (RV - v0 >= RGMAX)
            scores_rg(Qt, K, St, D, RV * VW, v0, RGMAX);
        else
            scores_rg(Qt, K, St, D, RV * VW, v0, RV % RGMAX);
    }
}

INLINE void accumulate_t(const float *restrict P, const float *restrict V, float *restrict Ot,
                         int D, const int RV)
{
    for (int v0 = 0; v0 < RV; v0 += RGMAX) {
        if (RV - v0 >= RGMAX)
            accumulate_rg(P, V, Ot, D, RV * VW, v0, RGMAX);
        else
            accumulate_rg(P, V, Ot, D, RV * VW, v0, RV % RGMAX);
    }
}

/* One work item with every vector running over query rows (RV vectors of VW): Q and O are
 * kept transposed, so K and V rows are used as they are (broadcast per element), and the
 * softmax's max, sum and rescale are plain vector ops across rows. */
INLINE void item_t(const struct pf_args *a, int p, int h, int tile, float *scr, const int RV)
{
    const int G = a->G, D = a->D, bs = a->bs, W = RV * VW;
    const int qs = a->qstart[p], qlen = a->qstart[p + 1] - qs, prefix = a->lens[p] - qlen;
    const int i0 = tile * a->BQ, i1 = i0 + a->BQ < qlen ? i0 + a->BQ : qlen;
    const int R = (i1 - i0) * G;
    const size_t qe = a->q_dt == DT_F32 ? 4 : 2, ke = a->kv_dt == DT_F32 ? 4 : 2;
    float *Qt = scr, *Ot = Qt + (size_t)D * W, *St = Ot + (size_t)D * W;
    float *K = St + (size_t)BK * W, *V = K + (size_t)BK * D;
    const int32_t *table = a->tables + (int64_t)p * a->bt_stride;
    float row[512];

    for (int r = 0; r < W; r++) {
        if (r < R) {
            const int64_t tok = qs + i0 + r / G, head = (int64_t)h * G + r % G;
            widen_row(row, (const char *)a->q + (tok * a->q_stride + head * D) * qe, D,
                      a->q_dt, a->qscale);
            for (int d = 0; d < D; d++)
                Qt[d * W + r] = row[d];
        } else {
            for (int d = 0; d < D; d++)
                Qt[d * W + r] = 0.f;
        }
    }
    memset(Ot, 0, (size_t)D * W * sizeof(float));
    vfw m[MAX_RV], l[MAX_RV];
    viw last[MAX_RV]; /* each row's last visible key; padding rows: key 0 */
    int32_t lastv[ROWS];
    for (int r = 0; r < W; r++)
        lastv[r] = r < R ? prefix + i0 + r / G : 0;
    for (int v = 0; v < RV; v++) {
        m[v] = vw_set1(NEG_BIG);
        l[v] = vw_set1(0.f);
        last[v] = vw_loadi(lastv + VW * v);
    }
    const int kend = prefix + i1, kshared = prefix + i0 + 1;
    for (int k0 = 0; k0 < kend; k0 += BK) {
        const int nk = kend - k0 < BK ? kend - k0 : BK;
        for (int j = 0; j < nk; j++) {
            const int kk = k0 + j;
            const int64_t off = (((int64_t)table[kk / bs] * bs + kk % bs) * a->Hkv + h) * D;
            widen_row(K + (size_t)j * D, (const char *)a->k + off * ke, D, a->kv_dt, 1.f);
            widen_row(V + (size_t)j * D, (const char *)a->v + off * ke, D, a->kv_dt, 1.f);
        }
        if (nk < BK) {
            memset(K + (size_t)nk * D, 0, (size_t)(BK - nk) * D * sizeof(float));
            memset(V + (size_t)nk * D, 0, (size_t)(BK - nk) * D * sizeof(float));
        }
        scores_t(Qt, K, St, D, RV);
        const int masked = k0 + BK > kshared;
        for (int v = 0; v < RV; v++) {
            vfw mt = m[v];
            for (int j = 0; j < BK; j++) {
                vfw s = vw_load(St + j * W + VW * v);
                if (masked) {
                    s = vw_hide_after(s, last[v], k0 + j);
                    vw_store(St + j * W + VW * v, s);
                }
                mt = vw_max(mt, s);
            }
            vfw sum = vw_set1(0.f);
            for (int j = 0; j < BK; j++) {
                const vfw e = vw_exp2(vw_sub(vw_load(St + j * W + VW * v), mt));
                vw_store(St + j * W + VW * v, e);
                sum = vw_add(sum, e);
            }
            const vfw corr = vw_exp2(vw_sub(m[v], mt));
            l[v] = vw_fmadd(l[v], corr, sum);
            m[v] = mt;
            if (vw_any_not_one(corr))
                for (int d = 0; d < D; d++)
                    vw_store(Ot + d * W + VW * v, vw_mul(vw_load(Ot + d * W + VW * v), corr));
        }
        accumulate_t(St, V, Ot, D, RV);
    }
    float inv[ROWS];
    for (int v = 0; v < RV; v++)
        vw_storeu(inv + VW * v, vw_div(vw_set1(1.f), l[v]));
    for (int r = 0; r < R; r++) {
        const int64_t tok = qs + i0 + r / G, head = (int64_t)h * G + r % G;
        const int64_t base = (tok * a->Hq + head) * D;
        for (int d = 0; d < D; d++)
            row[d] = Ot[d * W + r] * inv[r];
        if (a->q_dt == DT_F32) {
            memcpy((float *)a->out + base, row, (size_t)D * sizeof(float));
        } else {
            uint16_t *dst = (uint16_t *)a->out + base;
            for (int d = 0; d < D; d++)
                dst[d] = f32_to_bf16(row[d]);
        }
    }
}
#endif /* VECTOR_ROWS */

static size_t scratch_floats(const struct pf_args *a)
{
    const size_t R = (size_t)a->rmax, D = (size_t)a->D;
    return 2 * R * D + R * BK + 2 * D * BK + 2 * R;
}

/* The portable path (no AVX-512 or AVX2): a few rows at a time against a transposed K tile.
 * Eight-float vectors (common.h's vf8) hold the accumulators. Written as arrays indexed
 * in the inner loop, gcc kept them on the stack and every FMA went through a store and a
 * load: the AVX2 build on one thread, 512 tokens of SmolLM2's heads, took 18.8 ms a layer
 * that way and takes 8.3 now (docs/benchmarks.md section 6, session 18). */
/* S[r][j] = Qs[r] . K[j] for rows 0..rp-1 (rp even); Kt is K transposed, [D][BK]: two
 * rows at a time against each column of K, BK / 8 vectors a row. */
static void scores(const float *restrict Qs, const float *restrict Kt, float *restrict S,
                   int rp, int D)
{
    for (int r = 0; r < rp; r += 2) {
        vf8 a0[BK / 8] = {0}, a1[BK / 8] = {0};
        const float *q0 = Qs + (int64_t)r * D, *q1 = q0 + D;
        for (int d = 0; d < D; d++) {
            const float b0 = q0[d], b1 = q1[d];
            for (int j = 0; j < BK / 8; j++) {
                const vf8 k = load8(Kt + d * BK + 8 * j);
                a0[j] += b0 * k;
                a1[j] += b1 * k;
            }
        }
        for (int j = 0; j < BK / 8; j++) {
            store8(S + r * BK + 8 * j, a0[j]);
            store8(S + (r + 1) * BK + 8 * j, a1[j]);
        }
    }
}

/* O[r] += sum_j P[r][j] * V[j] for rows 0..rp-1 (rp a multiple of 4); V is [BK][D], D a
 * multiple of 16: four rows and 16 elements of D at a time stay in registers over the
 * tile's keys. */
static void accumulate(const float *restrict P, const float *restrict Vs, float *restrict O,
                       int rp, int D)
{
    for (int r = 0; r < rp; r += 4)
        for (int d = 0; d < D; d += 16) {
            vf8 o[4][2];
            for (int i = 0; i < 4; i++) {
                o[i][0] = load8(O + (int64_t)(r + i) * D + d);
                o[i][1] = load8(O + (int64_t)(r + i) * D + d + 8);
            }
            for (int j = 0; j < BK; j++) {
                const vf8 v0 = load8(Vs + j * D + d), v1 = load8(Vs + j * D + d + 8);
                for (int i = 0; i < 4; i++) {
                    const float p = P[(r + i) * BK + j];
                    o[i][0] += p * v0;
                    o[i][1] += p * v1;
                }
            }
            for (int i = 0; i < 4; i++) {
                store8(O + (int64_t)(r + i) * D + d, o[i][0]);
                store8(O + (int64_t)(r + i) * D + d + 8, o[i][1]);
            }
        }
}

static void pf_item(const struct pf_args *a, int p, int h, int tile, float *scr)
{
    const int G = a->G, D = a->D, bs = a->bs;
    const int qs = a->qstart[p], qlen = a->qstart[p + 1] - qs, prefix = a->lens[p] - qlen;
    const int i0 = tile * a->BQ, i1 = i0 + a->BQ < qlen ? i0 + a->BQ : qlen;
    const int R = (i1 - i0) * G, rp = (R + RB - 1) / RB * RB;
    const size_t qe = a->q_dt == DT_F32 ? 4 : 2, ke = a->kv_dt == DT_F32 ? 4 : 2;
    float *Qs = scr, *O = Qs + (size_t)a->rmax * D, *S = O + (size_t)a->rmax * D;
    float *Kt = S + (size_t)a->rmax * BK, *Vs = Kt + (size_t)D * BK, *m = Vs + (size_t)BK * D;
    float *l = m + a->rmax;
    const int32_t *table = a->tables + (int64_t)p * a->bt_stride;

    for (int r = 0; r < rp; r++) {
        if (r < R) {
            const int64_t tok = qs + i0 + r / G, head = (int64_t)h * G + r % G;
            widen_row(Qs + (size_t)r * D,
                      (const char *)a->q + (tok * a->q_stride + head * D) * qe, D, a->q_dt,
                      a->qscale);
        } else {
            memset(Qs + (size_t)r * D, 0, (size_t)D * sizeof(float));
        }
        memset(O + (size_t)r * D, 0, (size_t)D * sizeof(float));
        m[r] = NEG_BIG;
        l[r] = 0.f;
    }
    const int kend = prefix + i1;       /* keys the tile's last token sees */
    const int kshared = prefix + i0 + 1; /* keys every row of the tile sees */
    for (int k0 = 0; k0 < kend; k0 += BK) {
        const int nk = kend - k0 < BK ? kend - k0 : BK;
        for (int j = 0; j < nk; j++) {
            const int kk = k0 + j;
            const int64_t row = ((int64_t)table[kk / bs] * bs + kk % bs) * a->Hkv + h;
            float kr[512];
            widen_row(kr, (const char *)a->k + row * D * ke, D, a->kv_dt, 1.f);
            for (int d = 0; d < D; d++)
                Kt[d * BK + j] = kr[d];
            widen_row(Vs + (size_t)j * D, (const char *)a->v + row * D * ke, D, a->kv_dt, 1.f);
        }
        for (int j = nk; j < BK; j++) {
            for (int d = 0; d < D; d++)
                Kt[d * BK + j] = 0.f;
            memset(Vs + (size_t)j * D, 0, (size_t)D * sizeof(float));
        }
        scores(Qs, Kt, S, rp, D);
        const int masked = k0 + BK > kshared;
        for (int r = 0; r < rp; r++) {
            float *s = S + r * BK;
            if (masked) {
                /* row r sees keys 0..prefix + its token; padding rows see key 0 only */
                const int last = r < R ? prefix + i0 + r / G : 0;
                for (int j = 0; j < BK; j++)
                    if (k0 + j > last)
                        s[j] = NEG_BIG;
            }
            float mt = m[r];
            for (int j = 0; j < BK; j++)
                mt = s[j] > mt ? s[j] : mt;
            if (mt == NEG_BIG) { /* nothing visible yet (only padding rows) */
                for (int j = 0; j < BK; j++)
                    s[j] = 0.f;
                continue;
            }
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < BK; j++) {
                s[j] = exp2_weight(s[j] - mt);
                sum += s[j];
            }
            const float corr = exp2_weight(m[r] - mt);
            l[r] = l[r] * corr + sum;
            m[r] = mt;
            if (corr != 1.f) {
                float *o = O + (size_t)r * D;
#pragma omp simd
                for (int d = 0; d < D; d++)
                    o[d] *= corr;
            }
        }
        accumulate(S, Vs, O, rp, D);
    }
    for (int r = 0; r < R; r++) {
        const int64_t tok = qs + i0 + r / G, head = (int64_t)h * G + r % G;
        const float inv = 1.f / l[r];
        const float *o = O + (size_t)r * D;
        const int64_t base = (tok * a->Hq + head) * D;
        if (a->q_dt == DT_F32) {
            float *dst = (float *)a->out + base;
            for (int d = 0; d < D; d++)
                dst[d] = o[d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)a->out + base;
            for (int d = 0; d < D; d++)
                dst[d] = f32_to_bf16(o[d] * inv);
        }
    }
}

static void run_item(const struct pf_args *a, int p, int h, int tile, float *scr)
{
#ifdef VECTOR_ROWS
    const int qlen = a->qstart[p + 1] - a->qstart[p], i0 = tile * a->BQ;
    const int R = (i0 + a->BQ < qlen ? a->BQ : qlen - i0) * a->G;
    switch ((R + VW - 1) / VW) {
    case 1: item_t(a, p, h, tile, scr, 1); return;
    case 2: item_t(a, p, h, tile, scr, 2); return;
    case 3: item_t(a, p, h, tile, scr, 3); return;
    case 4: item_t(a, p, h, tile, scr, 4); return;
#if VW == 8
    case 5: item_t(a, p, h, tile, scr, 5); return;
    case 6: item_t(a, p, h, tile, scr, 6); return;
    case 7: item_t(a, p, h, tile, scr, 7); return;
    case 8: item_t(a, p, h, tile, scr, 8); return;
#endif
    default: break; /* more than ROWS rows (G > ROWS): the portable path */
    }
#endif
    pf_item(a, p, h, tile, scr);
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 when D is not a multiple
 * of 16 or above 512 (the caller uses another path). */
int pf_prefill(const void *q, int64_t q_stride, const void *k, const void *v,
               const int32_t *tables, int64_t bt_stride, const int32_t *qstart,
               const int32_t *lens, void *out, int P, int Hq, int Hkv, int D, int block_size,
               float scale, int q_dt, int kv_dt, int num_threads)
{
    if (D % 16 || D > 512)
        return -2;
    const int G = Hq / Hkv;
    const int BQ = G >= ROWS ? 1 : ROWS / G;
    struct pf_args a = {q, k, v, tables, qstart, lens, out, q_stride, bt_stride, P, Hq, Hkv,
                        D, block_size, q_dt, kv_dt, G, BQ, 0, scale * 1.4426950408889634f};
    a.rmax = (BQ * G + 15) / 16 * 16; /* whole 16-row vectors for either path */
    /* items per chunk: its query tiles x KV heads; a prefix sum maps an item to its chunk */
    int64_t *first = malloc(((size_t)P + 1) * sizeof *first);
    if (!first)
        return -1;
    first[0] = 0;
    for (int p = 0; p < P; p++)
        first[p + 1] = first[p] + (int64_t)((qstart[p + 1] - qstart[p] + BQ - 1) / BQ) * Hkv;
    const int64_t items = first[P];
    if (num_threads < 1)
        num_threads = 1;
    if (num_threads > items)
        num_threads = (int)(items > 0 ? items : 1);
    int64_t next = 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, (scratch_floats(&a) * sizeof(float) + 63) / 64 * 64);
        if (!scratch) {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        } else {
            int p = 0;
            for (;;) {
                const int64_t i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
                if (i >= items)
                    break;
                while (first[p + 1] <= i)
                    p++;
                /* a chunk's last tiles (the most keys) first, so no thread ends on one */
                const int64_t j = i - first[p];
                const int ntiles = (int)((first[p + 1] - first[p]) / Hkv);
                run_item(&a, p, (int)(j % Hkv), ntiles - 1 - (int)(j / Hkv), scratch);
            }
            free(scratch);
        }
    }
    free(first);
    return failed ? -1 : 0;
}
