"""The paged decode attention kernel called in a loop for SECS seconds on one cache (64
sequences of 270-330 tokens, SmolLM2's heads, bfloat16, block size BS): ms per call, for
`perf record` (session 12, docs/benchmarks.md section 6).

    T=1 SECS=10 perf record -o /tmp/perf.data python docs/bench/cpu-s12/attention_loop.py
"""
import os
import time

import torch

from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention

torch.set_num_threads(int(os.environ.get("T", 2)))
HQ, HKV, D, BS = 9, 3, 64, int(os.environ.get("BS", 16))
g = torch.Generator().manual_seed(0)
B = 64
lens = torch.randint(270, 331, (B,), generator=g, dtype=torch.int32)
nblk = (lens + BS - 1) // BS
nb = int(nblk.sum())
ids = torch.randperm(nb, generator=g).int()
tables = torch.zeros(B, int(nblk.max()), dtype=torch.int32)
at = 0
for r, n in enumerate(nblk.tolist()):
    tables[r, :n] = ids[at:at + n]
    at += n
kc = torch.randn(nb, BS, HKV, D, generator=g).bfloat16()
vc = torch.randn(nb, BS, HKV, D, generator=g).bfloat16()
q = torch.randn(B, HQ, D, generator=g).bfloat16()
t0 = time.perf_counter()
n = 0
while time.perf_counter() - t0 < float(os.environ.get("SECS", 8)):
    paged_decode_attention(q, kc, vc, lens, tables, D ** -0.5)
    n += 1
print(f"{(time.perf_counter() - t0) / n * 1e3:.3f} ms per call")
