/* A whole decode step's decoder layers in one call, for the few sequences of a CPU decode
 * step: per layer QKV projection, RoPE, the K/V store, paged attention, O projection,
 * residual add + RMSNorm, gate/up projection, SiLU * up, down projection, residual add +
 * the next norm — the same kernels the model's Python loop calls one by one (gemv.c,
 * layer_ops.c, paged_decode.c), in the same order, so the result is the same bit for bit
 * (with int8 projections: the same up to the model dtype's rounding of the de-quantized
 * weights the loop reads).
 *
 * Why: at batch 1 the weights stream in ~20 ms, while calling ~10 kernels a layer from
 * Python costs ~15 ms more (dispatch, checks, a parallel region each; measured on a 30-layer
 * model with tiny dims). This is the CPU's counterpart of a captured CUDA graph: one entry,
 * one parallel region for all layers; the projections are split over its threads, the
 * small element-wise steps and attention run on one of them while the others wait at the
 * barrier.
 *
 * A thread whose share is done takes what its siblings have not started (see "Work
 * sharing" below): on two cores the gateway and the workers' event loops take a core from
 * one engine thread now and then, and with fixed shares the other thread would spin at the
 * next barrier until the first came back to its share. Every column and row is computed
 * the same way whichever thread takes it, so the result does not depend on who took what.
 *
 * Inputs are validated by the caller (decode_stack.py) once per step; the kernels' own
 * checks that need data (RoPE positions) are repeated here and reported.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#include <sched.h>
#include <stdatomic.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* A barrier that spins (then yields) instead of sleeping. The phases of a step are tens of
 * microseconds apart; where the process runs with OMP_WAIT_POLICY=PASSIVE (workers sharing
 * cores, pdserve.cluster) an OpenMP barrier puts the waiting thread to sleep and wakes it
 * through the kernel at every one of the ~150 barriers of a step: 32-33 ms per float32
 * step against 21-23 with spinning waits, measured. Between steps the threads still wait
 * as the policy says (the parallel region ends with each step). Past SPIN_LIMIT pauses a
 * waiter yields its core, so a descheduled sibling costs at most that spin. */
#define SPIN_LIMIT (1 << 14)

struct spin_barrier {
    atomic_int arrived;
    atomic_int phase;
    int threads;
};

static void barrier_wait(struct spin_barrier *b)
{
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (unsigned spins = 0;
         atomic_load_explicit(&b->phase, memory_order_acquire) == phase; spins++) {
        if (spins < SPIN_LIMIT)
            CPU_RELAX();
        else
            sched_yield();
    }
}

/* Called by every thread of a parallel region: its number, the team's size (the team
 * OpenMP gave, maybe fewer than asked), and the barrier sized to that team. */
static void join_team(struct spin_barrier *bar, int *t, int *nt)
{
    *t = team_thread();
    *nt = team_size();
#pragma omp single
    bar->threads = *nt;
}

/* the kernels this file strings together (same library) */
void gv_widen(const void *x, int64_t x_stride, float *xf, int64_t M, int64_t K, int dt, int q8);
size_t gv_xbuf_bytes(int64_t M, int64_t K, int q8);
void gv_rows(const float *xf, const void *w, const float *scales, void *y, int64_t y_stride,
             int64_t M, int64_t n0, int64_t n1, int64_t K, int dt);
void lo_add_rms_norm(void *x, int64_t x_stride, const void *delta, const void *weight,
                     void *out, int64_t T, int H, float eps, int dt, int num_threads);
int64_t lo_rope(void *qk, int64_t row_stride, const int64_t *positions, const void *cos_t,
                const void *sin_t, int64_t max_position, int64_t T, int heads, int D, int dt,
                int num_threads);
void lo_silu_mul(const void *gate_up, void *out, int64_t T, int I, int dt, int num_threads);
int pd_decode(const void *q, int64_t q_stride_b, const void *k, const void *v,
              const int32_t *tables, int64_t bt_stride, const int32_t *lens, void *out, int B,
              int Hq, int Hkv, int D, int block_size, float scale, int q_dt, int kv_dt,
              int num_threads);
