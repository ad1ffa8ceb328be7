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
void gv_part(const float *xf, const void *w, const float *scales, void *y, int64_t y_stride,
             int64_t M, int64_t N, int64_t K, int dt, int t, int nt);
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
void al_part(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *packed,
             int64_t N, int64_t K, uint16_t *y, int64_t y_stride, int t, int nt);
int al_available(void);

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

/* The batched form (bfloat16, packed non-NULL): every projection on AMX tiles over the
 * packed weights (amx_linear.c's al_part, split by output columns), and every other step
 * split too: rows for the element-wise steps, work items for attention. The layer loop
 * runs the same kernels for these batches (pdserve::amx_linear, the layer ops, the paged
 * decode kernel), each row computed the same way whichever thread takes it, so the result
 * is the loop's bit for bit. Buffers that feed a projection get rows up to the next
 * multiple of 16, zeroed, for the tiles to read. */
static int batched_layers(const struct ds_model *m, const void *const *weights,
                          const void *const *packed, const void *final_norm, void *cache,
                          void *x, void *out, const int64_t *positions, const int64_t *slots,
                          const int32_t *lens, const int32_t *tables, int64_t bt_stride,
                          const void *cos_t, const void *sin_t, int64_t M, int num_threads)
{
    const int dt = m->dt;
    const size_t es = 2, kv_es = m->kv_dt == DT_F32 ? 4 : 2;
    const int64_t H = m->H, QD = m->Hq * m->D, KVD = m->Hkv * m->D, I = m->I;
    const int64_t QKV = QD + 2 * KVD, M16 = (M + 15) / 16 * 16;
    for (int64_t b = 0; b < M; b++) /* before any write: rows are split over threads below */
        if (positions[b] < 0 || positions[b] >= m->max_position)
            return -2;
    uint16_t *scratch = malloc((size_t)(M16 * (H + QD + I) + M * (QKV + 2 * I + H)) * es);
    int *next = calloc((size_t)m->L, sizeof(int)); /* attention's work counter per layer */
    if (!scratch || !next) {
        free(scratch);
        free(next);
        return -1;
    }
    uint16_t *h = scratch, *attn = h + M16 * H, *act = attn + M16 * QD;
    uint16_t *qkv = act + M16 * I, *gu = qkv + M * QKV, *y = gu + M * 2 * I;
    memset(h + M * H, 0, (size_t)((M16 - M) * H) * es);
    memset(attn + M * QD, 0, (size_t)((M16 - M) * QD) * es);
    memset(act + M * I, 0, (size_t)((M16 - M) * I) * es);
    int rc = 0;
    const int want = num_threads > 1 ? num_threads : 1;
    struct spin_barrier bar = {0, 0, want};
#pragma omp parallel num_threads(want)
    {
        int t, nt;
        join_team(&bar, &t, &nt);
        /* this thread's rows of the element-wise steps */
        const int64_t r0 = M * t / nt, r1 = M * (t + 1) / nt, rows = r1 - r0;
        uint16_t *xr = (uint16_t *)x + r0 * H, *hr = h + r0 * H, *yr = y + r0 * H;
        if (rows)
            lo_add_rms_norm(xr, H, NULL, weights[0], hr, rows, (int)H, m->eps, dt, 1);
        barrier_wait(&bar);
        for (int64_t l = 0; l < m->L; l++) {
            const void *const *w = weights + 6 * l;
            const uint16_t *const *p = (const uint16_t *const *)packed + 6 * l;
            char *k_cache = (char *)cache + (size_t)(l * m->cache_layer_stride) * kv_es;
            char *v_cache = k_cache + (size_t)(m->cache_layer_stride / 2) * kv_es;
            al_part(h, H, M, p[1], QKV, H, qkv, QKV, t, nt);
            barrier_wait(&bar);
            if (rows) /* positions were checked above: RoPE cannot refuse a row */
                lo_rope(qkv + r0 * QKV, QKV, positions + r0, cos_t, sin_t, m->max_position,
                        rows, (int)(m->Hq + m->Hkv), (int)m->D, dt, 1);
            for (int64_t b = r0; b < r1; b++) {
                const uint16_t *row = qkv + b * QKV;
                store_row(k_cache + (size_t)(slots[b] * KVD) * kv_es, row + QD, KVD, dt,
                          m->kv_dt);
                store_row(v_cache + (size_t)(slots[b] * KVD) * kv_es, row + QD + KVD, KVD, dt,
                          m->kv_dt);
            }
            barrier_wait(&bar);
            if (pd_decode_team(qkv, QKV, k_cache, v_cache, tables, bt_stride, lens, attn,
                               (int)M, (int)m->Hq, (int)m->Hkv, (int)m->D, (int)m->block_size,
                               m->scale, dt, m->kv_dt, nt, &next[l]))
                __atomic_store_n(&rc, -3, __ATOMIC_RELAXED);
            barrier_wait(&bar);
            if (__atomic_load_n(&rc, __ATOMIC_RELAXED)) /* every thread leaves here */
                break;
            al_part(attn, QD, M, p[2], H, QD, y, H, t, nt);
            barrier_wait(&bar);
            if (rows)
                lo_add_rms_norm(xr, H, yr, w[3], hr, rows, (int)H, m->eps, dt, 1);
            barrier_wait(&bar);
            al_part(h, H, M, p[4], 2 * I, H, gu, 2 * I, t, nt);
            barrier_wait(&bar);
            if (rows)
                lo_silu_mul(gu + r0 * 2 * I, act + r0 * I, rows, (int)I, dt, 1);
            barrier_wait(&bar);
            al_part(act, I, M, p[5], H, I, y, H, t, nt);
            barrier_wait(&bar);
            if (rows)
                lo_add_rms_norm(xr, H, yr, l + 1 < m->L ? weights[6 * (l + 1)] : final_norm,
                                hr, rows, (int)H, m->eps, dt, 1);
            barrier_wait(&bar);
        }
    }
    if (!rc)
        memcpy(out, h, (size_t)(M * H) * es);
    free(scratch);
    free(next);
    return rc;
}

