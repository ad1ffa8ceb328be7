"""The paged decode attention kernel alone on SmolLM2-135M's shapes: best ms per layer call
and GB/s of K/V read, with K/V cycled through >= 256 MB (so from DRAM). From the repository
root:

    .venv/bin/python docs/bench/cpu-s26/attn_drv.py B CTX float32|bfloat16 SECONDS [THREADS]

env SEQ=1: blocks in order instead of shuffled; HUGE=1: caches on transparent huge pages;
LAYERS=n: cycle n layers' caches instead (LAYERS=1 and a small B*CTX: from the caches)."""

import mmap
import os
import sys
import time

import torch

from pdserve.bench.cpu_attention import BS, HKV, HQ, D
from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention


def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = dtype.itemsize
    for x in shape:
        nbytes *= x
    if os.environ.get("HUGE") == "1":
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(m, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype)


def main() -> None:
    b, ctx, dt, secs = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), \
        float(sys.argv[4])
    torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else 2)
    g = torch.Generator().manual_seed(0)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    nb = (ctx + BS - 1) // BS
    ids = (torch.arange(b * nb) if os.environ.get("SEQ") == "1"
           else torch.randperm(b * nb, generator=g)).int()
    tables = ids.view(b, nb).contiguous()
    kvb = b * ctx * HKV * D * 2 * dt.itemsize
    layers = int(os.environ.get("LAYERS", 0)) or max(2, -(-(256 << 20) // kvb))
    caches = []
    for _ in range(layers):
        kv = []
        for _ in range(2):
            t = alloc((b * nb, BS, HKV, D), dt)
            t.copy_(torch.randn(b * nb, BS, HKV, D, generator=g))
            kv.append(t)
        caches.append(kv)
    q = torch.randn(b, HQ, D, generator=g).to(dt)
    t0, best = time.perf_counter(), float("inf")
    while time.perf_counter() - t0 < secs:
        t = time.perf_counter()
        for kc, vc in caches:
            paged_decode_attention(q, kc, vc, lens, tables, D ** -0.5)
        best = min(best, (time.perf_counter() - t) / layers)
    print(f"B={b} ctx={ctx} {dt}: {best * 1e3:.3f} ms/layer, {kvb / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