int pd_decode_team(const void *q, int64_t q_stride_b, const void *k, const void *v,
                   const int32_t *tables, int64_t bt_stride, const int32_t *lens, void *out,
                   int B, int Hq, int Hkv, int D, int block_size, float scale, int q_dt,
                   int kv_dt, int nt, int *next);
void al_blocks(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
               int64_t K, uint16_t *y, int64_t y_stride, int64_t nb0, int64_t nb1,
               int64_t next_nb);
int al_available(void);
void fp_blocks(const float *x, int64_t x_stride, int64_t M, const float *packed, int64_t K,
               float *y, int64_t y_stride, int64_t p0, int64_t p1);
int fp_available(void);
#define FP_PANEL 32 /* columns per float32 panel (f32_panels.c's PANEL) */

/* Work sharing. Each step of a layer splits its work (output columns, rows, attention's
 * items) into one share per thread, as a fixed split would, and each thread goes through
 * its own share front to back in runs, claimed from its own counter (a cache line no other
 * thread writes while it has work of its own: the claim costs a few cycles). A thread done
 * with its share takes runs from the others' shares that have not started. Without a
 * sibling preempted this is the fixed split: each thread streams one contiguous run of
 * weights. With one, the preempted thread leaves at most the run it holds (two for the
 * tiles, which claim one ahead to prefetch it). */
#define GV_RUN_BYTES 32768 /* weights one GEMV run streams (at ~20 GB/s: ~1.6 us) */
#define AL_RUN 2           /* 16-column N-blocks per tile run (32 columns: the tiles' pair) */
#define AL_BLOCK 16        /* columns per N-block (amx_linear.c's NBLOCK) */
#define ROW_RUN 4          /* rows per run of an element-wise step */

/* The steps of a layer, each with its counters (per layer; one more set for the norm
 * before the first layer). */
enum { W_QKV, W_ROPE, W_ATTN, W_O, W_POST_NORM, W_GATE_UP, W_SILU, W_DOWN, W_NEXT_NORM,
       W_STEPS };

struct share_counter {
    int runs; /* runs taken from this thread's share */
    char pad[60];
};

/* A thread's view of its team and of the step's counters, [(L + 1) * W_STEPS][stride],
 * zeroed before the parallel region. */
struct team {
    struct share_counter *counters;
    int t, nt, stride;
};

static inline int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* The next run [*i0, *i1) of this thread's among n items of `step`, in runs of `run`:
 * from its own share while that lasts, then from the others'. 0 when none is left. */
static int take(const struct team *tm, int64_t step, int64_t n, int64_t run, int64_t *i0,
                int64_t *i1)
{
    struct share_counter *c = tm->counters + step * tm->stride;
    for (int k = 0; k < tm->nt; k++) {
        const int v = (tm->t + k) % tm->nt;
        const int64_t s0 = n * v / tm->nt, s1 = n * (v + 1) / tm->nt;
        if (s0 + __atomic_load_n(&c[v].runs, __ATOMIC_RELAXED) * run >= s1)
            continue; /* done or empty: no claim, so a finished share's line stays quiet */
        const int64_t at = s0 + __atomic_fetch_add(&c[v].runs, 1, __ATOMIC_RELAXED) * run;
        if (at < s1) {
            *i0 = at;
            *i1 = min64(at + run, s1);
            return 1;
        }
    }
    return 0;
}

/* 1 for the thread that runs a one-thread step: the first to get to it. */
static int first_here(const struct team *tm, int64_t step)
{
    return __atomic_fetch_add(&tm->counters[step * tm->stride].runs, 1, __ATOMIC_RELAXED) == 0;
}

/* Zeroed counters for a step of L layers and up to `threads` threads, or NULL. */
static struct share_counter *new_counters(int64_t L, int threads)
{
    const size_t bytes = (size_t)(L + 1) * W_STEPS * threads * sizeof(struct share_counter);
    struct share_counter *c = aligned_alloc(64, bytes);
    if (c)
        memset(c, 0, bytes);
    return c;
}

