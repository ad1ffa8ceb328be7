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
#include <time.h>

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
void blocks_rows(const void *x, const uint8_t *w, int fmt, void *y, int64_t y_stride,
                 int64_t M, int64_t n0, int64_t n1, int64_t K, int dt);
int64_t blocks_row_bytes(int64_t K, int fmt);
int blocks_fast(int dt);
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
                   int kv_dt, int nt, int *next, float *partials);
void pd_decode_team_merge(const void *q, int64_t q_stride_b, const int32_t *tables,
                          int64_t bt_stride, const int32_t *lens, void *out, int B, int Hq,
                          int Hkv, int D, int block_size, int q_dt, int kv_dt, int t, int nt,
                          float *partials);
int pd_decode_team_redo(const void *q, int64_t q_stride_b, const void *k, const void *v,
                        const int32_t *tables, int64_t bt_stride, const int32_t *lens,
                        void *out, int B, int Hq, int Hkv, int D, int block_size, float scale,
                        int q_dt, int kv_dt, int nt, int *next, uint8_t *flags,
                        int (*wait)(const uint8_t *), void (*claimed)(void), float *partials);
int pd_max_items(int B, int Hkv);
int64_t pd_partials_floats(int B, int Hq, int D);
int pd_splits(const int32_t *lens, int B, int block_size);
void al_blocks(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
               int64_t K, uint16_t *y, int64_t y_stride, int64_t nb0, int64_t nb1,
               int64_t next_nb);
int al_available(void);
void fp_blocks(const float *x, int64_t x_stride, int64_t M, const float *packed, int64_t K,
               float *y, int64_t y_stride, int64_t p0, int64_t p1, int64_t panels);
int fp_available(void);
#define FP_PANEL 32 /* columns per float32 panel (f32_panels.c's PANEL) */
int bp_blocks(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
              int64_t K, uint16_t *y, int64_t y_stride, int64_t p0, int64_t p1, int64_t panels);
int bp_reserve(int64_t K);
int bp_available(void);
#define BP_PANEL 32 /* columns per bfloat16 panel (bf16_panels.c's PANEL) */

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

