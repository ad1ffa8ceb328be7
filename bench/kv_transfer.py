"""KV-transfer benchmark: loopback bandwidth and how much of TTFT the transfer adds.

    python -m bench.kv_transfer [--lengths 1024,4096] [--repeats 3] [--out docs/kv_transfer.json]

Starts a real local cluster (1 prefill worker on one core, 1 decode worker on the other),
then talks to the workers directly:

1. Bandwidth: pushes a prompt-sized set of KV blocks in SmolLM2's layout (random bytes,
   every layer) from this process into a reservation on the decode worker through
   `GrpcKVTransport`, timing open -> commit acknowledged.
2. TTFT share: real prefills of distinct prompts (no prefix hits): Reserve at the decode
   worker, Prefill at the prefill worker; the prefill worker reports compute time and the
   transfer time left after its last layer finished (the part compute did not hide).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import grpc
import torch

from bench.report_io import emit_report
from engine.kv_cache import KVCacheSpec
from engine.sampling_params import SamplingParams
from kvtransfer.grpc_sender import GrpcKVTransport
from kvtransfer.sink import KVCommitInfo
from pdserve.cluster import LocalCluster
from pdserve.convert import kv_spec_from_proto, sampling_to_proto
from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + j * 31) % 40000 + 100 for j in range(n)]


async def _reserve(d, ids: list[int], rid: str):
    return await d.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, prompt_token_ids=ids,
        sampling=sampling_to_proto(SamplingParams(max_tokens=2, temperature=0))))


async def bandwidth(decode_addr: str, n_tokens: int, repeats: int, chunk: int) -> dict:
    rates = []
    async with grpc.aio.insecure_channel(decode_addr) as ch:
        d = decode_pb2_grpc.DecodeWorkerStub(ch)
        transport = GrpcKVTransport(max_chunk_bytes=chunk)
        for r in range(repeats):
            res = await _reserve(d, _prompt(n_tokens, 1000 + r), f"bw-{n_tokens}-{r}")
            spec: KVCacheSpec = kv_spec_from_proto(res.kv_spec)
            n = res.num_blocks
            kv = torch.randn(spec.num_layers, 2, n, *spec.block_shape).to(spec.torch_dtype)
            t0 = time.perf_counter()
            stream = transport.open(decode_addr, res.reservation_id, spec)
            for layer in range(spec.num_layers):
                stream.push_layer(layer, list(range(n)), kv[layer, 0], kv[layer, 1])
            result = await asyncio.to_thread(
                stream.commit, KVCommitInfo(num_prompt_tokens=n_tokens, first_token_id=1))
            dt = time.perf_counter() - t0
            rates.append(result.bytes_sent / dt)
            await d.Cancel(decode_pb2.CancelRequest(reservation_id=res.reservation_id))
            await d.Cancel(decode_pb2.CancelRequest(request_id=f"bw-{n_tokens}-{r}"))
        transport.close()
    return {"bytes": result.bytes_sent, "GBps_median": round(statistics.median(rates) / 1e9, 3),
            "GBps_all": [round(x / 1e9, 3) for x in rates], "max_chunk_bytes": chunk}


async def ttft_split(decode_addr: str, prefill_addr: str, n_tokens: int, repeats: int) -> dict:
    rows = []
    async with grpc.aio.insecure_channel(decode_addr) as dch, \
            grpc.aio.insecure_channel(prefill_addr) as pch:
        d = decode_pb2_grpc.DecodeWorkerStub(dch)
        p = prefill_pb2_grpc.PrefillWorkerStub(pch)
        for r in range(repeats):
            ids = _prompt(n_tokens, r)
            rid = f"ttft-{n_tokens}-{r}"
            res = await _reserve(d, ids, rid)
            stream = d.Decode(decode_pb2.DecodeRequest(reservation_id=res.reservation_id))
            t0 = time.perf_counter()
            pre = await p.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=ids,
                sampling=sampling_to_proto(SamplingParams(max_tokens=2, temperature=0)),
                decode_address=decode_addr, reservation_id=res.reservation_id,
                reserved_blocks=res.num_blocks, decode_kv_spec=res.kv_spec))
            ttft = time.perf_counter() - t0
            async for _ in stream:
                pass
            t = pre.timing
            rows.append({"ttft_s": ttft, "compute_s": t.compute_s, "transfer_s": t.transfer_s,
                         "bytes": pre.transfer_bytes,
                         "non_overlapped_share": t.transfer_s / ttft})
    med = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    return {"median": med, "runs": rows}


async def run(endpoints, lengths: list[int], repeats: int, chunk: int) -> dict:
    dec = next(w for w in endpoints.workers if w.tier == "decode").address
    pre = next(w for w in endpoints.workers if w.tier == "prefill").address
    out = {}
    for n in lengths:
        print(f"{n}-token prompts ...", file=sys.stderr)
        out[str(n)] = {"bandwidth": await bandwidth(dec, n, repeats, chunk),
                       "ttft": await ttft_split(dec, pre, n, repeats)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_transfer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    cluster = LocalCluster(model=a.model, num_prefill=1, num_decode=1, http_port=0,
                           grpc_port=0, cpus="auto",
                           engine_args=("--kv-cache-memory", "1GiB"),
                           prefill_args=("--max-chunk-bytes", str(a.max_chunk_bytes)))
    with cluster:
        eps = cluster.endpoints
        report = {"command": "python -m bench.kv_transfer " + " ".join(argv or sys.argv[1:]),
                  "results": asyncio.run(run(eps, lengths, a.repeats, a.max_chunk_bytes))}
    emit_report(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
