"""A worker the gateway's registry drops — its heartbeats stopped — takes the calls in flight
there down at once (gateway/inflight.py), so their requests fail over or migrate without
waiting out the call's deadline.

The mechanism against a real grpc.aio server on loopback whose handlers never answer: a
dropped worker's unary call and token stream end in `WorkerLost` (UNAVAILABLE naming it), a
call tracked after the drop ends at once, and a cancellation aimed at the request's own task
(the client left) stays a cancellation.

Then real processes: a `LocalCluster` (1 prefill, 2 decode workers, every prompt
disaggregated) whose gateway gives every call and every silent stream 120 s but drops a
worker 3 s after its last heartbeat. The prefill worker SIGSTOPped as a request is sent (its
Prefill call then hangs there), and the decode worker serving a long stream SIGSTOPped once
tokens are flowing: each request completes, equal to the greedy reference, under a client
deadline of 40 s, which only the drop can meet. SIGCONT: the worker registers again and
every pool is clean.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import grpc
import pytest
from conftest import tiny_engine
from test_chaos import _running

from pdserve.bench.chaos import held_blocks
from pdserve.client import PdserveClient
from pdserve.cluster import LocalCluster
from pdserve.gateway.errors import ErrorKind
from pdserve.gateway.inflight import InFlight, WorkerLost, ended_by_drop
from pdserve.gateway.registry import Load, Role, Worker
from pdserve.protocol import SamplingParams
from pdserve.protos.pdserve.v1 import decode_pb2, decode_pb2_grpc

# -- the mechanism --------------------------------------------------------------------------


class _Silent(decode_pb2_grpc.DecodeWorkerServicer):
    """Takes every Reserve and never answers; a Decode stream sends one chunk, then nothing."""

    async def Reserve(self, request, context):
        await asyncio.Event().wait()

    async def Decode(self, request, context):
        yield decode_pb2.TokenChunk(token_ids=[7])
        await asyncio.Event().wait()


def _worker(address: str) -> Worker:
    return Worker("d0", Role.DECODE, address, "m", None, Load(), 0.0)


async def _with_silent_server(body) -> None:
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(_Silent(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            async with asyncio.timeout(30):  # a hang guard: each call's own deadline is 120 s
                await body(_worker(address), decode_pb2_grpc.DecodeWorkerStub(ch))
    finally:
        await server.stop(0)


def test_a_dropped_workers_unary_call_and_stream_end_in_worker_lost():
    async def body(w: Worker, stub) -> None:
        calls = InFlight()
        unary, stream = calls.open(w), calls.open(w)
        assert dict(calls) == {"d0": 2}
        reserve = unary.track(stub.Reserve(decode_pb2.ReserveRequest(), timeout=120))
        decode = stream.track(stub.Decode(decode_pb2.DecodeRequest(), timeout=120))
        assert list((await decode.read()).token_ids) == [7]  # the stream is open

        async def read_next():
            with ended_by_drop(stream):
                return await decode.read()

        async def reserved():
            with ended_by_drop(unary):
                return await reserve

        waiting = [asyncio.create_task(reserved()), asyncio.create_task(read_next())]
        await asyncio.sleep(0.2)  # both are waiting on the worker
        assert not any(t.done() for t in waiting)
        assert calls.drop("d0", "missed heartbeats") == 2
        for t in waiting:
            with pytest.raises(WorkerLost) as e:
                await t
            assert e.value.kind is ErrorKind.UNAVAILABLE and e.value.worker_id == "d0"
            assert e.value.message == f"decode worker {w.address} dropped: missed heartbeats"
        # a call tracked after the drop ends at once
        late = unary.track(stub.Reserve(decode_pb2.ReserveRequest(), timeout=120))
        with pytest.raises(WorkerLost), ended_by_drop(unary):
            await late
        calls.close(unary)
        calls.close(stream)
        assert dict(calls) == {} and calls.get("d0", 0) == 0

    asyncio.run(_with_silent_server(body))


def test_the_requests_own_cancellation_stays_a_cancellation():
    """The client left (its task is cancelled) while the worker was also dropped: the request
    ends cancelled, not as a worker failure to migrate."""
    async def body(w: Worker, stub) -> None:
        calls = InFlight()
        slot = calls.open(w)
        entered = asyncio.Event()

        async def request():
            call = slot.track(stub.Reserve(decode_pb2.ReserveRequest(), timeout=120))
            with ended_by_drop(slot):
                entered.set()
                return await call

        alone, both = asyncio.create_task(request()), asyncio.create_task(request())
        await entered.wait()
        await asyncio.sleep(0.2)
        alone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await alone
        both.cancel()
        calls.drop("d0", "missed heartbeats")
        with pytest.raises(asyncio.CancelledError):
            await both

    asyncio.run(_with_silent_server(body))


# -- real processes -------------------------------------------------------------------------

HEARTBEAT_TIMEOUT_S = 3.0
CLIENT_TIMEOUT_S = 40.0  # far below the gateway's 120 s bounds: only a drop meets it
PROMPT = [(37 * j + 11) % 3000 + 60 for j in range(40)]
MAX_TOKENS = 12
LONG_TOKENS = 400  # still streaming when its decode worker stops


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    worker = ("--heartbeat-interval", "0.3")
    c = LocalCluster(
        model=tiny_model_dir, num_prefill=1, num_decode=2, http_port=0, grpc_port=0,
        cpus="none", disagg_threshold=0,
        engine_args=("--kv-cache-memory", "8MiB", "--threads", "1"),
        gateway_args=("--rpc-timeout", "120", "--stream-idle-timeout", "120",
                      "--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT_S:g}"),
        prefill_args=worker, decode_args=(*worker, "--stream-keepalive", "0.5"))
    c.start()
    try:
        c.wait_healthy(timeout=300)
        yield c
    finally:
        c.stop()


def _reference(model_dir: str, max_tokens: int) -> list[int]:
    engine = tiny_engine(model_dir, num_threads=1)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(engine.generate([PROMPT], greedy)[0].token_ids)


async def _stream(address: str, max_tokens: int, on_tokens=None) -> list[int] | str:
    """One greedy request of PROMPT under the client deadline: its tokens, or the status it
    ended with. `on_tokens(n)` after each chunk, n tokens in."""
    ids: list[int] = []
    try:
        async with PdserveClient(address) as c:
            async for ch in c.generate(token_ids=PROMPT, max_tokens=max_tokens, temperature=0,
                                       ignore_eos=True, timeout=CLIENT_TIMEOUT_S):
                ids.extend(ch.token_ids)
                if on_tokens is not None:
                    on_tokens(len(ids))
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return ids


def _log_from(c: LocalCluster) -> Callable[[], str]:
    path = c.log_path("gateway")
    start = len(path.read_bytes())
    return lambda: path.read_bytes()[start:].decode(errors="replace")


def _back_and_clean(c: LocalCluster) -> None:
    """The stopped worker registered again (the gateway lists every worker) and no pool
    holds a block, a running sequence or a reservation."""
    c.wait_healthy(timeout=60)
    held = held_blocks(c)
    assert not any(held.values()), f"blocks held: {held}"


def test_prefill_worker_dropped_mid_prefill_fails_over_at_once(cluster, tiny_model_dir):
    want = _reference(tiny_model_dir, MAX_TOKENS)
    address = cluster.endpoints.grpc_address
    assert asyncio.run(_stream(address, MAX_TOKENS)) == want  # fault-free, channels warm
    log = _log_from(cluster)
    prefill = next(w for w in cluster.endpoints.workers if w.tier == "prefill")
    # stopped before the request is sent: the gateway still routes to it for up to the
    # heartbeat timeout, so the request's Prefill call goes there and hangs
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        out = asyncio.run(_stream(address, MAX_TOKENS))
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert out == want
    text = log()
    assert f"prefill worker {prefill.address} dropped: missed heartbeats" in text, text
    assert "; failing over" in text and "no prefill worker left" in text, text
    _back_and_clean(cluster)


def test_decode_worker_dropped_mid_stream_migrates_at_once(cluster, tiny_model_dir):
    want = _reference(tiny_model_dir, LONG_TOKENS)
    address = cluster.endpoints.grpc_address
    log = _log_from(cluster)
    decodes = [w for w in cluster.endpoints.workers if w.tier == "decode"]
    stopped: list = []

    def stop_the_serving_one(n: int) -> None:
        if not stopped and n >= 10:
            victim = max(decodes, key=lambda w: _running(cluster, w))
            assert _running(cluster, victim) == 1
            os.kill(victim.pid, signal.SIGSTOP)
            stopped.append((victim, n))

    try:
        out = asyncio.run(_stream(address, LONG_TOKENS, stop_the_serving_one))
    finally:
        for victim, _ in stopped:
            os.kill(victim.pid, signal.SIGCONT)
    assert stopped, "the stream ended before 10 tokens"
    (victim, at), = stopped
    assert at < LONG_TOKENS
    assert out == want
    text = log()
    assert f"decode worker {victim.address} dropped: missed heartbeats" in text, text
    assert "; migrating (1 of at most" in text, text
    _back_and_clean(cluster)