/* Zeroed counters for a step of L layers and up to `threads` threads, or NULL. */
static struct share_counter *new_counters(int64_t L, int threads)
{
    const size_t bytes = (size_t)(L + 1) * W_STEPS * threads * sizeof(struct share_counter);
    struct share_counter *c = aligned_alloc(64, bytes);
    if (c)
        memset(c, 0, bytes);
    return c;
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

/* The LM head: logits [M, V] (dtype dt) = the final norm @ w^T. The GEMV form reads w (of
 * dtype dt, or int8 with its scales, as a projection's); the batched form reads packed (the
 * batched kernels' copy), and leaves the logits to the caller where it is NULL. */
struct ds_head {
    const void *w;
    const float *scales;
    const void *blocks; /* NULL, or w as GGUF Q8_0 blocks (the tied embedding's) */
    const void *packed;
    int64_t V;
    void *logits;
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
 * loop also reads for these batches (bfloat16 on AMX tiles, amx_linear.c, or bfloat16
 * panels, AVX512-BF16 or AVX2, bf16_panels.c; float32 on AVX-512 or AVX2 panels,
 * f32_panels.c), in runs of 32 output columns, and every other step in runs too: of rows
 * for the element-wise steps, of work items for attention. The layer loop runs the same
 * kernels for these batches (pdserve::amx_linear, pdserve::bf16_panels_linear or
 * pdserve::f32_panels_linear, the layer ops, the paged decode kernel), each row computed
 * the same way whichever thread takes it, so the result is the loop's bit for bit. Buffers
 * that feed a projection get rows up to the next multiple of 16, zeroed, for the tiles to
 * read. */
static void packed_share(const struct team *tm, int64_t step, const char *x, int64_t x_stride,
                         int64_t M, const void *packed, int64_t N, int64_t K, char *y, int dt,
                         int *rc)
{
    if (dt == DT_BF16 && al_available()) { /* by the machine, as linear._batch_kernel packs */
        al_share(tm, step, (const uint16_t *)x, x_stride, M, packed, N, K, (uint16_t *)y);
        return;
    }
    if (dt == DT_BF16) {
        for (int64_t p0, p1; take(tm, step, N / BP_PANEL, 1, &p0, &p1);)
            if (bp_blocks((const uint16_t *)x, x_stride, M, packed, K, (uint16_t *)y, N, p0,
                          p1, N / BP_PANEL)) { /* no memory: reserved up front, so not expected */
                __atomic_store_n(rc, -1, __ATOMIC_RELAXED);
                return;
            }
        return;
    }
    for (int64_t p0, p1; take(tm, step, N / FP_PANEL, 1, &p0, &p1);)
        fp_blocks((const float *)x, x_stride, M, packed, K, (float *)y, N, p0, p1,
                  N / FP_PANEL);
}

static int batched_layers(const struct ds_model *m, const void *const *weights,
                          const void *const *packed, const void *final_norm,
                          const struct ds_head *head, void *cache, void *x, void *out,
                          const int64_t *positions, const int64_t *slots, const int32_t *lens,
                          const int32_t *tables, int64_t bt_stride, const void *cos_t,
                          const void *sin_t, int64_t M, int num_threads)
{
    const int dt = m->dt;
    const size_t es = dt == DT_F32 ? 4 : 2, kv_es = m->kv_dt == DT_F32 ? 4 : 2;
    const int64_t H = m->H, QD = m->Hq * m->D, KVD = m->Hkv * m->D, I = m->I;
    const int64_t QKV = QD + 2 * KVD, M16 = (M + 15) / 16 * 16;
    const int64_t K_max = H > QD ? (H > I ? H : I) : (QD > I ? QD : I); /* the widest x */
    for (int64_t b = 0; b < M; b++) /* before any write: rows are shared out below */
        if (positions[b] < 0 || positions[b] >= m->max_position)
            return -2;
    const int want = num_threads > 1 ? num_threads : 1;
    /* a long sequence's attention split in token ranges: merged after its items, from
     * records every layer reuses (barriers stand between the layers' attention steps) */
    const int splits = pd_splits(lens, (int)M, (int)m->block_size);
    const size_t partial_bytes =
        splits ? (size_t)pd_partials_floats((int)M, (int)m->Hq, (int)m->D) * sizeof(float) : 0;
    const size_t buffer_bytes = (size_t)(M16 * (H + QD + I) + M * (QKV + 2 * I + H)) * es;
    const size_t partial_at = (buffer_bytes + 63) / 64 * 64;
    char *scratch = malloc(partial_at + partial_bytes);
    struct share_counter *work = new_counters(m->L, want);
    if (!scratch || !work) {
        free(scratch);
        free(work);
        return -1;
    }
    float *const partials = splits ? (float *)(scratch + partial_at) : NULL;
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
        /* the bfloat16 panels' AVX2 form widens x into a scratch of each thread's: made
         * here, so a step without the memory stops before it writes anything */
        if (dt == DT_BF16 && !al_available() && bp_reserve(K_max))
            __atomic_store_n(&rc, -1, __ATOMIC_RELAXED);
        for (int64_t r0, r1; take(&tm, m->L * W_STEPS + W_NEXT_NORM, M, ROW_RUN, &r0, &r1);)
            lo_add_rms_norm(AT(xs, r0 * H), H, NULL, weights[0], AT(h, r0 * H), r1 - r0,
                            (int)H, m->eps, dt, 1);
        barrier_wait(&bar);
        /* rc is read after a barrier, which every thread passes: all leave together */
        for (int64_t l = 0; l < m->L && !__atomic_load_n(&rc, __ATOMIC_RELAXED); l++) {
            const void *const *w = weights + 6 * l;
            const void *const *p = packed + 6 * l;
            const int64_t c = l * W_STEPS; /* this layer's counters */
            char *k_cache = (char *)cache + (size_t)(l * m->cache_layer_stride) * kv_es;
            char *v_cache = k_cache + (size_t)(m->cache_layer_stride / 2) * kv_es;
            packed_share(&tm, c + W_QKV, h, H, M, p[1], QKV, H, qkv, dt, &rc);
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
                               &work[(c + W_ATTN) * want].runs, partials))
                __atomic_store_n(&rc, -3, __ATOMIC_RELAXED);
            barrier_wait(&bar);
            if (splits) {
                pd_decode_team_merge(qkv, QKV, tables, bt_stride, lens, attn, (int)M,
                                     (int)m->Hq, (int)m->Hkv, (int)m->D, (int)m->block_size,
                                     dt, m->kv_dt, tm.t, tm.nt, partials);
                barrier_wait(&bar);
            }
            if (__atomic_load_n(&rc, __ATOMIC_RELAXED)) /* every thread leaves here */
                break;
            packed_share(&tm, c + W_O, attn, QD, M, p[2], H, QD, y, dt, &rc);
            barrier_wait(&bar);
            for (int64_t r0, r1; take(&tm, c + W_POST_NORM, M, ROW_RUN, &r0, &r1);)
                lo_add_rms_norm(AT(xs, r0 * H), H, AT(y, r0 * H), w[3], AT(h, r0 * H), r1 - r0,
                                (int)H, m->eps, dt, 1);
            barrier_wait(&bar);
            packed_share(&tm, c + W_GATE_UP, h, H, M, p[4], 2 * I, H, gu, dt, &rc);
            barrier_wait(&bar);
            for (int64_t r0, r1; take(&tm, c + W_SILU, M, ROW_RUN, &r0, &r1);)
                lo_silu_mul(AT(gu, r0 * 2 * I), AT(act, r0 * I), r1 - r0, (int)I, dt, 1);
            barrier_wait(&bar);
            packed_share(&tm, c + W_DOWN, act, I, M, p[5], H, I, y, dt, &rc);
            barrier_wait(&bar);
            const void *next_norm = l + 1 < m->L ? weights[6 * (l + 1)] : final_norm;
            for (int64_t r0, r1; take(&tm, c + W_NEXT_NORM, M, ROW_RUN, &r0, &r1);)
                lo_add_rms_norm(AT(xs, r0 * H), H, AT(y, r0 * H), next_norm, AT(h, r0 * H),
                                r1 - r0, (int)H, m->eps, dt, 1);
            barrier_wait(&bar);
        }
        /* the logits, shared out as a projection (the last counters' set) */
        if (head && head->packed && !__atomic_load_n(&rc, __ATOMIC_RELAXED))
            packed_share(&tm, m->L * W_STEPS + W_QKV, h, H, M, head->packed, head->V, H,
                         head->logits, dt, &rc);
    }
