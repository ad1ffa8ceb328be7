"""The paged decode kernel's AVX2 steps ask for the next block ahead of its reads (struct
ahead in paged_decode.c): every line of each work item's next block, K's and V's, exactly
once, and nothing else. Results cannot show a wrong address (a prefetch never faults and
changes no value), so this builds the kernel for x86-64-v3 (the AVX2 steps, whatever this
CPU has) with every prefetch recorded, runs it on shuffled block tables, and compares the
lines asked for with the lines the next blocks hold: whole rows (an item with every KV
head), one head's part of each row (a short sequence alone), one long sequence split in
token ranges (each item asks for the blocks of its own range only), float32 and bfloat16
caches, head dims 64 and 128, groups of one to four query heads, partial last blocks."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from pdserve.engine.cpu_kernels.build import CFLAGS, SOURCES

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("gcc") is None,
    reason="the AVX2 steps are x86-64 code, built here with gcc")

HOOK = r"""
void pf_record(const void *p);
#define __builtin_prefetch(p, rw, loc) pf_record(p)
"""

DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int pd_decode(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
              const int32_t *, void *, int, int, int, int, int, float, int, int, int);
int pd_range_tokens(const int32_t *, int, int);
static const char *kbase, *vbase;
static size_t kvbytes;
static unsigned char *seen[2];
static long stray;
void pf_record(const void *p)
{
    const char *c = p;
    for (int w = 0; w < 2; w++) {
        const char *base = w ? vbase : kbase;
        if (c >= base && c < base + kvbytes && (c - base) % 64 == 0) {
            __atomic_fetch_add(&seen[w][(c - base) / 64], 1, __ATOMIC_RELAXED);
            return;
        }
    }
    __atomic_fetch_add(&stray, 1, __ATOMIC_RELAXED);
}
/* argv: B Hq Hkv D kv_dtype(0 float32, 1 bfloat16) seed long(0, 1: 513-2,012 tokens, else
 * 1-100); prints wrong line counts and the ranges past the first. The kernel's two threads
 * record at once, so the counts are atomic. */
int main(int argc, char **argv)
{
    (void)argc;
    const int B = atoi(argv[1]), Hq = atoi(argv[2]), Hkv = atoi(argv[3]), D = atoi(argv[4]);
    const int dt = atoi(argv[5]), bs = 16, es = dt ? 2 : 4;
    srand(atoi(argv[6]));
    int32_t *lens = malloc(B * sizeof *lens);
    int maxb = 0, nb = 0;
    for (int b = 0; b < B; b++) {
        lens[b] = atoi(argv[7]) ? 513 + rand() % 1500 : 1 + rand() % 100;
        const int n = (lens[b] + bs - 1) / bs;
        nb += n;
        maxb = n > maxb ? n : maxb;
    }
    int32_t *tables = calloc((size_t)B * maxb, sizeof *tables), *perm = malloc(nb * sizeof *perm);
    for (int i = 0; i < nb; i++)
        perm[i] = i;
    for (int i = nb - 1; i > 0; i--) {
        const int j = rand() % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int b = 0, at = 0; b < B; b++)
        for (int i = 0; i < (lens[b] + bs - 1) / bs; i++)
            tables[b * maxb + i] = perm[at++];
    const size_t row = (size_t)Hkv * D * es;
    kvbytes = (size_t)nb * bs * row;
    char *k = aligned_alloc(64, kvbytes), *v = aligned_alloc(64, kvbytes);
    memset(k, 0, kvbytes);
    memset(v, 0, kvbytes);
    kbase = k;
    vbase = v;
    seen[0] = calloc(kvbytes / 64, 1);
    seen[1] = calloc(kvbytes / 64, 1);
    /* the query and output in float32 either way: the query's dtype picks no step here */
    float *q = calloc((size_t)B * Hq * D, sizeof *q), *out = malloc((size_t)B * Hq * D * 4);
    if (pd_decode(q, Hq * D, k, v, tables, maxb, lens, out, B, Hq, Hkv, D, bs, 0.1f, 0, dt, 2))
        return 2;
    /* a range's first block is no item's next block: asked for by none */
    const int limit = pd_range_tokens(lens, B, bs);
    long wrong = 0, ranges = 0; /* next-block lines asked for other than once */
    for (int b = 0; b < B; b++)
        for (int blk = 1; blk < (lens[b] + bs - 1) / bs; blk++) {
            const int n = lens[b] - blk * bs < bs ? lens[b] - blk * bs : bs;
            const int next = blk % (limit / bs) != 0;
            ranges += !next;
            for (int t = 0; t < n; t++)
                for (size_t o = 0; o < row; o += 64) {
                    const size_t l = (((size_t)tables[b * maxb + blk] * bs + t) * row + o) / 64;
                    for (int w = 0; w < 2; w++) {
                        wrong += seen[w][l] != next;
                        seen[w][l] = 0;
                    }
                }
        }
    long other = 0; /* lines asked for outside every next block */
    for (size_t l = 0; l < kvbytes / 64; l++)
        other += seen[0][l] + seen[1][l];
    printf("%ld %ld %ld %ld\n", wrong, other, stray, ranges);
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("prefetch")
    (d / "hook.h").write_text(HOOK)
    (d / "driver.c").write_text(DRIVER)
    kernel = next(s for s in SOURCES if s.name == "paged_decode.c")
    flags = ["-march=x86-64-v3", *(f for f in CFLAGS if f not in ("-fPIC", "-shared"))]
    subprocess.run(["gcc", *flags, f"-I{kernel.parent}", "-include", str(d / "hook.h"), "-c",
                    str(kernel), "-o", str(d / "kernel.o")], check=True, capture_output=True)
    subprocess.run(["gcc", *flags, str(d / "driver.c"), str(d / "kernel.o"), "-lm", "-o",
                    str(d / "driver")], check=True, capture_output=True)
    return str(d / "driver")


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 64), (32, 8, 128), (4, 4, 128)])
@pytest.mark.parametrize("kv_dtype", [0, 1], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("batch,long", [(1, 0), (1, 1), (16, 0)],
                         ids=["one-head-items", "split-sequence", "whole-row-items"])
def test_next_block_lines_asked_for_once(driver, batch, long, kv_dtype, hq, hkv, d):
    for seed in range(3):
        out = subprocess.run([driver, str(batch), str(hq), str(hkv), str(d), str(kv_dtype),
                              str(seed), str(long)],
                             check=True, capture_output=True, text=True).stdout
        wrong, other, stray, ranges = map(int, out.split())
        assert (ranges > 0) == bool(long)  # only a long sequence is split
        assert (wrong, other, stray) == (0, 0, 0), (
            f"seed {seed}: {wrong} next-block lines asked for other than once, {other} lines "
            f"of no next block, {stray} addresses outside the cache")
