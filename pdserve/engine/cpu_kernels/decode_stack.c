/* A whole decode step's decoder layers in one call, for the few sequences of a CPU decode
 * step: per layer QKV projection, RoPE, the K/V store, paged attention, O projection,
 * residual add + RMSNorm, gate/up projection, SiLU * up, down projection, residual add +
 * the next norm — the same kernels the model's Python loop calls one by one (gemv.c,
 * layer_ops.c, paged_decode.c), in the same order, so the result is the same bit for bit.
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

#ifdef _OPENMP
#include <omp.h>
#endif

/* the kernels this file strings together (same library) */
void gv_widen(const void *x, int64_t x_stride, float *xf, int64_t M, int64_t K, int dt);
void gv_part(const float *xf, const void *w, void *y, int64_t y_stride, int64_t M, int64_t N,
             int64_t K, int dt, int t, int nt);
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

/* weights: 6 pointers per layer (input_norm, qkv, o, post_norm, gate_up, down); cache:
 * the [L, 2, num_blocks, block_size, Hkv, D] KV cache; x [M, H] the residual stream (the
 * embeddings in, updated in place); out [M, H] the final norm of the last residual.
 * Returns 0; -1 no memory; -2 a position outside the RoPE tables; -3 the attention kernel
 * failed; -4 a slot outside the cache (nothing written). */
int ds_decode_layers(const struct ds_model *m, const void *const *weights,
                     const void *final_norm, void *cache, void *x, void *out,
                     const int64_t *positions, const int64_t *slots, const int32_t *lens,
                     const int32_t *tables, int64_t bt_stride, const void *cos_t,
                     const void *sin_t, int64_t num_slots, int64_t M, int num_threads)
{
    for (int64_t b = 0; b < M; b++)
        if (slots[b] < 0 || slots[b] >= num_slots)
            return -4;
    const int dt = m->dt;
    const size_t es = dt == DT_F32 ? 4 : 2, kv_es = m->kv_dt == DT_F32 ? 4 : 2;
    const int64_t H = m->H, QD = m->Hq * m->D, KVD = m->Hkv * m->D, I = m->I;
    const int64_t QKV = QD + 2 * KVD;
    const int64_t widest = H > QD ? (H > I ? H : I) : (QD > I ? QD : I);
    char *scratch = malloc((size_t)M * (size_t)(H + QKV + QD + 2 * I + I + H) * es);
    float *xf = malloc((size_t)(M * widest) * sizeof(float));
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
#pragma omp parallel num_threads(num_threads > 1 ? num_threads : 1)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        for (int64_t l = 0; l < m->L && !rc; l++) {
            const void *const *w = weights + 6 * l;
            char *k_cache = (char *)cache + (size_t)(l * m->cache_layer_stride) * kv_es;
            char *v_cache = k_cache + (size_t)(m->cache_layer_stride / 2) * kv_es;
#pragma omp single
            gv_widen(h, H, xf, M, H, dt);
            gv_part(xf, w[1], qkv, QKV, M, QKV, H, dt, t, nt);
#pragma omp barrier
#pragma omp single
            {
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
                gv_widen(attn, QD, xf, M, QD, dt);
            }
            if (rc) /* every thread reads rc after the single's barrier: all leave together */
                break;
            gv_part(xf, w[2], y, H, M, H, QD, dt, t, nt);
#pragma omp barrier
#pragma omp single
            {
                lo_add_rms_norm(x, H, y, w[3], h, M, (int)H, m->eps, dt, 1);
                gv_widen(h, H, xf, M, H, dt);
            }
            gv_part(xf, w[4], gu, 2 * I, M, 2 * I, H, dt, t, nt);
#pragma omp barrier
#pragma omp single
            {
                lo_silu_mul(gu, act, M, (int)I, dt, 1);
                gv_widen(act, I, xf, M, I, dt);
            }
            gv_part(xf, w[5], y, H, M, H, I, dt, t, nt);
#pragma omp barrier
#pragma omp single
            lo_add_rms_norm(x, H, y, l + 1 < m->L ? weights[6 * (l + 1)] : final_norm, h, M,
                            (int)H, m->eps, dt, 1);
        }
    }
    if (!rc)
        memcpy(out, h, (size_t)(M * H) * es);
    free(scratch);
    free(xf);
    return rc;
}