#undef AT
    if (!rc)
        memcpy(out, h, (size_t)(M * H) * es);
    free(scratch);
    free(work);
    return rc;
}

/* The GEMV form (up to GEMV_MAX_ROWS rows): nothing waits for a thread that lost its core.
 *
 * On two cores the gateway's and the workers' threads take a core from an engine thread
 * for ~0.1-1 ms at a time, several times a step. With a barrier after every step of a
 * layer, the sibling then stops at the next barrier until the preempted thread runs again,
 * so the step loses the whole preemption. Here no thread ever waits for another:
 *  - each projection's output columns are cut into runs (GV_RUN_BYTES of weights each) and
 *    handed out by `take`; a run, once written, is flagged done. A thread out of runs
 *    to take looks for runs taken but not flagged, gives each RUN_WAIT_NS to be flagged, and
 *    then computes it itself. Columns are computed the same way whoever computes them, and
 *    a late writer writes the same values, so two writers do no harm;
 *  - attention's work items (a row's KV heads) go the same way, flagged per item;
 *  - everything else between the projections (RoPE, the K/V store, the residual adds and
 *    norms, SiLU * up, widening x for the next projection) is a few rows' worth of work at
 *    these sizes: every thread does all of it, on its own copies (its residual stream, its
 *    x for the projections). The K/V rows it stores are the same values whoever stores
 *    them, and each thread stores them before it reads the cache;
 *  - so that a preempted thread, when it runs again, cannot overwrite what a later step of
 *    the layer loop reads, every projection of every layer writes a buffer of its own for
 *    the whole call, and x (the embeddings) is only read until the parallel region ends.
 * A thread that finds the last layer done by another leaves at its next step; the region's
 * end still joins every thread, so a thread preempted in the step's last ~ms delays it.
 *
 * With both threads running this is the barrier version's schedule: each streams its own
 * share of each projection's weights and of attention's KV, and the small in-between steps,
 * duplicated, take the time the waiting thread spent at the barrier. */