/* y = xf @ w^T (gv_rows), in runs of output columns. */
static void gv_share(const struct team *tm, int64_t step, const float *xf, const void *w,
                     const float *scales, void *y, int64_t y_stride, int64_t M, int64_t N,
                     int64_t K, int dt)
{
    const int64_t row_bytes = K * (scales ? 1 : dt == DT_F32 ? 4 : 2);
    const int64_t run = GV_RUN_BYTES / row_bytes > 0 ? GV_RUN_BYTES / row_bytes : 1;
    for (int64_t n0, n1; take(tm, step, N, run, &n0, &n1);)
        gv_rows(xf, w, scales, y, y_stride, M, n0, n1, K, dt);
}

/* y [M, N] = x @ W^T on the tiles (al_blocks), in runs of N-blocks. A thread claims its
 * next run before computing the one it holds, so it can prefetch that run's weights. */
static void al_share(const struct team *tm, int64_t step, const uint16_t *x, int64_t x_stride,
                     int64_t M, const uint16_t *packed, int64_t N, int64_t K, uint16_t *y)
{
    const int64_t nblocks = N / AL_BLOCK;
    int64_t b0, b1, n0, n1;
    for (int more = take(tm, step, nblocks, AL_RUN, &b0, &b1); more; b0 = n0, b1 = n1) {
        more = take(tm, step, nblocks, AL_RUN, &n0, &n1);
        al_blocks(x, x_stride, M, packed, K, y, N, b0, b1, more ? n0 : -1);
    }
}

/* The shapes of one model and one cache, fixed for its life. */
struct ds_model {
    int64_t L, H, Hq, Hkv, D, I, max_position, block_size;
    int64_t cache_layer_stride; /* elements from one layer's K to the next's; V is half way */
    float eps, scale;
    int dt, kv_dt;
};

/* Row `src` (n elements, dtype dt) into the cache at `dst` (dtype kv_dt). */
static void store_row(void *dst, const void *src, int64_t n, int dt, int kv_dt)
{
    if (dt == kv_dt) {
        memcpy(dst, src, (size_t)n * (dt == DT_F32 ? 4 : 2));
        return;
    }
    /* float32 model over a bfloat16 cache (the only mixed pair the engine makes) */
    const float *s = src;
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++)
        d[i] = f32_to_bf16(s[i]);
}

/* The batched form (packed non-NULL): every projection over the packed copies the layer
 * loop also reads for these batches (bfloat16 on AMX tiles, amx_linear.c; float32 on
 * AVX-512 panels, f32_panels.c), in runs of 32 output columns, and every other step in
 * runs too: of rows for the element-wise steps, of work items for attention. The layer
 * loop runs the same kernels for these batches (pdserve::amx_linear or
 * pdserve::f32_panels_linear, the layer ops, the paged decode kernel), each row computed
 * the same way whichever thread takes it, so the result is the loop's bit for bit. Buffers
 * that feed a projection get rows up to the next multiple of 16, zeroed, for the tiles to
 * read. */
static void packed_share(const struct team *tm, int64_t step, const char *x, int64_t x_stride,
                         int64_t M, const void *packed, int64_t N, int64_t K, char *y, int dt)
{
    if (dt == DT_BF16) {
        al_share(tm, step, (const uint16_t *)x, x_stride, M, packed, N, K, (uint16_t *)y);
        return;
    }
    for (int64_t p0, p1; take(tm, step, N / FP_PANEL, 1, &p0, &p1);)
        fp_blocks((const float *)x, x_stride, M, packed, K, (float *)y, N, p0, p1);
}

