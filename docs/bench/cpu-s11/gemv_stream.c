/* A batch-1 pass over SmolLM2-135M's projection and LM-head weights (30 layers of QKV
 * 960x576, O 576x576, gate+up 3072x576, down 576x1536, and the 49152x576 head), each in its
 * own memory so nothing is served from cache: int8 (gv_linear with scales), bfloat16 and
 * float32 weights, ms per pass, three passes each, one x row. Built against a given gemv.c,
 * so two versions can be alternated:
 *   gcc -O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp -std=c11 \
 *       -I pdserve/engine/cpu_kernels -DGEMV_C='"gemv.c"' docs/bench/cpu-s11/gemv_stream.c \
 *       -o /tmp/gemv_stream -lm && /tmp/gemv_stream 2
 * (argument: threads). For the version before, put `git show REV:pdserve/engine/cpu_kernels/
 * gemv.c` in a file and pass its path as GEMV_C. */
#include GEMV_C
#include <stdio.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const int64_t shapes[5][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {49152, 576}};
    enum { L = 30, NMAT = 4 * L + 1 };
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    void *w8[NMAT], *w16[NMAT], *w32[NMAT];
    float *sc[NMAT];
    int64_t N[NMAT], K[NMAT];
    for (int i = 0; i < NMAT; i++) {
        const int s = i == NMAT - 1 ? 4 : i % 4;
        N[i] = shapes[s][0], K[i] = shapes[s][1];
        const int64_t n = N[i] * K[i], g = N[i] * ((K[i] + 63) / 64);
        w8[i] = aligned_alloc(64, n), w16[i] = aligned_alloc(64, 2 * n);
        w32[i] = aligned_alloc(64, 4 * n), sc[i] = aligned_alloc(64, 4 * g);
        memset(w8[i], 3, n), memset(w16[i], 0, 2 * n), memset(w32[i], 0, 4 * n);
        for (int64_t j = 0; j < g; j++)
            sc[i][j] = 0.01f;
    }
    static float x[1536], y[49152];
    static uint16_t xb[1536], yb[49152];
    for (int i = 0; i < 1536; i++)
        x[i] = 1.f, xb[i] = 0x3f80;
    const char *names[3] = {"int8", "bfloat16", "float32"};
    for (int mode = 0; mode < 3; mode++)
        for (int rep = 0; rep < 3; rep++) {
            double t = now(), bytes = 0;
            for (int i = 0; i < NMAT; i++) {
                if (mode == 0)
                    gv_linear(x, K[i], w8[i], sc[i], y, N[i], 1, N[i], K[i], DT_F32, threads);
                else if (mode == 1)
                    gv_linear(xb, K[i], w16[i], NULL, yb, N[i], 1, N[i], K[i], DT_BF16, threads);
                else
                    gv_linear(x, K[i], w32[i], NULL, y, N[i], 1, N[i], K[i], DT_F32, threads);
                bytes += (double)N[i] * K[i] * (mode == 0 ? 1 : mode == 1 ? 2 : 4);
            }
            const double dt = now() - t;
            printf("%-8s %7.2f ms  %5.1f GB/s\n", names[mode], dt * 1e3, bytes / dt / 1e9);
        }
    return 0;
}
