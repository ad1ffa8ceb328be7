/* The float32 panels (fp_linear) of two builds in one process, alternated call by call:
 * a whole SmolLM2-135M's projections per "step" (30 layers of QKV 576->960, O 576->576,
 * gate+up 576->3072, down 1536->576, and the 576->49152 LM head: 538 MB, more than any
 * cache), two threads, 8 rounds each; prints the min and mean ms per step and new / old.
 * The weights' values do not matter to the time, so they are not packed.
 *
 * From the repository root (BASE: the commit to compare against):
 *
 *   d=/tmp/panels_ab; mkdir -p $d; K=pdserve/engine/cpu_kernels
 *   git show BASE:$K/f32_panels.c > $d/old.c; F="-O3 -march=native -ffast-math -fopenmp -std=c11 -I$K"
 *   gcc $F -Dfp_blocks=fp_blocks_old -Dfp_linear=fp_linear_old -Dfp_pack=fp_pack_old \
 *       -Dfp_available=fp_available_old -c $d/old.c -o $d/old.o
 *   gcc $F -c $K/f32_panels.c -o $d/new.o
 *   gcc $F docs/bench/cpu-s30/panels_ab.c $d/old.o $d/new.o -o $d/ab && $d/ab
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int fp_linear_old(const float *, int64_t, int64_t, const float *, int64_t, int64_t, float *, int);
int fp_linear(const float *, int64_t, int64_t, const float *, int64_t, int64_t, float *, int);

#define ROUNDS 8

int main(void)
{
    static const int64_t shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
    static const int rows[] = {6, 9, 16, 32, 64};
    enum { N_W = 30 * 4 + 1 };
    float *w[N_W];
    int64_t K[N_W], N[N_W];
    for (int i = 0; i < N_W; i++) {
        K[i] = i < N_W - 1 ? shapes[i % 4][0] : 576;
        N[i] = i < N_W - 1 ? shapes[i % 4][1] : 49152;
        w[i] = aligned_alloc(64, (size_t)(K[i] * N[i]) * sizeof(float));
        for (int64_t j = 0; j < K[i] * N[i]; j++)
            w[i][j] = (float)((j * 7) % 13) * 0.01f;
    }
    float *x = aligned_alloc(64, 64 * 1536 * sizeof(float));
    float *y = aligned_alloc(64, 64 * 49152 * sizeof(float));
    for (int j = 0; j < 64 * 1536; j++)
        x[j] = 0.001f * (float)(j % 100);
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        const int M = rows[r];
        double best[2] = {1e9, 1e9}, sum[2] = {0, 0};
        for (int round = 0; round < ROUNDS; round++)
            for (int v = 0; v < 2; v++) {
                const double t0 = omp_get_wtime();
                for (int i = 0; i < N_W; i++)
                    (v ? fp_linear : fp_linear_old)(x, K[i], M, w[i], N[i], K[i], y, 2);
                const double dt = omp_get_wtime() - t0;
                best[v] = dt < best[v] ? dt : best[v];
                sum[v] += dt;
            }
        printf("M=%2d  old min %6.1f mean %6.1f ms | new min %6.1f mean %6.1f ms | new/old mean "
               "%.3f\n", M, best[0] * 1e3, sum[0] / ROUNDS * 1e3, best[1] * 1e3,
               sum[1] / ROUNDS * 1e3, sum[1] / sum[0]);
    }
    return 0;
}
