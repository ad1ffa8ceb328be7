/* Tried in session 33, not kept: float32 x @ W^T over the GGUF's Q4_1 codes repacked into
 * k-major panels (per 32 columns and 32 k: the 32 scales d and offsets m as float32, then
 * per k the 32 four-bit codes), each weight rebuilt as d * q + m (exact, as the loader
 * rounds it) and fed to the float32 panels' 6-row x 16-column FMA block. The idea: stream
 * 0.75 bytes a weight instead of the panels' 4 at 9-16 rows, and rebuild each weight once
 * per row block instead of the blocks' GEMV's once per row pass at 5-8 rows. Against both
 * (a whole SmolLM2-135M's projections, 30 layers, no head; two threads) it lost nearly
 * everywhere, in two runs: 1-8 rows 1.04-1.53x the blocks' time (0.95 once, at 3 rows),
 * 9-16 rows 1.16-1.74x the float32 panels', whose 425 MB a step stream at ~35 GB/s at 10-12
 * rows (12-13 ms); 4 or 5 rows a block, or d * q + m as one FMA: no better. Output (the
 * second run, beside a pip install): q4_panels.txt. It prints nothing else when its results
 * equal the float32 panels' bit for bit (they did).
 *
 *   K=pdserve/engine/cpu_kernels; F="-O3 -march=native -mprefer-vector-width=512 \
 *       -ffast-math -fopenmp -std=c11 -I$K"
 *   gcc $F -c $K/f32_panels.c -o /tmp/f32.o && gcc $F -c $K/q4_blocks.c -o /tmp/q4b.o
 *   gcc $F [-DQROWS=4] [-DUSE_FMA_DM] docs/bench/cpu-s33/q4_panels.c /tmp/f32.o /tmp/q4b.o \
 *       -lm -o /tmp/q4p && /tmp/q4p 5
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
void fp_pack(const float *w, int64_t N, int64_t K, float *packed);
int fp_linear(const float *x, int64_t x_stride, int64_t M, const float *packed, int64_t N, int64_t K, float *y, int num_threads);
void blocks_linear(const void *, const uint8_t *, int, void *, int64_t, int64_t, int64_t, int, int);

/* tile (panel p, k-block kb): float d[32], m[32], then 32 k x 16 bytes of codes:
 * bytes 8h+j (j<8) of a k: low nibble col 16h+j, high nibble col 16h+j+8 */
#define TILE_BYTES (256 + 512)
#ifndef QROWS
#define QROWS 6
#endif
static inline __attribute__((always_inline)) void q4_half_rows(const float *x, int64_t xs, const uint8_t *panel, int64_t K, float *y, int64_t ys, const int R, int h)
{
    __m256 lo[QROWS], hi[QROWS];
    for (int r = 0; r < R; r++) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); }
    const __m256i mask = _mm256_set1_epi32(15);
    for (int64_t kb = 0; kb < K / 32; kb++) {
        const uint8_t *t = panel + kb * TILE_BYTES;
        const float *d = (const float *)t + 16 * h, *m = (const float *)t + 32 + 16 * h;
        const uint8_t *c = t + 256 + 8 * h;
        const float *xk = x + kb * 32;
        for (int k = 0; k < 32; k++) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 16 * k)));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#ifdef USE_FMA_DM
            w0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(d), _mm256_loadu_ps(m));
            w1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(d + 8), _mm256_loadu_ps(m + 8));
#else
            w0 = _mm256_add_ps(_mm256_mul_ps(w0, _mm256_loadu_ps(d)), _mm256_loadu_ps(m));
            w1 = _mm256_add_ps(_mm256_mul_ps(w1, _mm256_loadu_ps(d + 8)), _mm256_loadu_ps(m + 8));
