"""A worker the gateway's registry drops — its heartbeats stopped — takes the calls in flight
there down at once (gateway/inflight.py), so their requests fail over or migrate without
waiting out the call's deadline.

The mechanism against a real grpc.aio server on loopback whose handlers never answer: a
dropped worker's unary call and token stream end in `WorkerLost` (UNAVAILABLE naming it), a
call tracked after the drop ends at once, and a cancellation aimed at the request's own task
(the client left) stays a cancellation.

Then real processes: a `LocalCluster` (1 prefill, 2 decode workers; a 40-token prompt runs
disaggregated, a 16-token one colocated) whose gateway gives every call and every silent
stream 120 s but drops a worker 3 s after its last heartbeat. SIGSTOPped as a request is
sent: the prefill worker (its Prefill call hangs there), the decode worker the request is
routed to (its Reserve, or its colocated Generate, hangs there). SIGSTOPped once tokens are
flowing: the decode worker serving a long stream, disaggregated or colocated. Each request
completes, equal to the greedy reference, under a client deadline of 40 s, which only the
drop can meet. SIGCONT: the worker registers again and every pool is clean.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
from conftest import tiny_engine
from prometheus_client.parser import text_string_to_metric_families
from test_chaos import _running

from pdserve.bench.chaos import held_blocks
from pdserve.client import PdserveClient
from pdserve.cluster import LocalCluster, WorkerEndpoint
from pdserve.gateway.errors import ErrorKind
from pdserve.gateway.inflight import InFlight, WorkerLost, ended_by_drop
from pdserve.gateway.migration import MAX_MIGRATIONS
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
SHORT_PROMPT = PROMPT[:16]
DISAGG_THRESHOLD = 32  # PROMPT runs disaggregated, SHORT_PROMPT colocated
MAX_TOKENS = 12
LONG_TOKENS = 400  # still streaming when its decode worker stops


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    worker = ("--heartbeat-interval", "0.3")
    c = LocalCluster(
        model=tiny_model_dir, num_prefill=1, num_decode=2, http_port=0, grpc_port=0,
        cpus="none", disagg_threshold=DISAGG_THRESHOLD,
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


def _reference(model_dir: str, max_tokens: int, prompt: Sequence[int] = PROMPT) -> list[int]:
    engine = tiny_engine(model_dir, num_threads=1)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(engine.generate([list(prompt)], greedy)[0].token_ids)


async def _stream(address: str, max_tokens: int, on_tokens=None,
                  prompt: Sequence[int] = PROMPT) -> list[int] | str:
    """One greedy request of `prompt` under the client deadline: its tokens, or the status it
    ended with. `on_tokens(n)` after each chunk, n tokens in."""
    ids: list[int] = []
    try:
        async with PdserveClient(address) as c:
            async for ch in c.generate(token_ids=list(prompt), max_tokens=max_tokens,
                                       temperature=0, ignore_eos=True,
                                       timeout=CLIENT_TIMEOUT_S):
                ids.extend(ch.token_ids)
                if on_tokens is not None:
                    on_tokens(len(ids))
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return ids


def _sent_while_stopped(pid: int, address: str) -> list[int] | str:
    """One PROMPT request (`_stream`, MAX_TOKENS) sent while process `pid` is SIGSTOPped;
    SIGCONT once it has ended."""
    os.kill(pid, signal.SIGSTOP)
    try:
        return asyncio.run(_stream(address, MAX_TOKENS))
    finally:
        os.kill(pid, signal.SIGCONT)


def _stream_then_continue(address: str, max_tokens: int, stopped: list, on_tokens=None,
                          prompt: Sequence[int] = PROMPT) -> tuple[list[int] | str, Any, int]:
    """`_stream`, then SIGCONT every worker in `stopped` ((worker, tokens seen when it was
    stopped), filled before or during the stream); (output, the one worker stopped, tokens
    seen then)."""
    try:
        out = asyncio.run(_stream(address, max_tokens, on_tokens, prompt))
    finally:
        for victim, _ in stopped:
            os.kill(victim.pid, signal.SIGCONT)
    assert stopped, "the stream ended before 10 tokens"
    (victim, at), = stopped
    assert at < max_tokens
    return out, victim, at


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


def _gateway_metric(c: LocalCluster, name: str) -> float:
    """A sample of the gateway's exposition, summed over its labels."""
    with urllib.request.urlopen(c.endpoints.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def _routed_next(c: LocalCluster, prompt: Sequence[int]) -> WorkerEndpoint:
    """The decode worker the gateway routes the next request of `prompt` to, made certain,
    with the gateway's channel there open, as it is to any worker it has served (a channel
    still connecting to a stopped worker fails on its own, at gRPC's connect timeout).
    Certain: once no pool holds anything and the gateway's own view of the decode tier (its
    KV usage gauge, from heartbeats) is empty too, with nothing in flight, every decode
    worker costs the same and the tie goes to the lowest worker id (router.rank_decode)."""
    def settled() -> None:
        _back_and_clean(c)
        end = time.monotonic() + 30
        while (usage := _gateway_metric(c, "pdserve:kv_cache_usage_perc")) != 0:
            assert time.monotonic() < end, f"the gateway still sees KV in use: {usage}"
            time.sleep(0.1)

    settled()
    out = asyncio.run(_stream(c.endpoints.grpc_address, 1, prompt=prompt))  # opens it
    assert isinstance(out, list), out
    settled()
    return min((w for w in c.endpoints.workers if w.tier == "decode"), key=lambda w: w.name)


def _stop_the_serving_one(c: LocalCluster, stopped: list) -> Callable[[int], None]:
    """An `on_tokens` for `_stream`: SIGSTOPs the decode worker running the stream once 10
    tokens are in, noting (worker, tokens in) in `stopped`."""
    decodes = [w for w in c.endpoints.workers if w.tier == "decode"]

    def stop(n: int) -> None:
        if not stopped and n >= 10:
            victim = max(decodes, key=lambda w: _running(c, w))
            assert _running(c, victim) == 1
            os.kill(victim.pid, signal.SIGSTOP)
            stopped.append((victim, n))

    return stop


def test_prefill_worker_dropped_mid_prefill_fails_over_at_once(cluster, tiny_model_dir):
    want = _reference(tiny_model_dir, MAX_TOKENS)
    address = cluster.endpoints.grpc_address
    assert asyncio.run(_stream(address, MAX_TOKENS)) == want  # fault-free, channels warm
    log = _log_from(cluster)
    prefill = next(w for w in cluster.endpoints.workers if w.tier == "prefill")
    # the gateway still routes to it for up to the heartbeat timeout, so the request's
    # Prefill call goes there and hangs
    assert _sent_while_stopped(prefill.pid, address) == want
    text = log()
    assert f"prefill worker {prefill.address} dropped: missed heartbeats" in text, text
    assert "; failing over" in text and "no prefill worker left" in text, text
    _back_and_clean(cluster)


def test_decode_worker_dropped_mid_stream_migrates_at_once(cluster, tiny_model_dir):
    want = _reference(tiny_model_dir, LONG_TOKENS)
    address = cluster.endpoints.grpc_address
    log = _log_from(cluster)
    stopped: list = []
    out, victim, _ = _stream_then_continue(address, LONG_TOKENS, stopped,
                                           _stop_the_serving_one(cluster, stopped))
    assert out == want
    text = log()
    assert f"decode worker {victim.address} dropped: missed heartbeats" in text, text
    assert "; migrating (1 of at most" in text, text
    _back_and_clean(cluster)


def test_decode_worker_dropped_mid_reserve_passes_it_to_the_other(cluster, tiny_model_dir):
    want = _reference(tiny_model_dir, MAX_TOKENS)
    address = cluster.endpoints.grpc_address
    victim = _routed_next(cluster, PROMPT)
    other = next(w for w in cluster.endpoints.workers
                 if w.tier == "decode" and w.name != victim.name)
    log = _log_from(cluster)
    # the gateway still routes to it for up to the heartbeat timeout, so the request's
    # Reserve goes there and hangs
    assert _sent_while_stopped(victim.pid, address) == want
    text = log()
    assert (f"Reserve at decode worker {victim.address} failed: decode worker "
            f"{victim.address} dropped: missed heartbeats") in text, text
    assert f"; trying decode worker {other.address}" in text, text
    assert "; migrating" not in text, text  # refused before any work: passed over, not moved
    _back_and_clean(cluster)


@pytest.mark.parametrize("when", ["before_sending", "mid_stream"])
def test_decode_worker_dropped_under_a_colocated_generate_migrates_at_once(
        cluster, tiny_model_dir, when):
    max_tokens = MAX_TOKENS if when == "before_sending" else LONG_TOKENS
    want = _reference(tiny_model_dir, max_tokens, SHORT_PROMPT)
    address = cluster.endpoints.grpc_address
    stopped: list = []
    on_tokens = None
    if when == "before_sending":
        victim = _routed_next(cluster, SHORT_PROMPT)
    else:
        on_tokens = _stop_the_serving_one(cluster, stopped)
    transfers = _gateway_metric(cluster, "pdserve:kv_transfer_bytes_count")
    log = _log_from(cluster)
    if when == "before_sending":
        # the gateway still routes to it, so the request's Generate goes there and hangs
        os.kill(victim.pid, signal.SIGSTOP)
        stopped.append((victim, 0))
    out, victim, at = _stream_then_continue(address, max_tokens, stopped, on_tokens,
                                            SHORT_PROMPT)
    assert out == want
    # colocated: no prefill worker's KV reached a decode worker for it
    assert _gateway_metric(cluster, "pdserve:kv_transfer_bytes_count") == transfers
    text = log()
    assert f"decode worker {victim.address} dropped: missed heartbeats" in text, text
    moved = f"; migrating (1 of at most {MAX_MIGRATIONS})"
    assert (moved + " with 0 tokens streamed" if at == 0 else moved) in text, text
    _back_and_clean(cluster)
