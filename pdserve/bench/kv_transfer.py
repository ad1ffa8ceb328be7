"""KV-transfer benchmark: loopback bandwidth and how much of TTFT the transfer adds.

    python -m pdserve.bench.kv_transfer [--lengths 1024,4096] [--repeats 3] [--max-chunk-bytes N]
                                [--transport grpc,shm] [--no-ttft] [--out docs/kv_transfer.json]

Starts a real local cluster (1 prefill worker on one core, 1 decode worker on the other),
then talks to the workers directly:

1. Bandwidth of the transport alone. This process pushes a prompt-sized set of KV blocks
   in SmolLM2's layout (random values, every layer) into a reservation on the decode
   worker through the sender prefill workers use (`ShmKVTransport`), once per transport
   asked for: `grpc` (payloads in the Push messages) and `shm` (payloads through the
   decode worker's shared-memory segment offered at Reserve, descriptors on the stream).
   - bytes: KV payload, K and V of every (layer, block) of the reservation (chunk headers,
     ~100 B per chunk, excluded); GB = 1e9 bytes.
   - time: from `open()` to the decode worker's acknowledgement of the commit, i.e. every
     byte validated and written into its cache. The tensors exist before the clock starts,
     so no prefill compute is inside the window: this is what the link sustains, not what
     a CPU prefill asks of it (part 2 shows that is ~1 % of it).
   - where: this process pins itself to the prefill worker's cores first, so sender and
     receiver sit where a real pair does (one core each) instead of wherever the scheduler
     puts an unpinned bench process. One untimed push of the same size goes first
     (connection set-up, first touch of the cache pages); reservations ask for one token,
     so the commit finishes the sequence and no decode step runs into the next push.
   - CPU: each side's CPU time per MiB moved (this process; the decode worker process),
     to tell which end limits.
2. TTFT share (skipped with `--no-ttft`): real prefills of distinct prompts (no prefix
   hits): Reserve at the decode worker, Prefill at the prefill worker; the prefill worker
   reports compute time and the transfer time left after its last layer finished (the part
   compute did not hide). With
   `shm` the Prefill request carries the Reserve's offer, as the gateway passes it on.
   `kv_production_GBps` = KV bytes / compute time: the rate a prefill produces KV at, which
   a layer-wise push has to keep up with.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pdserve import rpc
from pdserve.bench.report_io import emit_report
from pdserve.bench.thread_cpu import process_cpu_s
from pdserve.cluster import LocalCluster
from pdserve.cluster_auth import ClusterCredentials
from pdserve.convert import kv_spec_from_proto
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer.shm import offer_from_proto
from pdserve.kvtransfer.shm_sender import ShmKVTransport
from pdserve.kvtransfer.sink import KVCommitInfo
from pdserve.protocol import SamplingParams
from pdserve.protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

_push_ids = itertools.count()  # request ids stay distinct when a run measures twice
BANDWIDTH_DEFINITION = (
    "KV payload bytes (K+V of every layer and block) / seconds from open() to the commit "
    "ack, tensors ready before the clock starts; sender pinned to the prefill worker's "
    "cores; after one untimed push; GB = 1e9 B")


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + j * 31) % 40000 + 100 for j in range(n)]


async def _reserve(d, ids: list[int], rid: str, max_tokens: int = 2):
    return await d.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, prompt_token_ids=ids,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0).to_proto()))


def pin_this_process(cores: tuple[int, ...] | None) -> None:
    """Pins every thread of this process (gRPC's included) to `cores`; threads started
    later inherit it."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


@dataclass(frozen=True)
class _Push:
    """One timed push: payload bytes, wall seconds, CPU seconds of each end."""

    nbytes: int
    wall_s: float
    sender_cpu_s: float
    receiver_cpu_s: float


async def _push_once(d, decode_addr: str, decode_pid: int, transport: ShmKVTransport,
                     n_tokens: int, salt: int, kv_cache: dict) -> _Push:
    """Pushes a whole reservation of a distinct prompt."""
    rid = f"bw-{transport.mode}-{n_tokens}-{salt}-{next(_push_ids)}"
    res = await _reserve(d, _prompt(n_tokens, salt), rid, max_tokens=1)
    spec: KVCacheSpec = kv_spec_from_proto(res.kv_spec)
    n = res.num_blocks
    key = (spec, n)
    if key not in kv_cache:
        kv_cache[key] = torch.randn(spec.num_layers, 2, n, *spec.block_shape).to(
            spec.torch_dtype)
    kv = kv_cache[key]
    s0, r0 = time.process_time(), process_cpu_s(decode_pid)
    t0 = time.perf_counter()
    offer = offer_from_proto(res.shm) if res.HasField("shm") else None
    stream = transport.open(decode_addr, res.reservation_id, spec, res.reservation_secret,
                            shm=offer)
    for layer in range(spec.num_layers):
        stream.push_layer(layer, list(range(n)), kv[layer, 0], kv[layer, 1])
    result = await asyncio.to_thread(
        stream.commit, KVCommitInfo(num_prompt_tokens=n_tokens, first_token_id=1))
    dt = time.perf_counter() - t0
    push = _Push(result.bytes_sent, dt, time.process_time() - s0,
                 process_cpu_s(decode_pid) - r0)
    # max_tokens=1: the commit finished the request; these are no-ops unless it failed
    await d.Cancel(decode_pb2.CancelRequest(reservation_id=res.reservation_id))
    await d.Cancel(decode_pb2.CancelRequest(request_id=rid))
    return push


async def bandwidth(decode_addr: str, decode_pid: int, n_tokens: int, repeats: int,
                    chunk: int, mode: str, creds: ClusterCredentials) -> dict:
    rates, send_cpu, recv_cpu = [], [], []
    kv_cache: dict = {}
    async with rpc.aio_channel(decode_addr, creds) as ch:
        d = decode_pb2_grpc.DecodeWorkerStub(ch)
        # "shm" is strict: a push that could not use shared memory fails the run
        transport = ShmKVTransport(mode, max_chunk_bytes=chunk, credentials=creds)
        await _push_once(d, decode_addr, decode_pid, transport, n_tokens, 999, kv_cache)
        for r in range(repeats):  # after one warm-up push, above
            p = await _push_once(d, decode_addr, decode_pid, transport, n_tokens, 1000 + r,
                                 kv_cache)
            rates.append(p.nbytes / p.wall_s)
            mib = p.nbytes / 2**20
            send_cpu.append(p.sender_cpu_s * 1e3 / mib)
            recv_cpu.append(p.receiver_cpu_s * 1e3 / mib)
        transport.close()
    return {"transport": mode, "bytes": p.nbytes,
            "GBps_median": round(statistics.median(rates) / 1e9, 3),
            "GBps_all": [round(x / 1e9, 3) for x in rates], "max_chunk_bytes": chunk,
            "sender_cpu_ms_per_MiB": [round(x, 3) for x in send_cpu],
            "receiver_cpu_ms_per_MiB": [round(x, 3) for x in recv_cpu]}


async def ttft_split(decode_addr: str, prefill_addr: str, n_tokens: int, repeats: int,
                     mode: str, creds: ClusterCredentials) -> dict:
    rows = []
    async with rpc.aio_channel(decode_addr, creds) as dch, \
            rpc.aio_channel(prefill_addr, creds) as pch:
        d = decode_pb2_grpc.DecodeWorkerStub(dch)
        p = prefill_pb2_grpc.PrefillWorkerStub(pch)
        for r in range(repeats):
            # distinct prompts per transport too: no prefix-cache hit at the prefill worker
            ids = _prompt(n_tokens, r + (0 if mode == "grpc" else 500))
            rid = f"ttft-{mode}-{n_tokens}-{r}"
            res = await _reserve(d, ids, rid)
            stream = d.Decode(decode_pb2.DecodeRequest(reservation_id=res.reservation_id))
            t0 = time.perf_counter()
            pre = await p.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=ids,
                sampling=SamplingParams(max_tokens=2, temperature=0).to_proto(),
                decode_address=decode_addr, reservation_id=res.reservation_id,
                reserved_blocks=res.num_blocks, decode_kv_spec=res.kv_spec,
                reservation_secret=res.reservation_secret,
                decode_shm=res.shm if mode == "shm" else None))
            ttft = time.perf_counter() - t0
            async for _ in stream:
                pass
            t = pre.timing
            rows.append({"ttft_s": ttft, "compute_s": t.compute_s, "transfer_s": t.transfer_s,
                         "bytes": pre.transfer_bytes,
                         "non_overlapped_share": t.transfer_s / ttft,
                         "kv_production_GBps": pre.transfer_bytes / t.compute_s / 1e9})
    med = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    return {"median": med, "runs": rows}


