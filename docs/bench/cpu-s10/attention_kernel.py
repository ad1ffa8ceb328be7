"""The CPU paged decode attention kernel alone on SmolLM2's shapes (Hq 9, Hkv 3, D 64): ms
per layer call and GB/s of K/V read, over enough layers' caches to leave the last-level cache
(LAYERS=1: one cache-resident layer), with its max error against a float64 reference
(session 10, docs/benchmarks.md section 6).

    DTS=bfloat16,float32 CASES=64x400,8x400 ITERS=8 python docs/bench/cpu-s10/attention_kernel.py 16

The argument is the block size; PYTHONPATH=<checkout> times another checkout's kernel.
"""
import os
import sys
import time

import torch

from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention

torch.set_num_threads(2)
HQ, HKV, D = 9, 3, 64
BS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
ITERS = int(os.environ.get("ITERS", 6))
gen = torch.Generator().manual_seed(0)


def tables_for(lens: torch.Tensor) -> tuple[torch.Tensor, int]:
    nblk = (lens + BS - 1) // BS
    num_blocks = int(nblk.sum())
    ids = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.zeros(len(lens), int(nblk.max()), dtype=torch.int32)
    at = 0
    for row, n in enumerate(nblk.tolist()):
        tables[row, :n] = ids[at:at + n]
        at += n
    return tables, num_blocks


def reference_error(q, kc, vc, lens, tables, out) -> float:
    err = 0.0
    for b in range(0, len(lens), 13):
        n = int(lens[b])
        rows = tables[b, :(n + BS - 1) // BS].long()
        k = kc[rows].reshape(-1, HKV, D)[:n].double()
        v = vc[rows].reshape(-1, HKV, D)[:n].double()
        qq = q[b].double().view(HKV, HQ // HKV, D)
        s = torch.einsum("hgd,thd->hgt", qq, k) * D ** -0.5
        o = torch.einsum("hgt,thd->hgd", s.softmax(-1), v).reshape(HQ, D)
        err = max(err, (o - out[b].double()).abs().max().item())
    return err


def case(batch: int, ctx: int, dtype: torch.dtype) -> None:
    lens = torch.randint(int(ctx * 0.9), int(ctx * 1.1) + 1, (batch,), generator=gen,
                         dtype=torch.int32)
    tables, num_blocks = tables_for(lens)
    kv_bytes = int(lens.sum()) * HKV * D * 2 * dtype.itemsize
    layers = int(os.environ.get("LAYERS", 0)) or max(2, -(-(640 << 20) // kv_bytes))
    shape = (num_blocks, BS, HKV, D)
    caches = [(torch.randn(shape, generator=gen).to(dtype),
               torch.randn(shape, generator=gen).to(dtype)) for _ in range(layers)]
    q = torch.randn(batch, HQ, D, generator=gen).to(dtype)
    best = float("inf")
    for _ in range(ITERS):
        t0 = time.perf_counter()
        for kc, vc in caches:
            paged_decode_attention(q, kc, vc, lens, tables, D ** -0.5)
        best = min(best, (time.perf_counter() - t0) / layers)
    out = paged_decode_attention(q, *caches[0], lens, tables, D ** -0.5)
    err = reference_error(q, *caches[0], lens, tables, out)
    print(f"{str(dtype)[6:]:>8} B={batch:3d} ctx={ctx:5d} {best * 1e3:7.3f} ms "
          f"{kv_bytes / best / 1e9:6.1f} GB/s err {err:.1e}", flush=True)


for dt in os.environ.get("DTS", "bfloat16,float32").split(","):
    for c in os.environ.get("CASES", "64x400,64x1000,8x400,1x2000").split(","):
        b, ctx = map(int, c.split("x"))
        case(b, ctx, getattr(torch, dt))
