"""One layer's paged attention on the CPU kernels, SmolLM2-135M's heads (9 query, 3 KV,
head_dim 64, blocks of 16), timed alone:

    OMP_NUM_THREADS=T python docs/bench/cpu-s18/attention_one_layer.py prefill|decode \
        [float32|bfloat16] [N]

prefill: one 512-token prompt attending causally to itself. decode: 64 sequences of 256
cached tokens, one query token each. Prints the mean over N calls (default 50) after one
untimed call. To compare two sources of the kernels, run it once per tree (the library is
built from the tree's source on first use and cached under a hash of it).
"""
import os
import sys
import time

import torch

from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention
from pdserve.engine.cpu_kernels.paged_prefill import paged_prefill_attention

mode = sys.argv[1]
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
n = int(sys.argv[3]) if len(sys.argv) > 3 else 50
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
bs, hq, hkv, d = 16, 9, 3, 64
if mode == "prefill":
    L = 512
    k, v = (torch.randn(L // bs, bs, hkv, d).to(dtype) for _ in range(2))
    tables = torch.arange(L // bs, dtype=torch.int32).view(1, -1)
    q = torch.randn(L, hq, d).to(dtype)

    def run():
        return paged_prefill_attention(q, k, v, [L], [L], tables, 0.125)
else:
    B, L = 64, 256
    k, v = (torch.randn(B * L // bs, bs, hkv, d).to(dtype) for _ in range(2))
    tables = torch.randperm(B * L // bs, dtype=torch.int32).view(B, L // bs).contiguous()
    q = torch.randn(B, hq, d).to(dtype)
    lens = torch.full((B,), L, dtype=torch.int32)

    def run():
        return paged_decode_attention(q, k, v, lens, tables, 0.125)
run()
t = time.perf_counter()
for _ in range(n):
    run()
print(f"{mode} {dtype}, {torch.get_num_threads()} thread(s): "
      f"{(time.perf_counter() - t) / n * 1e3:.2f} ms a layer")
