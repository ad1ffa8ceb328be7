/* Sampling's filters on the CPU: each sampled row of logits divided by its temperature,
 * cut by its top-k and top-p, and the exponential race drawn over what they keep, in one
 * call with no [B, V] temporary. pdserve.engine.device_sampler's `_top_k_top_p_sorted`
 * (the whole row sorted) is the definition, and the reference in the tests.
 *
 * Why: the torch path sorts a row's 512 or 4,096 largest logits (topk), or the whole row
 * when its set reaches past them. One stream of the default model sampled with top_p 0.95
 * at temperature 1.0 took 15.6 ms a decode step against 6.9 greedy, 64 streams 272 ms
 * against 142 (docs/bench/cpu-s23/sampled_steps.py).
 *
 * Per row, y = x / t into the thread's scratch (a division, as torch's: -ffast-math would
 * multiply by 1 / t, ~80 % of the quotients an ulp off; divide_row's optimize attribute
 * keeps it out, -fno-reciprocal-math alone did not, and only there: a function with it
 * inlines nothing, and the exp and log loops must). Pass 1: the max m. Pass 2: each y's
 * bucket by (m - y) in quarter powers of two of its weight e = 2^((y - m) log2 e), and
 * each bucket's count and mass. The candidates are the buckets from the top that hold the
 * top-k set (count >= k; the k-th value lies in the last of them) or, without top-k, the
 * top-p mass (mass >= p of the row's) and one more bucket for rounding; only they are
 * sorted (value descending, index ascending; a radix sort). Then the definition on them:
 * top-k keeps the values >= the k-th (ties kept); top-p's probabilities are e / Z (Z the
 * top-k set's sum, else the row's), summed in sorted order in double and rounded to float
 * as torch's CPU cumsum does, and a token is dropped once the mass before it reaches p
 * (the first always stays). Should top-p's candidates end before it drops anything, the
 * whole row is sorted instead. Min-p last, over what those keep (a prefix of the sorted
 * candidates): a token is dropped when y - m < log(min_p) (see min_p_threshold). A top-p
 * row with min-p gathers no bucket past the last one a kept weight can reach: the tokens
 * min-p keeps all lie there, so the nucleus need not be followed further. A row with min-p
 * and neither top-k nor top-p sorts nothing and computes no weight: one pass picks the
 * tokens it keeps. The race then runs over the kept tokens with the plain race's score
 * (sampling_noise.h); a row with no filter runs the race over all of y.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "sampling_noise.h"

#define NB 512 /* buckets: a quarter power of two of the weight each, 2^-128 in all */
#define PER_OCTAVE 4.f

/* The bytes of work one thread needs for rows of V logits, a multiple of 64 so every
 * thread's share starts aligned as the whole does. */
#define WORK_PER_THREAD(V) \
    (((V) * (int64_t)(2 * sizeof(struct cand) + sizeof(float) + sizeof(uint16_t)) + 63) \
     & ~(int64_t)63)

struct cand {
    float y;
    int32_t v;
};

/* A float's bits as an unsigned key that sorts descending by value: larger values get
 * smaller keys. */
static inline uint32_t descending_key(float y)
{
    uint32_t u;
    memcpy(&u, &y, sizeof u);
    return ~(u ^ (uint32_t)((int32_t)u >> 31 | (int32_t)0x80000000));
}

/* cand [n] sorted by value descending, index ascending among equal values (the order it
 * arrives in: gather walks the row in index order), by a stable LSD radix sort of the
 * values' keys in three 11-bit digits; tmp: n more. qsort took ~1.5 ms for a nucleus of
 * ~10k tokens. */
