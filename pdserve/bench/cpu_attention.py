"""Attention on the CPU, one layer's call, on SmolLM2-135M's shapes: the `torch` backend's
references against the `cpu` backend's paged C kernels.

    python -m pdserve.bench.cpu_attention [--only decode,prefill] [--iters 10] [--threads N]

decode: gather + SDPA against the decode kernel. Each case holds enough layers' caches to
overflow the last-level cache and cycles through them, as a real decode step does, so K/V
come from DRAM rather than a warm L3. Sequences get contexts within +-10% of the nominal
one on shuffled blocks. The torch plan is built once per case (a step builds it once for
all layers) and left out of the timing. GB/s counts the K/V bytes a decode must read:
sum(seq_lens) * Hkv * D * 2 * itemsize.

prefill: one chunk of L query tokens over P cached tokens (shuffled blocks): the SDPA
reference (gather + causal or explicit mask), the decode kernel row-wise (one row per
query token) and the prefill kernel. GFLOP/s counts the causal attention's multiply-adds
twice: 4 * Hq * D * L * (P + (L + 1) / 2).
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.engine.attention.torch_backend import (
    decode_attention_bucketed,
    plan_decode_buckets,
    prefill_attention_reference,
)
from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention
from pdserve.engine.cpu_kernels.paged_prefill import paged_prefill_attention

HQ, HKV, D, BS = 9, 3, 64, 16
MIN_WORKING_SET = 256 << 20  # bytes of K/V cycled through: several times a 32 MiB L3


def _case(batch: int, ctx: int, dtype: torch.dtype, iters: int, gen: torch.Generator):
    lens = torch.randint(int(ctx * 0.9), int(ctx * 1.1) + 1, (batch,), generator=gen,
                         dtype=torch.int32)
    nblk = (lens + BS - 1) // BS
    max_blocks = int(nblk.max())
    num_blocks = int(nblk.sum())
    ids = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    at = 0
    for row, n in enumerate(nblk.tolist()):
        tables[row, :n] = ids[at:at + n]
        at += n
    kv_bytes = int(lens.sum()) * HKV * D * 2 * dtype.itemsize
    layers = max(2, -(-MIN_WORKING_SET // kv_bytes))
    shape = (num_blocks, BS, HKV, D)
    caches = [(torch.randn(shape, generator=gen).to(dtype),
               torch.randn(shape, generator=gen).to(dtype)) for _ in range(layers)]
    query = torch.randn(batch, HQ, D, generator=gen).to(dtype)
    scale = D ** -0.5
    plans = plan_decode_buckets(lens, lens.tolist(), tables, BS)

    def torch_call(kc, vc):
        return decode_attention_bucketed(query, kc, vc, plans, scale)

    def kernel_call(kc, vc):
        return paged_decode_attention(query, kc, vc, lens, tables, scale)

    ref = torch_call(*caches[0]).float()
    err = (kernel_call(*caches[0]).float() - ref).abs().max().item()
    # one timed call = one step's worth: every layer's cache once, so K/V come from DRAM
    times = _best_of({"torch": lambda: [torch_call(kc, vc) for kc, vc in caches],
                      "cpu": lambda: [kernel_call(kc, vc) for kc, vc in caches]}, iters)
    return {k: v / layers for k, v in times.items()}, kv_bytes, err


def _best_of(calls: dict, iters: int) -> dict[str, float]:
    """Seconds per call of each, best of two interleaved rounds after a warm-up call."""
    for fn in calls.values():
        fn()
    times: dict[str, float] = {}
    for _ in range(2):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            dt = (time.perf_counter() - t0) / iters
            times[name] = min(times.get(name, dt), dt)
    return times


def _prefill_case(prefix: int, qlen: int, dtype: torch.dtype, iters: int,
                  gen: torch.Generator):
    seq_len = prefix + qlen
    nblk = (seq_len + BS - 1) // BS
    table = torch.randperm(nblk + 8, generator=gen)[:nblk].int().unsqueeze(0)
    shape = (nblk + 8, BS, HKV, D)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(qlen, HQ, D, generator=gen).to(dtype)
    scale = D ** -0.5
    rows = torch.arange(prefix + 1, seq_len + 1, dtype=torch.int32)
    calls = {
        "sdpa": lambda: prefill_attention_reference(query, kc, vc, [0, qlen], [seq_len],
                                                    table, scale),
        "rowwise": lambda: paged_decode_attention(query, kc, vc, rows,
                                                  table.expand(qlen, -1), scale),
        "prefill": lambda: paged_prefill_attention(query, kc, vc, [qlen], [seq_len], table,
                                                   scale),
    }
    ref = calls["sdpa"]().float()
    err = max((calls[k]().float() - ref).abs().max().item() for k in ("rowwise", "prefill"))
    return _best_of(calls, iters), err


def _decode_table(iters: int, gen: torch.Generator) -> None:
    print(f"decode: Hq={HQ} Hkv={HKV} D={D} block_size={BS} threads={torch.get_num_threads()}"
          "; ms per layer call, GB/s of K/V read")
    print(f"{'dtype':>8} {'B':>3} {'ctx':>5} {'KV MB':>6} | {'torch ms':>8} {'GB/s':>5} | "
          f"{'cpu ms':>7} {'GB/s':>5} | {'speedup':>7} {'max|err|':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (32, 64):
            for ctx in (400, 1000):
                t, nbytes, err = _case(batch, ctx, dtype, iters, gen)
                gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
                print(f"{str(dtype)[6:]:>8} {batch:>3} {ctx:>5} {nbytes / 1e6:>6.1f} | "
                      f"{t['torch'] * 1e3:>8.2f} {gbs['torch']:>5.1f} | "
                      f"{t['cpu'] * 1e3:>7.2f} {gbs['cpu']:>5.1f} | "
                      f"{t['torch'] / t['cpu']:>6.1f}x {err:>9.1e}", flush=True)


def _prefill_table(iters: int, gen: torch.Generator) -> None:
    print(f"prefill: Hq={HQ} Hkv={HKV} D={D} block_size={BS} threads={torch.get_num_threads()}"
          "; ms per layer call (GFLOP/s)")
    print(f"{'dtype':>8} {'P':>5} {'L':>5} | {'sdpa':>15} | {'rowwise':>15} | {'prefill':>15} "
          f"| {'max|err|':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        for prefix, qlen in ((0, 128), (0, 512), (0, 1024), (0, 2048), (512, 512),
                             (2048, 2048)):
            t, err = _prefill_case(prefix, qlen, dtype, max(1, iters // 2), gen)
            flop = 4 * HQ * D * qlen * (prefix + (qlen + 1) / 2)
            cells = " | ".join(f"{t[k] * 1e3:>7.2f} ({flop / t[k] / 1e9:>4.0f})"
                               for k in ("sdpa", "rowwise", "prefill"))
            print(f"{str(dtype)[6:]:>8} {prefix:>5} {qlen:>5} | {cells} | {err:>8.1e}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--only", default="decode,prefill",
                   help="comma-separated tables to print: decode, prefill")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    only = a.only.split(",")
    with torch.inference_mode():
        if "decode" in only:
            _decode_table(a.iters, gen)
        if "prefill" in only:
            _prefill_table(a.iters, gen)


if __name__ == "__main__":
    main()
