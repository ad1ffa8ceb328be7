"""The test client inside a namespace: `ip netns exec NS python tests/netns_probe.py` reads
one JSON command per line on stdin and answers one JSON line on stdout, until stdin closes.
It exists because a test process cannot reach the namespaces' addresses from the root
namespace, and one long-lived probe costs one interpreter start instead of one per call.

Commands ({"op": ..., ...}) and answers ({"ok": ...} or {"error": "..."}):
  ready     gateway, prefill, decode, timeout -> true once the gateway's ListModels counts
            that many workers of each tier (retries while the gateway is not up yet)
  generate  gateway, prompts (token id lists), max_tokens -> per prompt, the greedy token
            ids, or the gRPC status name it ended with
  generate_cut  gateway, prompt, max_tokens, after_tokens, cuts ([stats address, argv] per
            decode worker) -> {"result": token ids or status name, "cut": [indices],
            "seconds": wall time}: streams one greedy request and, once `after_tokens`
            tokens arrived, runs the argv of every decode worker that holds KV blocks
            then (the one serving the request); all of them when `cut_all`
  generate_cut_kv  gateway, prompt, max_tokens, metrics (decode workers' /metrics URLs),
            argv, receiver -> {"result": token ids or status name, "cut": the index of the
            decode worker whose counter moved, "base", "at_cut", "after_cut", "at_end": KV
            bytes each decode worker had received before the request, when the cut was
            triggered, once its argv had run, and when the request ended}: streams one
            greedy request and runs `argv` as soon as a decode worker has received some of
            its KV (`pdserve:kv_received_bytes_total` went up). With `receiver`, `argv` holds
            one argv per decode worker and only the receiving one's runs (its link, say):
            that worker's counter is not read again (null)
  kv_received  urls (decode workers' /metrics) -> the KV bytes they received, together
  stats     address, role ("prefill" | "decode") -> [free_blocks, total_blocks, running,
            waiting] (a decode worker counts its open reservations as waiting)
  http      url -> the body of a GET
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import urllib.request

import grpc

from pdserve.client import PdserveClient
from pdserve.cluster_auth import TOKEN_METADATA
from pdserve.protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc


async def ready(gateway: str, prefill: int, decode: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    last = "no answer"
    async with PdserveClient(gateway) as c:
        while time.monotonic() < end:
            try:
                models = await c.list_models()
                got = [(m.num_prefill_workers, m.num_decode_workers) for m in models]
                if any(p >= prefill and d >= decode for p, d in got):
                    return True
                last = f"workers (prefill, decode) = {got}"
            except grpc.aio.AioRpcError as e:
                last = e.code().name
            await asyncio.sleep(0.2)
    raise TimeoutError(f"gateway {gateway} not ready in {timeout}s: {last}")


async def _one(c: PdserveClient, ids: list[int], max_tokens: int) -> list[int] | str:
    out: list[int] = []
    try:
        async for chunk in c.generate(token_ids=ids, max_tokens=max_tokens, temperature=0,
                                      ignore_eos=True, timeout=30):
            out.extend(chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return out


async def generate(gateway: str, prompts: list[list[int]], max_tokens: int) -> list:
    async with PdserveClient(gateway) as c:
        return list(await asyncio.gather(*(_one(c, p, max_tokens) for p in prompts)))


async def generate_cut(gateway: str, prompt: list[int], max_tokens: int, after_tokens: int,
                       cuts: list[list], cut_all: bool = False) -> dict:
    t0 = time.monotonic()
    out: list[int] = []
    cut: list[int] = []
    result: list[int] | str = out
    async with PdserveClient(gateway) as c:
        try:
            async for chunk in c.generate(token_ids=prompt, max_tokens=max_tokens,
                                          temperature=0, ignore_eos=True, timeout=30):
                out.extend(chunk.token_ids)
                if not cut and len(out) >= after_tokens:
                    for i, (addr, _) in enumerate(cuts):
                        free, total, *_ = await stats(addr, "decode")
                        if cut_all or free < total:
                            cut.append(i)
                    assert cut, "no decode worker holds the request's blocks"
                    for i in cut:
                        p = await asyncio.create_subprocess_exec(*cuts[i][1])
                        assert await p.wait() == 0, f"{cuts[i][1]} failed"
        except grpc.aio.AioRpcError as e:
            result = e.code().name
    return {"result": result, "cut": cut, "seconds": time.monotonic() - t0}


async def _received(urls: list[str], skip: int | None = None) -> list[float | None]:
    """Each URL's pdserve:kv_received_bytes_total; None for the one at index `skip`."""
    out: list[float | None] = []
    for i, url in enumerate(urls):
        if i == skip:
            out.append(None)
            continue
        m = re.search(r"^pdserve:kv_received_bytes_total\{[^}]*\} (\S+)$", await http(url),
                      re.M)
        if m is None:
            raise ValueError(f"{url} exports no pdserve:kv_received_bytes_total")
        out.append(float(m.group(1)))
    return out


async def kv_received(urls: list[str]) -> float:
    return sum(await _received(urls))


async def generate_cut_kv(gateway: str, prompt: list[int], max_tokens: int,
                          metrics: list[str], argv: list, receiver: bool = False) -> dict:
    base = await _received(metrics)
    marks: dict = {"base": base}
    skip = None
    async with PdserveClient(gateway) as c:
        request = asyncio.create_task(_one(c, prompt, max_tokens))
        while not request.done():
            marks["at_cut"] = await _received(metrics)
            moved = [i for i, (a, b) in enumerate(zip(marks["at_cut"], base)) if a > b]
            if moved:
                marks["cut"] = moved[0]
                if receiver:
                    argv, skip = argv[moved[0]], moved[0]
                p = await asyncio.create_subprocess_exec(*argv)
                assert await p.wait() == 0, f"{argv} failed"
                marks["after_cut"] = await _received(metrics, skip)
                break
            await asyncio.sleep(0.01)
        assert "after_cut" in marks, "the request ended before any of its KV arrived"
        marks["result"] = await request
    marks["at_end"] = await _received(metrics, skip)
    return marks


async def stats(address: str, role: str) -> list[int]:
    token = os.environ["PDSERVE_CLUSTER_TOKEN"]
    async with grpc.aio.insecure_channel(address) as ch:
        stub = (decode_pb2_grpc.DecodeWorkerStub(ch) if role == "decode"
                else prefill_pb2_grpc.PrefillWorkerStub(ch))
        s = await stub.Stats(common_pb2.StatsRequest(), timeout=5,
                             metadata=((TOKEN_METADATA, token),))
        return [s.load.free_blocks, s.load.total_blocks, s.load.num_running,
                s.load.num_waiting]


async def http(url: str) -> str:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    return await asyncio.to_thread(get)


OPS = {"ready": ready, "generate": generate, "generate_cut": generate_cut,
       "generate_cut_kv": generate_cut_kv, "kv_received": kv_received, "stats": stats,
       "http": http}


def main() -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        op = OPS[cmd.pop("op")]
        try:
            answer = {"ok": asyncio.run(op(**cmd))}
        except Exception as e:  # the test reads it and fails with the message
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