async def run(endpoints, lengths: list[int], repeats: int, chunk: int,
              transports: list[str], creds: ClusterCredentials, ttft: bool = True) -> dict:
    dec = next(w for w in endpoints.workers if w.tier == "decode")
    pre = next(w for w in endpoints.workers if w.tier == "prefill")
    pin_this_process(pre.cpus)
    out = {}
    for n in lengths:
        print(f"{n}-token prompts ...", file=sys.stderr)
        out[str(n)] = {}
        for mode in transports:
            res = {"bandwidth": await bandwidth(dec.address, dec.pid, n, repeats, chunk, mode,
                                                creds)}
            if ttft:
                res["ttft"] = await ttft_split(dec.address, pre.address, n, repeats, mode,
                                               creds)
            out[str(n)][mode] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.kv_transfer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-chunk-bytes", type=int, default=1 << 20,
                   help="payload bytes per KV chunk, for this sender and the prefill "
                        "worker (default 1 MiB, the prefill worker's own default)")
    p.add_argument("--transport", default="grpc,shm",
                   help="transports to measure, comma-separated: grpc, shm (default both)")
    p.add_argument("--no-ttft", action="store_true",
                   help="bandwidth only: no real prefills (part 2), which a loaded machine "
                        "may not finish within the push deadline at 4k tokens")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    transports = a.transport.split(",")
    if not set(transports) <= {"grpc", "shm"}:
        p.error(f"--transport: {a.transport!r} is not a list of grpc, shm")
    cluster = LocalCluster(model=a.model, num_prefill=1, num_decode=1, http_port=0,
                           grpc_port=0, cpus="auto",
                           engine_args=("--kv-cache-memory", "1GiB"),
                           prefill_args=("--max-chunk-bytes", str(a.max_chunk_bytes)))
    with cluster:
        eps = cluster.endpoints
        report = {"command": "python -m pdserve.bench.kv_transfer "
                   + " ".join(argv or sys.argv[1:]),
                  "bandwidth_definition": BANDWIDTH_DEFINITION,
                  "results": asyncio.run(run(eps, lengths, a.repeats, a.max_chunk_bytes,
                                             transports,
                                             ClusterCredentials(token=cluster.cluster_token),
                                             ttft=not a.no_ttft))}
    emit_report(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