static void sort_candidates(struct cand *cand, struct cand *tmp, int64_t n)
{
    for (int shift = 0; shift < 33; shift += 11) {
        int64_t start[2048] = {0};
        for (int64_t i = 0; i < n; i++)
            start[descending_key(cand[i].y) >> shift & 2047]++;
        int64_t sum = 0;
        for (int d = 0; d < 2048; d++) {
            const int64_t c = start[d];
            start[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++)
            tmp[start[descending_key(cand[i].y) >> shift & 2047]++] = cand[i];
        struct cand *t = cand;
        cand = tmp;
        tmp = t;
    }
    /* three passes: the sorted run is in tmp's buffer now, the caller's cand */
    memcpy(tmp, cand, (size_t)n * sizeof *cand);
}

/* 0 for the row's max, NB - 1 for a weight below 2^-127 (a -inf logit included). */
static inline int bucket_of(float y, float m)
{
    return (int)fminf((m - y) * SN_LOG2E * PER_OCTAVE, (float)(NB - 1));
}

static inline float weight(float y, float m)
{
    return exp2_weight((y - m) * SN_LOG2E);
}

static void divide_row(const float *x, int64_t V, float t, float *y)
    __attribute__((noinline, optimize("no-unsafe-math-optimizations")));
static void divide_row(const float *x, int64_t V, float t, float *y)
{
#pragma omp simd
    for (int64_t v = 0; v < V; v++)
        y[v] = x[v] / t;
}

/* Min-p's cut in the logits' own terms, for 0 < min_p <= 1: a token stays when
 * y - m >= log(min_p), i.e. its weight exp(y - m) reaches min_p (torch's old test,
 * probs < min_p * max(probs), is the same rule; its softmax rounds differently from any
 * exp here). The log is libm's, in double, rounded once to float: device_sampler's
 * min_p_threshold calls the same log through Python's math.log, so the torch definition
 * compares against the very same float. Out of -ffast-math, which may narrow
 * (float)log((double)x) to logf (a different rounding). */
static float min_p_threshold(float min_p)
    __attribute__((noinline, optimize("no-unsafe-math-optimizations")));
static float min_p_threshold(float min_p)
{
    return (float)log((double)min_p);
}

/* The last bucket a token min-p keeps can lie in: y - m >= thr puts m - y <= -thr, and
 * bucket_of grows with m - y; one more for the rounding of its product. */
static inline int min_p_reach(float thr)
{
    const int b = bucket_of(thr, 0.f) + 1;
    return b < NB - 1 ? b : NB - 1;
}

/* The tokens of y [V] min-p keeps, !(y - m < thr) as torch tests it, in index order into
 * ky and kidx; their count. This function and the next are kept out of -ffast-math, which
 * may rewrite y - m < thr as y < m + thr, another rounding. Neither calls anything. */
static int64_t min_p_keep(const float *y, int64_t V, float m, float thr, float *ky,
                          int32_t *kidx)
    __attribute__((noinline, optimize("no-unsafe-math-optimizations")));
static int64_t min_p_keep(const float *y, int64_t V, float m, float thr, float *ky,
                          int32_t *kidx)
{
    int64_t n = 0;
    for (int64_t v = 0; v < V; v++) {
        ky[n] = y[v];
        kidx[n] = (int32_t)v;
        n += !(y[v] - m < thr);
    }
    return n;
}

/* How many of the first n sorted candidates min-p keeps: those before the first with
 * y - m < thr (at least the max, whose y - m is 0 >= thr). */
static int64_t min_p_cut(const struct cand *cand, int64_t n, float m, float thr)
    __attribute__((noinline, optimize("no-unsafe-math-optimizations")));
static int64_t min_p_cut(const struct cand *cand, int64_t n, float m, float thr)
{
    int64_t i = 0;
    while (i < n && !(cand[i].y - m < thr))
        i++;
    return i;
}

/* The tokens in buckets <= last into cand, sorted (tmp: as many again); their count. */
static int64_t gather(const float *y, int64_t V, const uint16_t *bucket, int last,
                      struct cand *cand, struct cand *tmp)
{
    int64_t n = 0;
    for (int64_t v = 0; v < V; v++)
        if (bucket[v] <= last)
            cand[n++] = (struct cand){y[v], (int32_t)v};
    sort_candidates(cand, tmp, n);
    return n;
}

/* How many of the sorted candidates top-p keeps: the first i whose mass before it
 * reaches p (at least 1); `n` when none does. */
static int64_t nucleus(const struct cand *cand, int64_t n, float m, double z, float p)
{
    double cum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const float prob = (float)(weight(cand[i].y, m) / z);
        cum += prob;
        if ((float)cum - prob >= p)
            return i > 0 ? i : 1;
    }
    return n;
}

/* The race over the first n candidates, laid out as sn_race takes them in `spare` (8 n
 * bytes past the sorted run). */
static int64_t race_candidates(const struct cand *cand, int64_t n, float m, uint32_t key,
                               struct cand *spare)
{
    float *y = (float *)spare;
    int32_t *idx = (int32_t *)(y + n);
    for (int64_t i = 0; i < n; i++) {
        y[i] = cand[i].y;
        idx[i] = cand[i].v;
    }
    return sn_race(y, idx, n, m, key);
}