static int batched_layers(const struct ds_model *m, const void *const *weights,
                          const void *const *packed, const void *final_norm, void *cache,
                          void *x, void *out, const int64_t *positions, const int64_t *slots,
                          const int32_t *lens, const int32_t *tables, int64_t bt_stride,
                          const void *cos_t, const void *sin_t, int64_t M, int num_threads)
{
    const int dt = m->dt;
    const size_t es = dt == DT_F32 ? 4 : 2, kv_es = m->kv_dt == DT_F32 ? 4 : 2;
    const int64_t H = m->H, QD = m->Hq * m->D, KVD = m->Hkv * m->D, I = m->I;
    const int64_t QKV = QD + 2 * KVD, M16 = (M + 15) / 16 * 16;
    for (int64_t b = 0; b < M; b++) /* before any write: rows are shared out below */
        if (positions[b] < 0 || positions[b] >= m->max_position)
            return -2;
    const int want = num_threads > 1 ? num_threads : 1;
    char *scratch = malloc((size_t)(M16 * (H + QD + I) + M * (QKV + 2 * I + H)) * es);
    struct share_counter *work = new_counters(m->L, want);
    if (!scratch || !work) {
        free(scratch);
        free(work);
        return -1;
    }
#define AT(p, n) ((p) + (size_t)(n) * es) /* element n of a buffer of dtype dt */
    char *h = scratch, *attn = AT(h, M16 * H), *act = AT(attn, M16 * QD);
    char *qkv = AT(act, M16 * I), *gu = AT(qkv, M * QKV), *y = AT(gu, M * 2 * I);
    memset(AT(h, M * H), 0, (size_t)((M16 - M) * H) * es);
    memset(AT(attn, M * QD), 0, (size_t)((M16 - M) * QD) * es);
    memset(AT(act, M * I), 0, (size_t)((M16 - M) * I) * es);
    char *const xs = x;
    int rc = 0;
    struct spin_barrier bar = {0, 0, want};
#pragma omp parallel num_threads(want)
    {
        struct team tm = {work, 0, 1, want};
        join_team(&bar, &tm.t, &tm.nt);
        for (int64_t r0, r1; take(&tm, m->L * W_STEPS + W_NEXT_NORM, M, ROW_RUN, &r0, &r1);)
            lo_add_rms_norm(AT(xs, r0 * H), H, NULL, weights[0], AT(h, r0 * H), r1 - r0,
                            (int)H, m->eps, dt, 1);
        barrier_wait(&bar);
        for (int64_t l = 0; l < m->L; l++) {
            const void *const *w = weights + 6 * l;
            const void *const *p = packed + 6 * l;
            const int64_t c = l * W_STEPS; /* this layer's counters */
            char *k_cache = (char *)cache + (size_t)(l * m->cache_layer_stride) * kv_es;
            char *v_cache = k_cache + (size_t)(m->cache_layer_stride / 2) * kv_es;
            packed_share(&tm, c + W_QKV, h, H, M, p[1], QKV, H, qkv, dt);
            barrier_wait(&bar);
            /* positions were checked above: RoPE cannot refuse a row */
            for (int64_t r0, r1; take(&tm, c + W_ROPE, M, ROW_RUN, &r0, &r1);) {
                lo_rope(AT(qkv, r0 * QKV), QKV, positions + r0, cos_t, sin_t, m->max_position,
                        r1 - r0, (int)(m->Hq + m->Hkv), (int)m->D, dt, 1);
                for (int64_t b = r0; b < r1; b++) {
                    const char *row = AT(qkv, b * QKV);
                    store_row(k_cache + (size_t)(slots[b] * KVD) * kv_es, AT(row, QD), KVD, dt,
                              m->kv_dt);
                    store_row(v_cache + (size_t)(slots[b] * KVD) * kv_es, AT(row, QD + KVD),
                              KVD, dt, m->kv_dt);
                }
            }
            barrier_wait(&bar);
            if (pd_decode_team(qkv, QKV, k_cache, v_cache, tables, bt_stride, lens, attn,
                               (int)M, (int)m->Hq, (int)m->Hkv, (int)m->D, (int)m->block_size,
                               m->scale, dt, m->kv_dt, tm.nt,
                               &work[(c + W_ATTN) * want].runs))
                __atomic_store_n(&rc, -3, __ATOMIC_RELAXED);
            barrier_wait(&bar);
            if (__atomic_load_n(&rc, __ATOMIC_RELAXED)) /* every thread leaves here */
                break;
            packed_share(&tm, c + W_O, attn, QD, M, p[2], H, QD, y, dt);
            barrier_wait(&bar);
            for (int64_t r0, r1; take(&tm, c + W_POST_NORM, M, ROW_RUN, &r0, &r1);)
                lo_add_rms_norm(AT(xs, r0 * H), H, AT(y, r0 * H), w[3], AT(h, r0 * H), r1 - r0,
                                (int)H, m->eps, dt, 1);
            barrier_wait(&bar);
            packed_share(&tm, c + W_GATE_UP, h, H, M, p[4], 2 * I, H, gu, dt);
            barrier_wait(&bar);
            for (int64_t r0, r1; take(&tm, c + W_SILU, M, ROW_RUN, &r0, &r1);)
                lo_silu_mul(AT(gu, r0 * 2 * I), AT(act, r0 * I), r1 - r0, (int)I, dt, 1);
            barrier_wait(&bar);
            packed_share(&tm, c + W_DOWN, act, I, M, p[5], H, I, y, dt);
            barrier_wait(&bar);
            const void *next_norm = l + 1 < m->L ? weights[6 * (l + 1)] : final_norm;
            for (int64_t r0, r1; take(&tm, c + W_NEXT_NORM, M, ROW_RUN, &r0, &r1);)
                lo_add_rms_norm(AT(xs, r0 * H), H, AT(y, r0 * H), next_norm, AT(h, r0 * H),
                                r1 - r0, (int)H, m->eps, dt, 1);
            barrier_wait(&bar);
        }
    }
#undef AT
    if (!rc)
        memcpy(out, h, (size_t)(M * H) * es);
    free(scratch);
    free(work);
    return rc;
}

