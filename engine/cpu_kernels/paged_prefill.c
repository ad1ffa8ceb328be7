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
 * dtype codes: 0 = float32, 1 = bfloat16.
 *
 * Work item = (chunk, KV head, tile of consecutive query tokens). The tile's rows are its
 * tokens x the G = Hq / Hkv query heads sharing that KV head, so each K/V row fetched from
 * the cache serves up to ROWS query rows instead of one (the decode kernel's case). Keys go
 * a tile of BK at a time: K is widened to float32 and transposed ([D][BK]) so scores are
 * computed 16 keys per vector FMA; a float32 online softmax (base 2) follows; then V, kept
 * [BK][D], is accumulated 16 dims per FMA. Only the tiles that reach past a row's own
 * position are masked. The launcher (paged_prefill.py) validates tables and lengths with
 * pd_validate first, so this trusts its arguments. Requires D % 16 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define DT_F32 0
#define DT_BF16 1
#define BK 32   /* keys per tile */
#define ROWS 64 /* query rows (tokens x grouped heads) per work item, at most */
#define RB 8    /* rows per score micro-tile */
#define PV_ROWS 4
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

static inline uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* S[r][j] = Qs[r] . K[j] for rows 0..rp-1 (a multiple of RB); Kt is K transposed, [D][BK]. */
static void scores(const float *restrict Qs, const float *restrict Kt, float *restrict S,
                   int rp, int D)
{
#ifdef __AVX512F__
    for (int r = 0; r < rp; r += RB) {
        __m512 a[RB][2];
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++)
            a[i][0] = a[i][1] = _mm512_setzero_ps();
        const float *q = Qs + (int64_t)r * D;
        for (int d = 0; d < D; d++) {
            const __m512 k0 = _mm512_load_ps(Kt + d * BK), k1 = _mm512_load_ps(Kt + d * BK + 16);
#pragma GCC unroll 8
            for (int i = 0; i < RB; i++) {
                const __m512 b = _mm512_set1_ps(q[i * D + d]);
                a[i][0] = _mm512_fmadd_ps(b, k0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(b, k1, a[i][1]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++) {
            _mm512_store_ps(S + (r + i) * BK, a[i][0]);
            _mm512_store_ps(S + (r + i) * BK + 16, a[i][1]);
        }
    }
#else
    for (int r = 0; r < rp; r++) {
        float acc[BK] = {0};
        for (int d = 0; d < D; d++) {
            const float b = Qs[(int64_t)r * D + d];
#pragma omp simd
            for (int j = 0; j < BK; j++)
                acc[j] += b * Kt[d * BK + j];
        }
        memcpy(S + r * BK, acc, sizeof acc);
    }
#endif
}

/* O[r] += sum_j P[r][j] * V[j] for rows 0..rp-1 (a multiple of PV_ROWS); V is [BK][D]. */
static void accumulate(const float *restrict P, const float *restrict Vs, float *restrict O,
                       int rp, int D)
{
#ifdef __AVX512F__
    for (int dc = 0; dc < D; dc += 64) {
        const int nv = D - dc >= 64 ? 4 : (D - dc) / 16;
        for (int r = 0; r < rp; r += PV_ROWS) {
            __m512 a[PV_ROWS][4];
#pragma GCC unroll 4
            for (int i = 0; i < PV_ROWS; i++)
                for (int v = 0; v < 4; v++)
                    a[i][v] = v < nv ? _mm512_load_ps(O + (int64_t)(r + i) * D + dc + 16 * v)
                                     : _mm512_setzero_ps();
            for (int j = 0; j < BK; j++) {
                const float *vr = Vs + j * D + dc;
                __m512 x[4];
                for (int v = 0; v < 4; v++)
                    x[v] = v < nv ? _mm512_load_ps(vr + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int i = 0; i < PV_ROWS; i++) {
                    const __m512 p = _mm512_set1_ps(P[(r + i) * BK + j]);
                    for (int v = 0; v < 4; v++)
                        a[i][v] = _mm512_fmadd_ps(p, x[v], a[i][v]);
                }
            }
#pragma GCC unroll 4
            for (int i = 0; i < PV_ROWS; i++)
                for (int v = 0; v < nv; v++)
                    _mm512_store_ps(O + (int64_t)(r + i) * D + dc + 16 * v, a[i][v]);
        }
    }
#else
    for (int r = 0; r < rp; r++) {
        float *o = O + (int64_t)r * D;
        for (int j = 0; j < BK; j++) {
            const float p = P[r * BK + j];
#pragma omp simd
            for (int d = 0; d < D; d++)
                o[d] += p * Vs[j * D + d];
        }
    }
#endif
}

static size_t scratch_floats(const struct pf_args *a)
{
    const size_t R = (size_t)a->rmax, D = (size_t)a->D;
    return 2 * R * D + R * BK + 2 * D * BK + 2 * R;
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
                s[j] = exp2f(s[j] - mt);
                sum += s[j];
            }
            const float corr = exp2f(m[r] - mt);
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
                dst[d] = to_bf16(o[d] * inv);
        }
    }
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
    a.rmax = (BQ * G + RB - 1) / RB * RB;
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
                pf_item(&a, p, (int)(j % Hkv), ntiles - 1 - (int)(j / Hkv), scratch);
            }
            free(scratch);
        }
    }
    free(first);
    return failed ? -1 : 0;
}