/* weights: 6 pointers per layer (input_norm, qkv, o, post_norm, gate_up, down); scales:
 * NULL, or 6 per layer likewise where the projections are int8 (a float32 scale per output
 * row; the norms' entries unused), the activations then staying float32 for them; cache:
 * the [L, 2, num_blocks, block_size, Hkv, D] KV cache; x [M, H] the residual stream (the
 * embeddings in, updated in place); out [M, H] the final norm of the last residual;
 * packed: NULL, or 6 per layer likewise, the projections packed for AMX tiles (al_pack),
 * for a bfloat16 batch: then the batched form above runs.
 * Returns 0; -1 no memory; -2 a position outside the RoPE tables; -3 the attention kernel
 * failed; -4 a slot outside the cache (nothing written); -5 packed weights given where this
 * build or machine has no AMX tiles (nothing written). */
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
    if (packed && !al_available())
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
    if (!scratch || !xf) {
        free(scratch);
        free(xf);
        return -1;
    }
    void *h = scratch, *qkv = scratch + M * H * es, *attn = (char *)qkv + M * QKV * es;
    void *gu = (char *)attn + M * QD * es, *act = (char *)gu + M * 2 * I * es;
    void *y = (char *)act + M * I * es;
    int rc = 0;
    lo_add_rms_norm(x, H, NULL, weights[0], h, M, (int)H, m->eps, dt, 1);
    const int want = num_threads > 1 ? num_threads : 1;
    struct spin_barrier bar = {0, 0, want};
#pragma omp parallel num_threads(want)
    {
        int t, nt;
        join_team(&bar, &t, &nt);
        /* thread 0 runs the one-thread steps; the barrier after each publishes them */
        for (int64_t l = 0; l < m->L; l++) {
            const void *const *w = weights + 6 * l;
            const float *const *sc = scales ? scales + 6 * l : no_scales;
            char *k_cache = (char *)cache + (size_t)(l * m->cache_layer_stride) * kv_es;
            char *v_cache = k_cache + (size_t)(m->cache_layer_stride / 2) * kv_es;
            if (t == 0)
                gv_widen(h, H, xf, M, H, dt, q8);
            barrier_wait(&bar);
            gv_part(xf, w[1], sc[1], qkv, QKV, M, QKV, H, dt, t, nt);
            barrier_wait(&bar);
            if (t == 0) {
                if (lo_rope(qkv, QKV, positions, cos_t, sin_t, m->max_position, M,
                            (int)(m->Hq + m->Hkv), (int)m->D, dt, 1) >= 0)
                    rc = -2;
                for (int64_t b = 0; b < M && !rc; b++) {
                    const char *row = (const char *)qkv + (size_t)(b * QKV) * es;
                    store_row(k_cache + (size_t)(slots[b] * KVD) * kv_es, row + QD * es, KVD,
                              dt, m->kv_dt);
                    store_row(v_cache + (size_t)(slots[b] * KVD) * kv_es,
                              row + (QD + KVD) * es, KVD, dt, m->kv_dt);
                }
                if (!rc && pd_decode(qkv, QKV, k_cache, v_cache, tables, bt_stride, lens, attn,
                                     (int)M, (int)m->Hq, (int)m->Hkv, (int)m->D,
                                     (int)m->block_size, m->scale, dt, m->kv_dt, 1))
                    rc = -3;
                gv_widen(attn, QD, xf, M, QD, dt, q8);
            }
            barrier_wait(&bar);
            if (rc) /* set before the barrier by thread 0: every thread leaves here */
                break;
            gv_part(xf, w[2], sc[2], y, H, M, H, QD, dt, t, nt);
            barrier_wait(&bar);
            if (t == 0) {
                lo_add_rms_norm(x, H, y, w[3], h, M, (int)H, m->eps, dt, 1);
                gv_widen(h, H, xf, M, H, dt, q8);
            }
            barrier_wait(&bar);
            gv_part(xf, w[4], sc[4], gu, 2 * I, M, 2 * I, H, dt, t, nt);
            barrier_wait(&bar);
            if (t == 0) {
                lo_silu_mul(gu, act, M, (int)I, dt, 1);
                gv_widen(act, I, xf, M, I, dt, q8);
            }
            barrier_wait(&bar);
            gv_part(xf, w[5], sc[5], y, H, M, H, I, dt, t, nt);
            barrier_wait(&bar);
            if (t == 0)
                lo_add_rms_norm(x, H, y, l + 1 < m->L ? weights[6 * (l + 1)] : final_norm, h,
                                M, (int)H, m->eps, dt, 1);
            /* the next layer's first step is thread 0's too: no barrier needed here */
        }
    }
    if (!rc)
        memcpy(out, h, (size_t)(M * H) * es);
    free(scratch);
    free(xf);
    return rc;
}
