"""Time paged_prefill_attention (one layer's call) on a workload-a-like 2048-token chunk of fresh
prompts (log-uniform 32-512 tokens) and on one 2048-token prompt; bfloat16, SmolLM2's 9/3 heads,
head_dim 64, block size 16:  python docs/bench/cpu-s13/prefill_attention_chunk.py [ITERS]"""
import random
import sys
import time

import torch

from pdserve.engine.cpu_kernels.paged_prefill import paged_prefill_attention

torch.set_num_threads(2)
BS, HQ, HKV, D = 16, 9, 3, 64


def case(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [(n + BS - 1) // BS for n in lens]
    perm = torch.randperm(sum(blocks) + 1, generator=g)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    i = 0
    for p, n in enumerate(blocks):
        tables[p, :n] = perm[i:i + n].int()
        i += n
    k = torch.randn(sum(blocks) + 1, BS, HKV, D, generator=g).bfloat16()
    v = torch.randn(sum(blocks) + 1, BS, HKV, D, generator=g).bfloat16()
    q = torch.randn(sum(lens), HQ, D, generator=g).bfloat16()
    return q, k, v, lens, lens, tables


rng = random.Random(0)
mixed: list[int] = []
while sum(mixed) < 2048:
    mixed.append(int(32 * 16 ** rng.random()))
iters = int(sys.argv[1]) if len(sys.argv) > 1 else 10
for name, lens in ((f"mixed {len(mixed)} seqs", mixed), ("one 2048", [2048])):
    args = case(lens)
    paged_prefill_attention(*args, 0.125)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        paged_prefill_attention(*args, 0.125)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"{name}: median {1e3 * ts[len(ts) // 2]:.2f} ms, min {1e3 * ts[0]:.2f} ms")