#define RUN_WAIT_NS 20000 /* a run streams 32 KiB: ~2 us; past 10x that its taker lost its core */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* For the tests: the team thread that sleeps stall_us after each run or item it claims
 * (-1: none), as a thread preempted there would; and the runs and items computed again. */
static int stall_thread = -1, stall_us;
static int64_t redone;

void ds_test_stall(int thread, int us)
{
    stall_thread = thread;
    stall_us = us;
}

int64_t ds_redone(void)
{
    return __atomic_load_n(&redone, __ATOMIC_RELAXED);
}

static void claimed(void)
{
    if (team_thread() == stall_thread) {
        const struct timespec ts = {0, stall_us * 1000L};
        nanosleep(&ts, NULL);
    }
}

/* 1 once *flag is set (acquire: the run's columns are then visible); 0 after RUN_WAIT_NS,
 * counted as a redo (the caller computes it again). */
static int wait_flag(const uint8_t *flag)
{
    const int64_t until = now_ns() + RUN_WAIT_NS;
    for (unsigned spins = 1;; spins++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE))
            return 1;
        CPU_RELAX();
        if (!(spins & 63) && now_ns() > until) {
            __atomic_fetch_add(&redone, 1, __ATOMIC_RELAXED);
            return 0;
        }
    }
}

/* A projection's GGUF blocks and their format (BLOCKS_Q4_1, BLOCKS_Q8_0), or w NULL: its
 * rows are read then. */
struct blocks_ref {
    const void *w;
    int fmt;
};

static inline struct blocks_ref q41_ref(const void *w)
{
    return (struct blocks_ref){w, BLOCKS_Q4_1};
}

/* Output columns per GEMV run: GV_RUN_BYTES of weight rows of K inputs (its GGUF blocks where
 * bl has them, else int8 where q8, else dt). */
static int64_t gv_run_cols(int64_t K, int q8, int dt, struct blocks_ref bl)
{
    const int64_t row_bytes = bl.w ? blocks_row_bytes(K, bl.fmt)
                                   : K * (q8 ? 1 : dt == DT_F32 ? 4 : 2);
    return GV_RUN_BYTES / row_bytes > 0 ? GV_RUN_BYTES / row_bytes : 1;
}

/* The runs of a projection with N outputs over K inputs. */
static int64_t gv_runs(int64_t N, int64_t K, int q8, int dt, struct blocks_ref bl)
{
    const int64_t run = gv_run_cols(K, q8, dt, bl);
    return (N + run - 1) / run;
}

/* Columns [n0, n1) of a projection: over its GGUF blocks where it has them, else over w (and
 * its int8 scales). */
static void gv_cols(const float *xf, const void *w, const float *scales, struct blocks_ref bl,
                    void *y, int64_t y_stride, int64_t M, int64_t n0, int64_t n1, int64_t K,
                    int dt)
{
    if (bl.w)
        blocks_rows(xf, bl.w, bl.fmt, y, y_stride, M, n0, n1, K, dt);
    else
        gv_rows(xf, w, scales, y, y_stride, M, n0, n1, K, dt);
}

/* y = xf @ w^T (gv_rows) in runs of columns; on return every column of y is written and
 * visible to this thread, whoever wrote it. flags: one per run, zeroed before the step. */
static void gv_share_redo(const struct team *tm, int64_t step, uint8_t *flags, const float *xf,
                          const void *w, const float *scales, struct blocks_ref bl, void *y,
                          int64_t y_stride, int64_t M, int64_t N, int64_t K, int dt)
{
    const int q8 = scales != NULL;
    const int64_t run = gv_run_cols(K, q8, dt, bl), R = gv_runs(N, K, q8, dt, bl);
    for (int64_t r, r1; take(tm, step, R, 1, &r, &r1);) {
        claimed();
        gv_cols(xf, w, scales, bl, y, y_stride, M, r * run, min64((r + 1) * run, N), K,
                dt);
        __atomic_store_n(&flags[r], 1, __ATOMIC_RELEASE);
    }
    for (int64_t r = 0; r < R; r++) /* runs others took: wait a little, then redo */
        if (!wait_flag(&flags[r])) {
            gv_cols(xf, w, scales, bl, y, y_stride, M, r * run, min64((r + 1) * run, N),
                    K, dt);
            __atomic_store_n(&flags[r], 1, __ATOMIC_RELEASE);
        }
}