/* The draw for one row of logits x [V]; cand: 2 V of scratch, y: V floats. min_p: 0 off. */
static int64_t filtered_row(const float *x, int64_t V, float t, int64_t k, float p,
                            float min_p, uint32_t key, float *y, uint16_t *bucket,
                            struct cand *cand)
{
    const int top_k = k < V, top_p = p < 1.f, use_min_p = min_p > 0.f;
    divide_row(x, V, t, y);
    float m = y[0];
    for (int64_t v = 1; v < V; v++)
        m = y[v] > m ? y[v] : m;
    const float thr = use_min_p ? min_p_threshold(min_p) : 0.f;
    if (!top_k && !top_p) {
        if (!use_min_p)
            return sn_race(y, NULL, V, m, key);
        float *ky = (float *)cand;
        int32_t *kidx = (int32_t *)(ky + V);
        return sn_race(ky, kidx, min_p_keep(y, V, m, thr, ky, kidx), m, key);
    }
    int64_t count[NB] = {0};
    double mass[NB] = {0.0};
    double z_row = 0.0;
    for (int64_t v0 = 0; v0 < V; v0 += 256) {
        const int n = V - v0 < 256 ? (int)(V - v0) : 256;
        float e[256];
        int b[256];
#pragma omp simd
        for (int j = 0; j < n; j++) {
            e[j] = weight(y[v0 + j], m);
            b[j] = bucket_of(y[v0 + j], m);
        }
        for (int j = 0; j < n; j++) {
            bucket[v0 + j] = (uint16_t)b[j];
            count[b[j]]++;
            mass[b[j]] += e[j];
            z_row += e[j];
        }
    }
    int last = 0;
    int covers_min_p = 0; /* the candidates hold every token min-p keeps */
    if (top_k) {
        for (int64_t c = count[0]; c < k && last < NB - 1; c += count[++last])
            ;
    } else {
        const double want = (double)p * z_row;
        for (double c = mass[0]; c < want && last < NB - 1; c += mass[++last])
            ;
        do
            last++;
        while (last < NB - 1 && !count[last]);
        last = last < NB - 1 ? last : NB - 1;
        const int reach = use_min_p ? min_p_reach(thr) : NB;
        if (reach <= last) {
            last = reach;
            covers_min_p = 1;
        }
    }
    int64_t n = gather(y, V, bucket, last, cand, cand + V);
    int64_t kept = n;
    double z = z_row;
    if (top_k) {
        const float kth = cand[k - 1].y;
        for (kept = k; kept < n && cand[kept].y >= kth; kept++)
            ;
        z = 0.0;
        for (int64_t i = 0; i < kept; i++)
            z += weight(cand[i].y, m);
    }
    if (top_p) {
        int64_t cut = nucleus(cand, kept, m, z, p);
        /* the mass ran past the candidates, and min-p does not end before them */
        if (cut == kept && !top_k && !covers_min_p && last < NB - 1) {
            kept = n = gather(y, V, bucket, NB - 1, cand, cand + V);
            cut = nucleus(cand, kept, m, z, p);
        }
        kept = cut;
    }
    if (use_min_p)
        kept = min_p_cut(cand, kept, m, thr);
    return race_candidates(cand, kept, m, key, cand + V);
}

/* tokens[r] for each row r of logits [B, V] (contiguous float32) with greedy[r] == 0: the
 * race over the row / temperature[r] after top_k[r] (V: off), top_p[r] (1: off) and
 * min_p[r] (0: off); greedy rows are left as they are (the caller takes their argmax).
 * keys: the rows' 32-bit stream keys. work: WORK_PER_THREAD(V) bytes, 8-byte aligned, for
 * each of num_threads threads. Returns 0; -1 when a sampled row's top_k is outside [1, V],
 * its temperature not > 0, its top_p outside (0, 1], its min_p outside [0, 1] or its key
 * outside [0, 2^32) (nothing is drawn then). */
int sf_filtered_race(const float *logits, int64_t B, int64_t V, const float *temperature,
                     const int64_t *top_k, const float *top_p, const float *min_p,
                     const float *greedy, const int64_t *keys, int64_t *tokens, uint8_t *work,
                     int num_threads)
{
    int64_t sampled = 0;
    for (int64_t r = 0; r < B; r++) {
        if (greedy[r] != 0.f)
            continue;
        if (top_k[r] < 1 || top_k[r] > V || !(temperature[r] > 0.f) || !(top_p[r] > 0.f)
            || top_p[r] > 1.f || !(min_p[r] >= 0.f) || min_p[r] > 1.f || keys[r] < 0
            || keys[r] > (int64_t)UINT32_MAX)
            return -1;
        sampled++;
    }
    const int threads = sampled > 1 && num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint8_t *mine = work + team_thread() * WORK_PER_THREAD(V);
        struct cand *cand = (struct cand *)mine; /* first: aligned as work is */
        float *y = (float *)(cand + 2 * V);
        uint16_t *bucket = (uint16_t *)(y + V);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < B; r++)
            if (greedy[r] == 0.f)
                tokens[r] = filtered_row(logits + r * V, V, temperature[r], top_k[r],
                                         top_p[r], min_p[r], (uint32_t)keys[r], y, bucket,
                                         cand);
    }
    return 0;
}

/* The bytes of `work` sf_filtered_race needs per thread. */
int64_t sf_work_per_thread(int64_t V)
{
    return WORK_PER_THREAD(V);
}