/* weights: 6 pointers per layer (input_norm, qkv, o, post_norm, gate_up, down); scales:
 * NULL, or 6 per layer likewise where the projections are int8 (a float32 scale per output
 * row; the norms' entries unused), the activations then staying float32 for them; cache:
 * the [L, 2, num_blocks, block_size, Hkv, D] KV cache; x [M, H] the residual stream (the
 * embeddings in, updated in place); out [M, H] the final norm of the last residual;
 * packed: NULL, or 6 per layer likewise, the projections packed for the batched kernels
 * (al_pack for bfloat16, fp_pack for float32): then the batched form above runs.
 * Returns 0; -1 no memory; -2 a position outside the RoPE tables; -3 the attention kernel
 * failed; -4 a slot outside the cache (nothing written); -5 packed weights given where this
 * build or machine lacks the batched kernel (nothing written). */
int ds_decode_layers(const struct ds_model *m, const void *const *weights,
                     const float *const *scales, const void *const *packed,
                     const void *final_norm, void *cache, void *x, void *out,
                     const int64_t *positions, const int64_t *slots, const int32_t *lens,
                     const int32_t *tables, int64_t bt_stride, const void *cos_t,
                     const void *sin_t, int64_t num_slots, int64_t M, int num_threads)
{
    for (int64_t b = 0; b < M; b++)
        if (slots[b] < 0 || slots[b] >= num_slots)
            return -4;
    if (packed && !(m->dt == DT_BF16 ? al_available() : fp_available()))
        return -5;
    if (packed)
        return batched_layers(m, weights, packed, final_norm, cache, x, out, positions, slots,
                              lens, tables, bt_stride, cos_t, sin_t, M, num_threads);
    const int dt = m->dt;
    const int q8 = scales != NULL;
    static const float *const no_scales[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    const size_t es = dt == DT_F32 ? 4 : 2, kv_es = m->kv_dt == DT_F32 ? 4 : 2;
    const int64_t H = m->H, QD = m->Hq * m->D, KVD = m->Hkv * m->D, I = m->I;
    const int64_t QKV = QD + 2 * KVD;
    const int64_t widest = H > QD ? (H > I ? H : I) : (QD > I ? QD : I);
    char *scratch = malloc((size_t)M * (size_t)(H + QKV + QD + 2 * I + I + H) * es);
    /* x prepared for the projections (float32 rows, or quantized for int8 weights): the
     * buffer grows with K, so the widest input sizes it */
    float *xf = malloc(gv_xbuf_bytes(M, widest, q8));
    const int want = num_threads > 1 ? num_threads : 1;
    struct share_counter *work = new_counters(m->L, want);
    if (!scratch || !xf || !work) {
        free(scratch);
        free(xf);
        free(work);
        return -1;
    }
    void *h = scratch, *qkv = scratch + M * H * es, *attn = (char *)qkv + M * QKV * es;
    void *gu = (char *)attn + M * QD * es, *act = (char *)gu + M * 2 * I * es;
    void *y = (char *)act + M * I * es;
    int rc = 0;
    struct spin_barrier bar = {0, 0, want};
#pragma omp parallel num_threads(want)
    {
        struct team tm = {work, 0, 1, want};
        join_team(&bar, &tm.t, &tm.nt);
        /* The one-thread steps (element-wise, attention over these few rows) go to the
         * first thread that gets to them; the barrier after each publishes what it wrote. */
        if (first_here(&tm, m->L * W_STEPS + W_NEXT_NORM)) {
            lo_add_rms_norm(x, H, NULL, weights[0], h, M, (int)H, m->eps, dt, 1);
            gv_widen(h, H, xf, M, H, dt, q8);
        }
        barrier_wait(&bar);
        for (int64_t l = 0; l < m->L; l++) {
            const void *const *w = weights + 6 * l;
            const float *const *sc = scales ? scales + 6 * l : no_scales;
            const int64_t c = l * W_STEPS; /* this layer's counters */
            char *k_cache = (char *)cache + (size_t)(l * m->cache_layer_stride) * kv_es;
            char *v_cache = k_cache + (size_t)(m->cache_layer_stride / 2) * kv_es;
            gv_share(&tm, c + W_QKV, xf, w[1], sc[1], qkv, QKV, M, QKV, H, dt);
            barrier_wait(&bar);
            if (first_here(&tm, c + W_ATTN)) {
                int err = 0;
                if (lo_rope(qkv, QKV, positions, cos_t, sin_t, m->max_position, M,
                            (int)(m->Hq + m->Hkv), (int)m->D, dt, 1) >= 0)
                    err = -2;
                for (int64_t b = 0; b < M && !err; b++) {
                    const char *row = (const char *)qkv + (size_t)(b * QKV) * es;
                    store_row(k_cache + (size_t)(slots[b] * KVD) * kv_es, row + QD * es, KVD,
                              dt, m->kv_dt);
                    store_row(v_cache + (size_t)(slots[b] * KVD) * kv_es,
                              row + (QD + KVD) * es, KVD, dt, m->kv_dt);
                }
                if (!err && pd_decode(qkv, QKV, k_cache, v_cache, tables, bt_stride, lens,
                                      attn, (int)M, (int)m->Hq, (int)m->Hkv, (int)m->D,
                                      (int)m->block_size, m->scale, dt, m->kv_dt, 1))
                    err = -3;
                if (err)
                    __atomic_store_n(&rc, err, __ATOMIC_RELAXED);
                else
                    gv_widen(attn, QD, xf, M, QD, dt, q8);
            }
            barrier_wait(&bar);
            if (__atomic_load_n(&rc, __ATOMIC_RELAXED)) /* every thread leaves here */
                break;
            gv_share(&tm, c + W_O, xf, w[2], sc[2], y, H, M, H, QD, dt);
            barrier_wait(&bar);
            if (first_here(&tm, c + W_POST_NORM)) {
                lo_add_rms_norm(x, H, y, w[3], h, M, (int)H, m->eps, dt, 1);
                gv_widen(h, H, xf, M, H, dt, q8);
            }
            barrier_wait(&bar);
            gv_share(&tm, c + W_GATE_UP, xf, w[4], sc[4], gu, 2 * I, M, 2 * I, H, dt);
            barrier_wait(&bar);
            if (first_here(&tm, c + W_SILU)) {
                lo_silu_mul(gu, act, M, (int)I, dt, 1);
                gv_widen(act, I, xf, M, I, dt, q8);
            }
            barrier_wait(&bar);
            gv_share(&tm, c + W_DOWN, xf, w[5], sc[5], y, H, M, H, I, dt);
            barrier_wait(&bar);
            if (first_here(&tm, c + W_NEXT_NORM)) {
                lo_add_rms_norm(x, H, y, l + 1 < m->L ? weights[6 * (l + 1)] : final_norm, h,
                                M, (int)H, m->eps, dt, 1);
                if (l + 1 < m->L)
                    gv_widen(h, H, xf, M, H, dt, q8);
            }
            barrier_wait(&bar);
        }
    }
    if (!rc)
        memcpy(out, h, (size_t)(M * H) * es);
    free(scratch);
    free(xf);
    free(work);
    return rc;
}
