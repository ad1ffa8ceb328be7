/* The GGUF blocks' projections (blocks_linear) of two builds in one process, alternated call
 * by call: a whole SmolLM2-135M's projections per "step" in Q4_1 blocks (30 layers of QKV
 * 576->960, O 576->576, gate+up 576->3072, down 1536->576) and its LM head in Q8_0 blocks
 * (576->49152), at 1-8 rows of x, two threads, ROUNDS rounds; prints the mean ms per step of
 * each build and b / a. The blocks' values do not matter to the time: a fixed byte pattern
 * whose float16 scales are small normal numbers.
 *
 * From the repository root (A.c and B.c: two versions of q4_blocks.c):
 *
 *   d=/tmp/blocks_ab; mkdir -p $d; K=pdserve/engine/cpu_kernels
 *   F="-O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp -std=c11 -I$K"
 *   R="-Dblocks_rows=blocks_rows_X -Dblocks_fast=blocks_fast_X -Dblocks_dequant=blocks_dequant_X -Dblocks_row_bytes=blocks_row_bytes_X"
 *   gcc $F ${R//X/a} -Dblocks_linear=blocks_linear_a -c A.c -o $d/a.o
 *   gcc $F ${R//X/b} -Dblocks_linear=blocks_linear_b -c B.c -o $d/b.o
 *   gcc $F docs/bench/cpu-s31/blocks_ab.c $d/a.o $d/b.o -lm -o $d/ab && $d/ab [ROUNDS]
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void blocks_linear_a(const void *, const uint8_t *, int, void *, int64_t, int64_t, int64_t, int, int);
void blocks_linear_b(const void *, const uint8_t *, int, void *, int64_t, int64_t, int64_t, int, int);
typedef void (*lin)(const void *, const uint8_t *, int, void *, int64_t, int64_t, int64_t, int, int);

enum { Q41 = 1, Q80 = 2 }; /* common.h: BLOCKS_Q4_1, BLOCKS_Q8_0 */

int main(int argc, char **argv)
{
    const int rounds = argc > 1 ? atoi(argv[1]) : 8;
    static const int64_t shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
    enum { N_W = 30 * 4 + 1 };
    uint8_t *w[N_W];
    int64_t K[N_W], N[N_W];
    int fmt[N_W];
    for (int i = 0; i < N_W; i++) {
        K[i] = i < N_W - 1 ? shapes[i % 4][0] : 576;
        N[i] = i < N_W - 1 ? shapes[i % 4][1] : 49152;
        fmt[i] = i < N_W - 1 ? Q41 : Q80;
        const int64_t bytes = N[i] * (K[i] / 32) * (fmt[i] == Q80 ? 34 : 20);
        w[i] = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
        for (int64_t j = 0; j < bytes; j++)
            w[i][j] = (uint8_t)((j * 7) % 13 + 16); /* scales 0x1010-ish: small normals */
    }
    float *x = aligned_alloc(64, 8 * 1536 * sizeof(float)), *y = aligned_alloc(64, 8 * 49152 * sizeof(float));
    for (int i = 0; i < 8 * 1536; i++)
        x[i] = (float)(i % 17) * 0.01f;
    lin f[2] = {blocks_linear_a, blocks_linear_b};
    for (int M = 1; M <= 8; M++) {
        double sum[2] = {0, 0};
        for (int r = 0; r < rounds + 1; r++)
            for (int v = 0; v < 2; v++) {
                const double t0 = omp_get_wtime();
                for (int i = 0; i < N_W; i++)
                    f[v](x, w[i], fmt[i], y, M, N[i], K[i], 0, 2);
                if (r)
                    sum[v] += omp_get_wtime() - t0;
            }
        printf("rows %d: a %.2f ms  b %.2f ms  b/a %.3f\n", M, sum[0] / rounds * 1e3,
               sum[1] / rounds * 1e3, sum[1] / sum[0]);
        fflush(stdout);
    }
    return 0;
}