static size_t up64(size_t n)
{
    return (n + 63) / 64 * 64;
}

enum { P_QKV, P_O, P_GATE_UP, P_DOWN, P_ATTN, P_COUNT }; /* a layer's flagged steps */

static int gemv_layers(const struct ds_model *m, const void *const *weights,
                       const float *const *scales, const void *const *blocks,
                       const void *final_norm,
                       const struct ds_head *head, void *cache, void *x, void *out,
                       const int64_t *positions, const int64_t *slots, const int32_t *lens,
                       const int32_t *tables, int64_t bt_stride, const void *cos_t,
                       const void *sin_t, int64_t M, int num_threads)
{
    const int dt = m->dt;
    const int q8 = scales != NULL;
    static const float *const no_scales[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    static const void *const no_blocks[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    const size_t es = dt == DT_F32 ? 4 : 2, kv_es = m->kv_dt == DT_F32 ? 4 : 2;
    const int64_t L = m->L, H = m->H, QD = m->Hq * m->D, KVD = m->Hkv * m->D, I = m->I;
    const int64_t QKV = QD + 2 * KVD;
    const int64_t widest = H > QD ? (H > I ? H : I) : (QD > I ? QD : I);
    for (int64_t b = 0; b < M; b++) /* before any write: RoPE cannot refuse a row below */
        if (positions[b] < 0 || positions[b] >= m->max_position)
            return -2;
    /* shared, per layer: each projection's output; then the final residual */
    const size_t layer_bytes = up64((size_t)(M * QKV) * es) + 2 * up64((size_t)(M * H) * es)
                               + up64((size_t)(M * 2 * I) * es) + up64((size_t)(M * QD) * es);
    /* per thread: residual, norm output, RoPE'd qkv, SiLU * up, x widened (for the head
     * too, which may be int8 where the layers are not, or the other way round) */
    const size_t xf_layers = gv_xbuf_bytes(M, widest, q8);
    const size_t xf_head = head ? gv_xbuf_bytes(M, H, head->scales != NULL) : 0;
    const size_t xf_bytes = xf_layers > xf_head ? xf_layers : xf_head;
    const size_t own_bytes = 2 * up64((size_t)(M * H) * es) + up64((size_t)(M * QKV) * es)
                             + up64((size_t)(M * I) * es) + up64(xf_bytes);
    /* every layer's projections have blocks, or none has: the first layer's say which */
    const void *const *bl0 = blocks ? blocks : no_blocks;
    const int64_t runs[P_COUNT] = {gv_runs(QKV, H, q8, dt, q41_ref(bl0[1])),
                                   gv_runs(H, QD, q8, dt, q41_ref(bl0[2])),
                                   gv_runs(2 * I, H, q8, dt, q41_ref(bl0[4])),
                                   gv_runs(H, I, q8, dt, q41_ref(bl0[5])),
                                   pd_max_items((int)M, (int)m->Hkv) /* attention's items */};
    int64_t max_runs = 0;
    for (int p = 0; p < P_COUNT; p++)
        max_runs = runs[p] > max_runs ? runs[p] : max_runs;
    const int head_q8 = head && head->scales;
    const struct blocks_ref head_bl = {head ? head->blocks : NULL, BLOCKS_Q8_0};
    const int64_t head_runs = head ? gv_runs(head->V, H, head_q8, dt, head_bl) : 0;
    const int want = num_threads > 1 ? num_threads : 1;
    const size_t flag_bytes = up64((size_t)(L * P_COUNT * max_runs + head_runs));
    /* a long sequence's attention records, a set per layer: no barrier keeps a thread that
     * is through a layer's attention from the next layer's while another merges this one's */
    const int64_t partial_floats =
        pd_splits(lens, (int)M, (int)m->block_size)
            ? pd_partials_floats((int)M, (int)m->Hq, (int)m->D) : 0;
    const size_t partial_bytes = up64((size_t)partial_floats * sizeof(float));
    char *shared = aligned_alloc(64, (size_t)L * layer_bytes + up64((size_t)(M * H) * es)
                                     + flag_bytes + (size_t)L * partial_bytes
                                     + (size_t)want * own_bytes);
    struct share_counter *work = new_counters(L, want);
    if (!shared || !work) {
        free(shared);
        free(work);
        return -1;
    }
    char *const x_final = shared + (size_t)L * layer_bytes;
    uint8_t *const flags = (uint8_t *)x_final + up64((size_t)(M * H) * es);
    char *const partial_base = (char *)flags + flag_bytes;
    char *const own_base = partial_base + (size_t)L * partial_bytes;
    memset(flags, 0, flag_bytes);
    int rc = 0, finished = 0;
#pragma omp parallel num_threads(want)
    {
        struct team tm = {work, team_thread(), team_size(), want};
        char *own = own_base + (size_t)tm.t * own_bytes;
        char *res = own, *h = res + up64((size_t)(M * H) * es);
        char *qk = h + up64((size_t)(M * H) * es), *act = qk + up64((size_t)(M * QKV) * es);
        float *xf = (float *)(act + up64((size_t)(M * I) * es));
        uint8_t *head_flags = flags + (size_t)(L * P_COUNT * max_runs);
        memcpy(res, x, (size_t)(M * H) * es);
        lo_add_rms_norm(res, H, NULL, weights[0], h, M, (int)H, m->eps, dt, 1);
        gv_widen(h, H, xf, M, H, dt, q8);
        for (int64_t l = 0; l < L; l++) {
            if (__atomic_load_n(&finished, __ATOMIC_ACQUIRE)
                || __atomic_load_n(&rc, __ATOMIC_RELAXED))
                break;
            const void *const *w = weights + 6 * l;
            const float *const *sc = scales ? scales + 6 * l : no_scales;
            const void *const *bl = blocks ? blocks + 6 * l : no_blocks;
            const int64_t c = l * W_STEPS; /* this layer's counters */
            uint8_t *fl = flags + (size_t)(l * P_COUNT * max_runs);
            char *qkv = shared + (size_t)l * layer_bytes;
            char *y_o = qkv + up64((size_t)(M * QKV) * es);
            char *gu = y_o + up64((size_t)(M * H) * es);
            char *y_d = gu + up64((size_t)(M * 2 * I) * es);
            char *attn = y_d + up64((size_t)(M * H) * es);
            char *k_cache = (char *)cache + (size_t)(l * m->cache_layer_stride) * kv_es;
            char *v_cache = k_cache + (size_t)(m->cache_layer_stride / 2) * kv_es;
            gv_share_redo(&tm, c + W_QKV, fl + P_QKV * max_runs, xf, w[1], sc[1], q41_ref(bl[1]),
                          qkv, QKV, M, QKV, H, dt);
            memcpy(qk, qkv, (size_t)(M * QKV) * es);
            lo_rope(qk, QKV, positions, cos_t, sin_t, m->max_position, M,
                    (int)(m->Hq + m->Hkv), (int)m->D, dt, 1);
            for (int64_t b = 0; b < M; b++) {
                const char *row = qk + (size_t)(b * QKV) * es;
                store_row(k_cache + (size_t)(slots[b] * KVD) * kv_es, row + QD * es, KVD, dt,
                          m->kv_dt);
                store_row(v_cache + (size_t)(slots[b] * KVD) * kv_es, row + (QD + KVD) * es,
                          KVD, dt, m->kv_dt);
            }
            if (pd_decode_team_redo(qk, QKV, k_cache, v_cache, tables, bt_stride, lens, attn,
                                    (int)M, (int)m->Hq, (int)m->Hkv, (int)m->D,
                                    (int)m->block_size, m->scale, dt, m->kv_dt, tm.nt,
                                    &work[(c + W_ATTN) * want].runs, fl + P_ATTN * max_runs,
                                    wait_flag, claimed,
                                    partial_floats
                                        ? (float *)(partial_base + (size_t)l * partial_bytes)
                                        : NULL)) {
                __atomic_store_n(&rc, -3, __ATOMIC_RELAXED);
                break;
            }
            gv_widen(attn, QD, xf, M, QD, dt, q8);
            gv_share_redo(&tm, c + W_O, fl + P_O * max_runs, xf, w[2], sc[2], q41_ref(bl[2]),
                          y_o, H, M, H, QD, dt);
            lo_add_rms_norm(res, H, y_o, w[3], h, M, (int)H, m->eps, dt, 1);
            gv_widen(h, H, xf, M, H, dt, q8);
            gv_share_redo(&tm, c + W_GATE_UP, fl + P_GATE_UP * max_runs, xf, w[4], sc[4],
                          q41_ref(bl[4]), gu, 2 * I, M, 2 * I, H, dt);
            lo_silu_mul(gu, act, M, (int)I, dt, 1);
            gv_widen(act, I, xf, M, I, dt, q8);
            gv_share_redo(&tm, c + W_DOWN, fl + P_DOWN * max_runs, xf, w[5], sc[5], q41_ref(bl[5]),
                          y_d, H, M, H, I, dt);
            lo_add_rms_norm(res, H, y_d, l + 1 < L ? weights[6 * (l + 1)] : final_norm, h, M,
                            (int)H, m->eps, dt, 1);
            if (l + 1 < L) {
                gv_widen(h, H, xf, M, H, dt, q8);
                continue;
            }
            if (head) { /* the logits, shared out as a projection (the last counters' set) */
                gv_widen(h, H, xf, M, H, dt, head_q8);
                gv_share_redo(&tm, L * W_STEPS + W_QKV, head_flags, xf, head->w, head->scales,
                              head_bl, head->logits, head->V, M, head->V, H, dt);
            }
            if (!__atomic_exchange_n(&finished, 1, __ATOMIC_ACQ_REL)) {
                /* the first thread through publishes; x is written after the region */
                memcpy(out, h, (size_t)(M * H) * es);
                memcpy(x_final, res, (size_t)(M * H) * es);
            }
        }
    }
    if (!rc)
        memcpy(x, x_final, (size_t)(M * H) * es);
    free(shared);
    free(work);
    return rc;
}

/* weights: 6 pointers per layer (input_norm, qkv, o, post_norm, gate_up, down); scales:
 * NULL, or 6 per layer likewise where the projections are int8 (a float32 scale per output
 * row; the norms' entries unused), the activations then staying float32 for them; cache:
 * the [L, 2, num_blocks, block_size, Hkv, D] KV cache; x [M, H] the residual stream (the
 * embeddings in, updated in place); out [M, H] the final norm of the last residual;
 * blocks: NULL, or 6 per layer likewise (no scales): each projection's GGUF Q4_1 blocks,
 * which the GEMV then streams instead of its rows (q4_blocks.c; the head's Q8_0 blocks come
 * in struct ds_head);
 * head: NULL, or the LM head, whose logits are then computed too (struct ds_head);
 * packed: NULL, or 6 per layer likewise, the projections packed for the batched kernels
 * (al_pack or bp_pack for bfloat16, fp_pack for float32): then the batched form above runs.
 * Returns 0; -1 no memory; -2 a position outside the RoPE tables; -3 the attention kernel
 * failed; -4 a slot outside the cache (nothing written); -5 packed weights given where this
 * build or machine lacks the batched kernel (nothing written); -6 blocks given for an int8
 * model, or to a build without their vector form for its dtype (nothing written). */
int ds_decode_layers(const struct ds_model *m, const void *const *weights,
                     const float *const *scales, const void *const *blocks,
                     const void *const *packed,
                     const void *final_norm, const struct ds_head *head, void *cache, void *x,
                     void *out, const int64_t *positions, const int64_t *slots,
                     const int32_t *lens, const int32_t *tables, int64_t bt_stride,
                     const void *cos_t, const void *sin_t, int64_t num_slots, int64_t M,
                     int num_threads)
{
    for (int64_t b = 0; b < M; b++)
        if (slots[b] < 0 || slots[b] >= num_slots)
            return -4;
    if ((blocks || (head && head->blocks)) && (scales || !blocks_fast(m->dt)))
        return -6;
    if (packed && !(m->dt == DT_BF16 ? al_available() || bp_available() : fp_available()))
        return -5;
    if (packed)
        return batched_layers(m, weights, packed, final_norm, head, cache, x, out, positions,
                              slots, lens, tables, bt_stride, cos_t, sin_t, M, num_threads);
    return gemv_layers(m, weights, scales, blocks, final_norm, head, cache, x, out, positions,
                       slots, lens, tables, bt_stride, cos_t, sin_t, M, num_threads);
}
