/* The element-wise work of a decoder layer, one pass over memory each: residual add fused
 * with RMSNorm, RoPE in place on the Q/K heads of the fused QKV rows, and SiLU(gate) * up.
 *
 * In eager torch each of these is 4-8 kernels (casts, pow, mean, rsqrt, muls, a cat for
 * rotate-half), each a pass over the rows and a dispatch; at the token counts of a CPU step
 * that was ~10 % of the step. Math is float32 throughout; a bfloat16 result is rounded once
 * at the end (the torch reference rounds after every op, so the two differ by a rounding).
 *
 * dtype codes and bf16 conversions: common.h. Rows are split over threads only when there
 * are enough elements to pay for waking them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "common.h"

#define PARALLEL_MIN_ELEMS 65536
#define CHUNK 512 /* elements widened to float32 at a time */

/* Widen n elements of a row to float32. */
static inline void widen(float *dst, const void *src, int64_t off, int n, int dt)
{
    if (dt == DT_F32) {
        memcpy(dst, (const float *)src + off, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src + off;
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#endif
    for (; i < n; i++)
        dst[i] = bf16_to_f32(s[i]);
}

/* n elements of a row as float32: the row itself when dt is float32 (no copy: memcpy into
 * the buffer was 30 % of a float32 silu_mul's time, perf), else widened into buf. */
static inline const float *as_f32(float *buf, const void *src, int64_t off, int n, int dt)
{
    if (dt == DT_F32)
        return (const float *)src + off;
    widen(buf, src, off, n, dt);
    return buf;
}

/* Narrow n float32 to dt. bfloat16 rounds to nearest even, as f32_to_bf16 and torch do:
 * with AVX512-BF16 one vcvtneps2bf16 per 16 (it also keeps a NaN a NaN), where the scalar
 * form's NaN test kept gcc from vectorising the loop (with the widening above: silu_mul
 * over 2048 x 1536 bfloat16 elements 1.7-1.8 -> 1.2-1.4 ms, add_rms_norm over 2048 x 576
 * 0.45-0.52 -> 0.41-0.42 ms on two threads). */
static inline void narrow(void *dst, int64_t off, const float *src, int n, int dt)
{
    if (dt == DT_F32) {
        memcpy((float *)dst + off, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst + off;
    int i = 0;
#ifdef __AVX512BF16__
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++)
        d[i] = f32_to_bf16(src[i]);
}

/* x [T, H] (row stride x_stride) += delta [T, H] (contiguous; NULL: no add), stored back
 * in dt; out [T, H] (contiguous) = weight * x / sqrt(mean(x^2) + eps). */
static void add_rms_norm_row(void *x, int64_t x_stride, const void *delta,
                             const void *weight, void *out, int64_t t, int H, float eps, int dt)
{
    float a[CHUNK], b[CHUNK];
    const int64_t row = t * x_stride;
    float ss = 0.f;
    for (int i0 = 0; i0 < H; i0 += CHUNK) {
        const int n = H - i0 < CHUNK ? H - i0 : CHUNK;
        if (dt == DT_F32) { /* in place: the sum is the stored value already */
            float *xr = (float *)x + row + i0;
            if (delta) {
                const float *dr = (const float *)delta + t * H + i0;
#pragma omp simd reduction(+ : ss)
                for (int i = 0; i < n; i++) {
                    xr[i] += dr[i];
                    ss += xr[i] * xr[i];
                }
            } else {
#pragma omp simd reduction(+ : ss)
                for (int i = 0; i < n; i++)
                    ss += xr[i] * xr[i];
            }
            continue;
        }
        widen(a, x, row + i0, n, dt);
        if (delta) {
            widen(b, delta, t * H + i0, n, dt);
#pragma omp simd
            for (int i = 0; i < n; i++)
                a[i] += b[i];
            /* the residual stream is kept in dt: the norm sees the stored value */
            narrow(x, row + i0, a, n, dt);
            widen(a, x, row + i0, n, dt);
        }
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++)
            ss += a[i] * a[i];
    }
    const float r = 1.f / sqrtf(ss / (float)H + eps);
    for (int i0 = 0; i0 < H; i0 += CHUNK) {
        const int n = H - i0 < CHUNK ? H - i0 : CHUNK;
        const float *xa = as_f32(a, x, row + i0, n, dt), *w = as_f32(b, weight, i0, n, dt);
        float *o = dt == DT_F32 ? (float *)out + t * H + i0 : a;
#pragma omp simd
        for (int i = 0; i < n; i++)
            o[i] = xa[i] * r * w[i];
        if (dt != DT_F32)
            narrow(out, t * H + i0, a, n, dt);
    }
}

void lo_add_rms_norm(void *x, int64_t x_stride, const void *delta, const void *weight,
                     void *out, int64_t T, int H, float eps, int dt, int num_threads)
{
    if (T * H >= PARALLEL_MIN_ELEMS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < T; t++)
            add_rms_norm_row(x, x_stride, delta, weight, out, t, H, eps, dt);
        return;
    }
    /* no region at all: even a one-thread region allocates its team, and the decode
     * stack's threads call these side by side, meeting at malloc's lock (one arena) */
    for (int64_t t = 0; t < T; t++)
        add_rms_norm_row(x, x_stride, delta, weight, out, t, H, eps, dt);
}

/* Rotate-half RoPE in place on `heads` heads of D (even, <= 2 * CHUNK) at the start of
 * each row of qk (row stride row_stride elements, heads packed), with cos/sin tables
 * [max_pos, D] in dt. Returns the first row whose position is outside 0..max_pos-1
 * (nothing written), or -1. */
static void rope_row(void *qk, int64_t row_stride, const int64_t *positions,
                     const void *cos_t, const void *sin_t, int64_t t, int heads, int D, int dt)
{
    const int half = D / 2;
    float c[2 * CHUNK], s[2 * CHUNK], x[2 * CHUNK], y[2 * CHUNK];
    const int64_t p = positions[t] * D;
    widen(c, cos_t, p, D, dt);
    widen(s, sin_t, p, D, dt);
    for (int h = 0; h < heads; h++) {
        const int64_t off = t * row_stride + (int64_t)h * D;
        widen(x, qk, off, D, dt);
#pragma omp simd
        for (int i = 0; i < half; i++) {
            y[i] = x[i] * c[i] - x[i + half] * s[i];
            y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        narrow(qk, off, y, D, dt);
    }
}

int64_t lo_rope(void *qk, int64_t row_stride, const int64_t *positions, const void *cos_t,
                const void *sin_t, int64_t max_pos, int64_t T, int heads, int D, int dt,
                int num_threads)
{
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos)
            return t;
    if (T * heads * D >= PARALLEL_MIN_ELEMS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < T; t++)
            rope_row(qk, row_stride, positions, cos_t, sin_t, t, heads, D, dt);
    } else {
        for (int64_t t = 0; t < T; t++) /* no region: see lo_add_rms_norm */
            rope_row(qk, row_stride, positions, cos_t, sin_t, t, heads, D, dt);
    }
    return -1;
}