#endif
            for (int r = 0; r < R; r++) {
                const __m256 a = _mm256_broadcast_ss(xk + r * xs + k);
                lo[r] = _mm256_fmadd_ps(a, w0, lo[r]);
                hi[r] = _mm256_fmadd_ps(a, w1, hi[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) { _mm256_storeu_ps(y + r * ys, lo[r]); _mm256_storeu_ps(y + r * ys + 8, hi[r]); }
}
static void q4_half_panel(const float *x, int64_t xs, int64_t M, const uint8_t *panel, int64_t K, float *y, int64_t ys, int h)
{
    const int64_t blocks = (M + QROWS - 1) / QROWS;
    for (int64_t b = 0, m = 0; b < blocks; b++) {
        const int64_t R = (M - m) / (blocks - b) + ((M - m) % (blocks - b) != 0);
        const float *xr = x + m * xs; float *yr = y + m * ys;
        switch (R) {
        case 1: q4_half_rows(xr, xs, panel, K, yr, ys, 1, h); break;
        case 2: q4_half_rows(xr, xs, panel, K, yr, ys, 2, h); break;
        case 3: q4_half_rows(xr, xs, panel, K, yr, ys, 3, h); break;
        case 4: q4_half_rows(xr, xs, panel, K, yr, ys, 4, h); break;
#if QROWS > 4
        case 5: q4_half_rows(xr, xs, panel, K, yr, ys, 5, h); break;
#endif
        default: q4_half_rows(xr, xs, panel, K, yr, ys, QROWS, h); break;
        }
        m += R;
    }
}
void q4_linear(const float *x, int64_t M, const uint8_t *packed, int64_t N, int64_t K, float *y)
{
    const int64_t panels = N / 32, pb = K / 32 * TILE_BYTES;
#pragma omp parallel num_threads(2)
    {
        const int t = omp_get_thread_num();
        const int64_t p0 = panels * t / 2, p1 = panels * (t + 1) / 2;
        for (int64_t p = p0; p < p1; p++)
            for (int h = 0; h < 2; h++)
                q4_half_panel(x, K, M, packed + p * pb, K, y + p * 32 + 16 * h, N, h);
    }
}
/* Q4_1 rows [N][K/32][20] -> tiles; also dequant for the reference */
static float h2f(uint16_t h) { return _cvtsh_ss(h); }
void q4_pack(const uint8_t *rows, int64_t N, int64_t K, uint8_t *out)
{
    const int64_t nb = K / 32;
    for (int64_t p = 0; p < N / 32; p++)
        for (int64_t kb = 0; kb < nb; kb++) {
            uint8_t *t = out + (p * nb + kb) * TILE_BYTES;
            float *d = (float *)t, *m = d + 32;
            uint8_t *c = t + 256;
            memset(c, 0, 512);
            for (int j = 0; j < 32; j++) {
                const uint8_t *blk = rows + ((p * 32 + j) * nb + kb) * 20;
                uint16_t dh, mh; memcpy(&dh, blk, 2); memcpy(&mh, blk + 2, 2);
                d[j] = h2f(dh); m[j] = h2f(mh);
                const int h = j / 16, jj = j % 16, byte = 8 * h + (jj % 8), shift = jj < 8 ? 0 : 4;
                for (int k = 0; k < 32; k++) {
                    const int q = k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4;
                    c[16 * k + byte] |= (uint8_t)(q << shift);
                }
            }
        }
}
void q4_dequant(const uint8_t *rows, int64_t N, int64_t K, float *w)
{
    const int64_t nb = K / 32;
    for (int64_t n = 0; n < N; n++) for (int64_t kb = 0; kb < nb; kb++) {
        const uint8_t *blk = rows + (n * nb + kb) * 20;
        uint16_t dh, mh; memcpy(&dh, blk, 2); memcpy(&mh, blk + 2, 2);
        const float d = h2f(dh), m = h2f(mh);
        for (int k = 0; k < 32; k++) {
            const int q = k < 16 ? blk[4 + k] & 15 : blk[4 + k - 16] >> 4;
            w[n * K + kb * 32 + k] = __builtin_fmaf(d, (float)q, m);
        }
    }
}
int main(int argc, char **argv)
{
    const int rounds = argc > 1 ? atoi(argv[1]) : 5;
    static const int64_t shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
    enum { NW = 120 };
    uint8_t *q[NW], *qp[NW]; float *fp[NW]; int64_t K[NW], N[NW];
    srand(1);
    for (int i = 0; i < NW; i++) {
        K[i] = shapes[i % 4][0]; N[i] = shapes[i % 4][1];
        const int64_t nb = K[i] / 32, bytes = N[i] * nb * 20;
        q[i] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        for (int64_t j = 0; j < bytes; j++) q[i][j] = rand();
        for (int64_t b = 0; b < N[i] * nb; b++) { /* scales: small normals */
            uint16_t dh = 0x2000 | (rand() & 0x3ff), mh = 0xa400 | (rand() & 0x3ff);
            memcpy(q[i] + b * 20, &dh, 2); memcpy(q[i] + b * 20 + 2, &mh, 2);
        }
        qp[i] = aligned_alloc(64, N[i] / 32 * nb * TILE_BYTES);
        q4_pack(q[i], N[i], K[i], qp[i]);
        float *w = malloc(N[i] * K[i] * 4); q4_dequant(q[i], N[i], K[i], w);
        fp[i] = aligned_alloc(64, N[i] * K[i] * 4); fp_pack(w, N[i], K[i], fp[i]); free(w);
    }
    float *x = aligned_alloc(64, 16 * 1536 * 4), *y = aligned_alloc(64, 16 * 3072 * 4), *y2 = aligned_alloc(64, 16 * 3072 * 4);
    for (int i = 0; i < 16 * 1536; i++) x[i] = (float)((i * 37) % 101 - 50) * 0.01f;
    /* exactness vs fp panels */
    for (int i = 0; i < 4; i++) for (int M = 1; M <= 16; M++) {
        fp_linear(x, K[i], M, fp[i], N[i], K[i], y, 2);
        q4_linear(x, M, qp[i], N[i], K[i], y2);
        if (memcmp(y, y2, M * N[i] * 4)) { printf("MISMATCH shape %d M %d\n", i, M); break; }
    }
    for (int M = 1; M <= 16; M++) {
        double s[3] = {0, 0, 0};
        for (int r = 0; r <= rounds; r++) for (int v = 0; v < 3; v++) {
            if (v == 2 && M > 8) continue;
            double t0 = omp_get_wtime();
            for (int i = 0; i < NW; i++) {
                if (v == 0) fp_linear(x, K[i], M, fp[i], N[i], K[i], y, 2);
                else if (v == 1) q4_linear(x, M, qp[i], N[i], K[i], y);
                else blocks_linear(x, q[i], 1, y, M, N[i], K[i], 0, 2);
            }
            if (r) s[v] += omp_get_wtime() - t0;
        }
        printf("rows %2d: fp32 panels %6.2f  q4 panels %6.2f  blocks %6.2f ms  q4/fp %.2f  q4/blocks %.2f\n", M,
               s[0] / rounds * 1e3, s[1] / rounds * 1e3, s[2] / rounds * 1e3, s[1] / s[0], s[2] > 0 ? s[1] / s[2] : 0);
    }
}
