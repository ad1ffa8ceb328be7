"""In-process A/B of the receiver's pass over received KV (docs/benchmarks.md, "Shared-memory
transport (issue 14)"). From the repository root:

    PYTHONPATH=. python docs/bench/kv_ingest_ab.py ROUNDS TOKENS CHUNK_BLOCKS
    (the docs: 9 4096 256 and 9 2048 128: one chunk per layer, as the shm sender sends)

SmolLM2-135M's KV layout in float32 (30 layers, 16-token blocks of 3 x 64), one thread.
A = main's receiver: CRC-32C of the chunk (`crc32c` package), then `copy_blocks` of K and
V; B = `kv_blocks.ingest_blocks` (exclusive: the C op copying and checksumming in one
pass). Sources: one contiguous payload, K then V per chunk, packed as in a segment. Block
ids ascending (a fresh pool: `copy_blocks` copies one slice) and descending (blocks freed
by an earlier sequence: its row-gather path). Rounds interleave A and B; GB/s of payload,
min and median over rounds.
"""

import statistics
import sys
import time

import torch
from crc32c import crc32c

from pdserve.engine.kv_blocks import copy_blocks, ingest_blocks

torch.set_num_threads(1)
ROUNDS, TOKENS, PER_CHUNK = (int(a) for a in sys.argv[1:4])
LAYERS, BLOCK = 30, (16, 3, 64)
n = TOKENS // BLOCK[0]
cache = torch.zeros(LAYERS, 2, 2 * n + 100, *BLOCK)
payload = torch.randn(LAYERS, n, 2, *BLOCK)  # per layer: chunks of [K blocks, V blocks]
chunks = []  # (layer, first block, k view, v view, crc)
for layer in range(LAYERS):
    flat = payload[layer].view(-1)
    at = 0
    for s in range(0, n, PER_CHUNK):
        m = min(PER_CHUNK, n - s)
        size = m * BLOCK[0] * BLOCK[1] * BLOCK[2]
        k, v = flat[at:at + size].view(m, *BLOCK), flat[at + size:at + 2 * size].view(m, *BLOCK)
        at += 2 * size
        chunks.append((layer, s, k, v, crc32c(flat[at - 2 * size:at].numpy().tobytes())))
total = payload.numel() * payload.element_size()


def a(ids):
    for layer, s, k, v, crc in chunks:
        kb = memoryview(k.reshape(-1).view(torch.uint8).numpy())
        vb = memoryview(v.reshape(-1).view(torch.uint8).numpy())
        if crc32c(vb, crc32c(kb)) != crc:
            raise AssertionError
        copy_blocks(cache[layer, 0], ids[s:s + len(k)], k)
        copy_blocks(cache[layer, 1], ids[s:s + len(k)], v)


def b(ids):
    for layer, s, k, v, crc in chunks:
        ingest_blocks([(cache[layer, 0], cache[layer, 1])], ids[s:s + len(k)], k[None],
                      v[None], crc, exclusive=True)


for order, ids in (("ascending", list(range(50, 50 + n))),
                   ("descending", list(range(50 + n - 1, 49, -1)))):
    times = {"A crc32c + copy_blocks": [], "B ingest_blocks": []}
    a(ids), b(ids)  # first touch
    for _ in range(ROUNDS):
        for name, fn in zip(times, (a, b)):
            t0 = time.perf_counter()
            fn(ids)
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{TOKENS} tokens ({total / 1e6:.0f} MB), {order:10s} {name:22s} "
              f"min {total / min(ts) / 1e9:5.2f}  median {total / statistics.median(ts) / 1e9:5.2f}"
              " GB/s")
