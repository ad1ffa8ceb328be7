/* The paged decode attention kernel (pd_decode) of two builds in one process, alternated
 * call set by call set: B sequences of about CTX tokens (+-10 %) on SmolLM2-135M's heads
 * (Hq 9, Hkv 3, D 64; HQ=, HKV= for others), blocks of 16 tokens, float32 cache, the
 * blocks shuffled (SEQ=1: in order), and enough layers' caches to overflow every cache
 * (LAYERS=N: that many, so LAYERS=1 with a small B x CTX stays in L3); two threads. Prints
 * the mean and min ms per layer call of each build, the K/V GB/s and b / a.
 *
 * From the repository root (A.c and B.c: two versions of paged_decode.c):
 *
 *   d=/tmp/attn_ab; mkdir -p $d; K=pdserve/engine/cpu_kernels
 *   F="-O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp -std=c11 -I$K"
 *   R="-Dpd_validate=pd_validate_X -Dpd_decode_team_redo=pd_decode_team_redo_X -Dpd_decode_team=pd_decode_team_X"
 *   gcc $F ${R//X/a} -Dpd_decode=pd_decode_a -c A.c -o $d/a.o
 *   gcc $F ${R//X/b} -Dpd_decode=pd_decode_b -c B.c -o $d/b.o
 *   gcc $F docs/bench/cpu-s31/attn_ab.c $d/a.o $d/b.o -lm -o $d/ab && $d/ab B CTX ROUNDS
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef int (*fn)(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
                  const int32_t *, void *, int, int, int, int, int, float, int, int, int);
int pd_decode_a(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
                const int32_t *, void *, int, int, int, int, int, float, int, int, int);
int pd_decode_b(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
                const int32_t *, void *, int, int, int, int, int, float, int, int, int);
#define D 64
#define BS 16
int main(int argc, char **argv)
{
    int B = argc > 1 ? atoi(argv[1]) : 32, ctx = argc > 2 ? atoi(argv[2]) : 1000;
    int rounds = argc > 3 ? atoi(argv[3]) : 10;
    const int HQ = getenv("HQ") ? atoi(getenv("HQ")) : 9, HKV = getenv("HKV") ? atoi(getenv("HKV")) : 3;
    int32_t *lens = malloc(B * 4);
    int maxb = 0, nblocks = 0;
    srand(1);
    for (int b = 0; b < B; b++) {
        lens[b] = ctx * 9 / 10 + rand() % (ctx / 5 + 1);
        int nb = (lens[b] + BS - 1) / BS;
        maxb = nb > maxb ? nb : maxb;
        nblocks += nb;
    }
    size_t kvbytes = (size_t)nblocks * BS * HKV * D * 4;
    int layers = getenv("LAYERS") ? atoi(getenv("LAYERS")) : (int)((300u << 20) / kvbytes) + 2;
    int32_t *perm = malloc(nblocks * 4);
    for (int i = 0; i < nblocks; i++) perm[i] = i;
    if (!getenv("SEQ")) for (int i = nblocks - 1; i > 0; i--) { int j = rand() % (i + 1); int t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    int32_t *tables = calloc((size_t)B * maxb, 4);
    int at = 0; long total = 0;
    for (int b = 0; b < B; b++) {
        int nb = (lens[b] + BS - 1) / BS;
        for (int i = 0; i < nb; i++) tables[b * maxb + i] = perm[at++];
        total += lens[b];
    }
    float **k = malloc(layers * sizeof(float *)), **v = malloc(layers * sizeof(float *));
    for (int l = 0; l < layers; l++) {
        k[l] = aligned_alloc(64, kvbytes); v[l] = aligned_alloc(64, kvbytes);
        for (size_t i = 0; i < kvbytes / 4; i++) { k[l][i] = (float)((i * 7) % 13) * 0.01f; v[l][i] = (float)((i * 5) % 11) * 0.01f; }
    }
    float *q = malloc((size_t)B * HQ * D * 4), *out = malloc((size_t)B * HQ * D * 4);
    for (int i = 0; i < B * HQ * D; i++) q[i] = (float)(i % 17) * 0.03f;
    fn f[2] = {pd_decode_a, pd_decode_b};
    double sum[2] = {0}, mn[2] = {1e9, 1e9};
    for (int r = 0; r < rounds + 1; r++)
        for (int w = 0; w < 2; w++) {
            double t0 = omp_get_wtime();
            for (int l = 0; l < layers; l++)
                f[w](q, HQ * D, k[l], v[l], tables, maxb, lens, out, B, HQ, HKV, D, BS, 0.125f, 0, 0, 2);
            double dt = (omp_get_wtime() - t0) / layers;
            if (r) { sum[w] += dt; if (dt < mn[w]) mn[w] = dt; }
        }
    double bytes = (double)total * HKV * D * 2 * 4;
    for (int w = 0; w < 2; w++)
        printf("%c: mean %.3f ms (%.1f GB/s) min %.3f ms\n", 'a' + w, sum[w] / rounds * 1e3, bytes / (sum[w] / rounds) / 1e9, mn[w] * 1e3);
    printf("B %d ctx %d Hq %d Hkv %d layers %d: b/a mean %.3f\n", B, ctx, HQ, HKV, layers,
           sum[1] / sum[0]);
    return 0;
}
