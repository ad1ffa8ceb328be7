"""In-process A/B of the fused copy + CRC-32C (docs/benchmarks.md, "Shared-memory transport
(issue 14)", round 4). From the repository root:

    PYTHONPATH=. python docs/bench/crc_copy_ab.py ROUNDS TOKENS   (the docs: 9 4096)

SmolLM2-135M's KV in float32 (30 layers, 16-token blocks of 3 x 64): TOKENS=4096 is 189 MB,
copied into a prefaulted /dev/shm mapping (the sender's kept segment). One thread; each
round runs every variant once over the whole payload, in turn, so the source is cold for
each (189 MB is several times the last-level cache). Variants:

    memcpy          torch `copy_` of each part, no CRC (the floor)
    pieces          main's sender: 256 KiB slices copied into the segment, then `crc32c()`
    <path>          `pdserve::copy_crc32c` on each 3.1 MB K or V part (the sender's call)
    <path>/ingest   `pdserve::ingest_kv_blocks` of each layer's K and V into a cache of the
                    same size (the receiver's call: 12 KiB blocks, ascending ids)

for every path compiled in. GB/s of payload, min / median over rounds.
"""

import mmap
import os
import statistics
import sys
import tempfile
import time

import torch
from crc32c import crc32c

from pdserve.engine.cpu_kernels.crc_copy import compiled_paths, copy_crc32c
from pdserve.engine.cpu_kernels.kv_ingest import ingest_kv_blocks

torch.set_num_threads(1)
ROUNDS, TOKENS = (int(a) for a in sys.argv[1:3])
LAYERS, BLOCK_BYTES = 30, 16 * 3 * 64 * 4
part_bytes = TOKENS // 16 * BLOCK_BYTES
total = 2 * LAYERS * part_bytes
src = torch.randint(0, 256, (total,), dtype=torch.uint8)
parts = [src[i:i + part_bytes] for i in range(0, total, part_bytes)]  # K, V of each layer
with tempfile.TemporaryFile(dir="/dev/shm") as f:
    f.truncate(total)
    seg = mmap.mmap(f.fileno(), total)
dst = torch.frombuffer(seg, dtype=torch.uint8)
dst.fill_(0)  # fault every page in, as a kept mapping is
want = 0
for p in parts:
    want = crc32c(p.numpy(), want)
seg_view = memoryview(seg)


def memcpy() -> int:
    for i, p in enumerate(parts):
        dst[i * part_bytes:(i + 1) * part_bytes].copy_(p)
    return want


def pieces() -> int:
    crc, at = 0, 0
    for p in parts:
        mv = memoryview(p.numpy())
        for s in range(0, part_bytes, 256 << 10):
            piece = mv[s:s + (256 << 10)]
            seg_view[at:at + piece.nbytes] = piece
            crc = crc32c(seg_view[at:at + piece.nbytes], crc)
            at += piece.nbytes
    return crc


def fused(path: str, step: int):
    def run() -> int:
        crc = 0
        for at in range(0, total, step):
            crc = copy_crc32c(dst[at:at + step], src[at:at + step], crc, path)
        return crc
    return run


blocks = part_bytes // BLOCK_BYTES
cache = torch.zeros(LAYERS, 2, blocks, BLOCK_BYTES, dtype=torch.uint8)
ids = torch.arange(blocks)
want_layers = [crc32c(parts[2 * i + 1].numpy(), crc32c(parts[2 * i].numpy()))
               for i in range(LAYERS)]


def ingest(path: str):
    def run() -> list[int]:
        return [ingest_kv_blocks(cache[i, 0], cache[i, 1], ids,
                                 parts[2 * i].view(blocks, -1), parts[2 * i + 1].view(blocks, -1),
                                 path=path) for i in range(LAYERS)]
    return run


variants = {"memcpy": memcpy, "pieces": pieces}
fast = [path for path in compiled_paths() if path != "portable"]
variants.update({path: fused(path, part_bytes) for path in fast})
variants.update({path + "/ingest": ingest(path) for path in fast})
times: dict[str, list[float]] = {name: [] for name in variants}
for _ in range(ROUNDS):
    for name, fn in variants.items():
        out = cache if name.endswith("/ingest") else dst
        out.zero_()  # untimed: the destination's old contents out of the cache
        t = time.perf_counter()
        got = fn()
        times[name].append(time.perf_counter() - t)
        assert got == (want_layers if name.endswith("/ingest") else want), name
        assert torch.equal(out.view(-1), src), name
print(f"{total / 1e6:.0f} MB, {ROUNDS} rounds, load average {os.getloadavg()}")
for name, ts in times.items():
    print(f"{name:14s} GB/s min {total / max(ts) / 1e9:5.2f}  median "
          f"{total / statistics.median(ts) / 1e9:5.2f}  max {total / min(ts) / 1e9:5.2f}")
