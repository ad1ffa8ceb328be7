"""pdserve::paged_prefill_attention alone: one prompt of T tokens with SmolLM2's heads (Hq 9,
Hkv 3, D 64) over a paged cache in shuffled blocks, two threads; the median of 7 rounds of
10 calls, and GFLOP/s counting the causal half only. LOOP=S repeats it S seconds (for perf).

    OMP_WAIT_POLICY=PASSIVE DTYPE=float32 python docs/bench/cpu-s20/prefill_attention.py T

Run from outside the checkout with PYTHONPATH=<a tree> to time that tree."""
import os
import sys
import time

import torch

from pdserve.engine.cpu_kernels.paged_prefill import paged_prefill_attention

torch.set_num_threads(2)
dt = getattr(torch, os.environ.get("DTYPE", "float32"))
T = int(sys.argv[1]) if len(sys.argv) > 1 else 512
bs, nb = 16, (T + 15) // 16
g = torch.Generator().manual_seed(0)
q = torch.randn(T, 9, 64, generator=g).to(dt)
k = torch.randn(nb + 4, bs, 3, 64, generator=g).to(dt)
v = torch.randn(nb + 4, bs, 3, 64, generator=g).to(dt)
bt = torch.randperm(nb + 4, generator=g)[:nb].to(torch.int32)[None]
out = torch.empty_like(q)


def call():
    paged_prefill_attention(q, k, v, [T], [T], bt, 0.125, out)


call()
if os.environ.get("LOOP"):
    t0 = time.time()
    while time.time() - t0 < float(os.environ["LOOP"]):
        call()
else:
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            call()
        ts.append((time.perf_counter() - t0) / 10 * 1e3)
    ts.sort()
    flop = 2 * 2 * 9 * 64 * T * (T + 1) / 2
    print(f"{dt} T={T}: median {ts[3]:.3f} ms/layer (min {ts[0]:.3f}), "
          f"{flop / ts[3] / 1e6:.0f} GFLOP/s")