/* out [T, I] (contiguous) = silu(gate_up[:, :I]) * gate_up[:, I:] (gate_up [T, 2I],
 * contiguous). */
static void silu_mul_row(const void *gate_up, void *out, int64_t t, int I, int dt)
{
    float gb[CHUNK], ub[CHUNK];
    const int64_t row = t * 2 * (int64_t)I;
    for (int i0 = 0; i0 < I; i0 += CHUNK) {
        const int n = I - i0 < CHUNK ? I - i0 : CHUNK;
        const float *g = as_f32(gb, gate_up, row + i0, n, dt);
        const float *u = as_f32(ub, gate_up, row + I + i0, n, dt);
        float *o = dt == DT_F32 ? (float *)out + t * I + i0 : gb;
#pragma omp simd
        for (int i = 0; i < n; i++)
            o[i] = silu(g[i]) * u[i];
        if (dt != DT_F32)
            narrow(out, t * I + i0, gb, n, dt);
    }
}

void lo_silu_mul(const void *gate_up, void *out, int64_t T, int I, int dt, int num_threads)
{
    if (T * I >= PARALLEL_MIN_ELEMS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < T; t++)
            silu_mul_row(gate_up, out, t, I, dt);
        return;
    }
    for (int64_t t = 0; t < T; t++) /* no region: see lo_add_rms_norm */
        silu_mul_row(gate_up, out, t, I, dt);
}
