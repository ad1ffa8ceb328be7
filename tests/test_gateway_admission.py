"""Admission before work, against a real gateway and real workers on 127.0.0.1: every bad
value refused with 400 / INVALID_ARGUMENT naming its field (HTTP and gRPC), an oversized
body refused before it is read while /health keeps answering, a flood of streams answered
200 or 429 and nothing else, and the gateway process itself never loading torch."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
from test_gateway_support import Cluster

from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

MAX_QUEUE = 8


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    # workers share this process's loop with the gateway: a flood of requests must not
    # make their heartbeats look missed (liveness is not what these tests are about)
    c = Cluster(tiny_model_dir, disagg_threshold=8, max_queue=MAX_QUEUE, max_inflight=4,
                heartbeat_timeout_s=15.0)
    c.add_worker("prefill")
    c.add_worker("decode")
    yield c
    c.close()


async def _post(url: str, body: bytes) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(
            url, data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


def _completion(**fields) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 4, **fields}).encode()


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (_completion(top_k=2**32), "top_k"),
    (_completion(top_k=-3), "top_k"),
    (_completion(top_p=0), "top_p"),
    (_completion(top_p=1.5), "top_p"),
    (_completion(min_p=3), "min_p"),
    (_completion(timeout=1e10), "timeout"),
    (_completion(timeout=-1), "timeout"),
    (_completion(max_tokens=0), "max_tokens"),
    (_completion(max_tokens=1024), "max_tokens"),  # the tiny model's whole context
    (_completion(max_tokens=2**40), "max_tokens"),
    (_completion(logprobs=50), "logprobs"),
    (_completion(seed=-1), "seed"),
    (_completion(priority=2**40), "priority"),
    (_completion(stop_token_ids=[10**9]), "stop_token_ids"),
    (b'{"prompt": "hi \\ud800"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    (b'{"prompt": "\xc3\x28"}', "body"),
])
def test_bad_http_values_are_400_naming_the_field(cluster, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    code, err = asyncio.run(_post(cluster.gateway.http_url + path, body))
    assert code == 400, err
    assert err["error"]["param"] == param and param in err["error"]["message"]
    cluster.assert_no_leaks()


@pytest.mark.parametrize("sampling,extra,field", [
    ({"temperature": math.nan}, {}, "temperature"),
    ({"temperature": math.inf}, {}, "temperature"),
    ({"top_k": 2**31}, {}, "top_k"),
    ({"top_p": 0.0}, {}, "top_p"),
    ({"max_tokens": 2**31}, {}, "max_tokens"),
    ({"max_tokens": 5000}, {}, "max_tokens"),
    ({"repetition_penalty": -1.0}, {}, "repetition_penalty"),
    ({}, {"timeout_s": 1e10}, "timeout"),
    ({}, {"timeout_s": math.nan}, "timeout"),
])
def test_bad_grpc_values_are_invalid_argument_naming_the_field(cluster, sampling, extra,
                                                               field):
    async def main():
        async with grpc.aio.insecure_channel(cluster.gateway.grpc_address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            req = gateway_pb2.GenerateRequest(
                text="hi", sampling=common_pb2.SamplingParams(**sampling), **extra)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [r async for r in stub.Generate(req, timeout=30)]
            return e.value
    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"{field}: "), err.details()
    cluster.assert_no_leaks()


def test_huge_body_refused_unread_while_health_answers(cluster):
    host, port = "127.0.0.1", cluster.gateway.http_port
    size = 60 * 2**20

    async def send_huge(chunked: bool) -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        length = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % size
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n" + length + b"\r\n\r\n")
        piece = b'{"prompt": "' + b"x" * (2**20 - 12)

        async def pump() -> None:
            for _ in range(60):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await writer.drain()
        pumping = asyncio.create_task(pump())
        status = await asyncio.wait_for(reader.readline(), 60)
        pumping.cancel()
        await asyncio.gather(pumping, return_exceptions=True)
        writer.close()
        return status

    async def health() -> int:
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(
                f"http://{host}:{port}/health", timeout=aiohttp.ClientTimeout(10)) as r:
            return r.status

    async def main():
        huge = [asyncio.create_task(send_huge(c)) for c in (False, True)]
        await asyncio.sleep(0.05)
        answered = await health()
        return answered, await asyncio.gather(*huge)

    answered, statuses = asyncio.run(main())
    assert answered == 200
    assert all(s.startswith(b"HTTP/1.1 413") for s in statuses), statuses


def test_a_thousand_streams_get_200_or_429(cluster):
    import aiohttp

    async def one(s: aiohttp.ClientSession, i: int) -> tuple[int, bytes]:
        body = {"prompt": f"hello {i}", "max_tokens": 2, "stream": True, "priority": i}
        async with s.post(cluster.gateway.http_url + "/v1/completions", json=body) as r:
            return r.status, await r.read()

    async def main():
        conn = aiohttp.TCPConnector(limit=1000)
        async with aiohttp.ClientSession(connector=conn) as s:
            return await asyncio.gather(*(one(s, i) for i in range(1000)))

    results = asyncio.run(main())
    statuses = [code for code, _ in results]
    counts = {code: statuses.count(code) for code in set(statuses)}
    assert set(counts) <= {200, 429}, (counts, [b for c, b in results if c not in (200, 429)])
    assert counts.get(200, 0) >= 4 and counts.get(429, 0) > 0, counts
    assert cluster.gateway.admission.stats().queued == 0
    cluster.assert_no_leaks()


def test_gateway_process_never_loads_torch(tiny_model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.gateway", "--model", tiny_model_dir,
         "--http-port", "0", "--grpc-port", "0"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"gateway ready: grpc=\S+ http=(\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None, "the gateway did not start"
        try:  # up, but nothing to route to: not ready
            urllib.request.urlopen(url + "/health", timeout=10)
            raise AssertionError("/health said ready with no worker registered")
        except urllib.error.HTTPError as e:
            assert e.code == 503
        body = json.dumps({"prompt": "hello there", "max_tokens": 3}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:  # tokenized, validated, then refused for want of workers
            urllib.request.urlopen(req, timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 503
        with open(f"/proc/{proc.pid}/maps") as f:
            maps = f.read()
        with open(f"/proc/{proc.pid}/status") as f:
            rss = re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)
        print(f"gateway VmRSS {int(rss) // 1024} MiB")
        assert "libtorch" not in maps, "the gateway process loaded torch"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_reader_that_stops_reading_is_dropped_and_its_worker_told(cluster):
    from pdserve.gateway.errors import ErrorKind, GatewayError

    gw = cluster.gateway
    orch = gw.orchestrator
    req = gw.prompts.request(None, list(range(100, 140)),
                             {"max_tokens": 900, "ignore_eos": True, "temperature": 0})

    async def main():
        orch.max_pending_deltas, orch.reader_timeout_s = 2, 0.5
        try:
            deltas = orch.generate(req)
            first = await anext(deltas)
            await asyncio.sleep(1.5)  # read nothing: the outbox fills, then times out
            rest, error = [], None
            try:
                async for d in deltas:
                    rest.append(d)
            except GatewayError as e:
                error = e
            return first, rest, error
        finally:
            orch.max_pending_deltas, orch.reader_timeout_s = 64, 30.0

    first, rest, error = cluster.lt.run(main())
    assert not first.finished
    assert len(rest) <= 2, "more deltas waited unread than the outbox holds"
    assert error is not None and error.kind is ErrorKind.CANCELLED
    cluster.assert_no_leaks()


def test_malformed_grpc_bytes_are_invalid_argument(cluster):
    field = gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number
    lone_surrogate = b"\xed\xa0\x80"  # UTF-8's encoding of U+D800, which UTF-8 forbids

    async def main():
        async with grpc.aio.insecure_channel(cluster.gateway.grpc_address) as ch:
            generate = ch.unary_stream("/pdserve.v1.Gateway/Generate",
                                       request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            raw = bytes([(field << 3) | 2, len(lone_surrogate)]) + lone_surrogate
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [r async for r in generate(raw, timeout=30)]
            return e.value
    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "UTF-8" in err.details()
