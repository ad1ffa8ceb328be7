"""The chaos suite: one real cluster (gateway, 1 prefill, 2 decode workers as processes on
loopback, cluster token set, tiny random-weight model), the same mixed 32-request greedy
load (disaggregated and colocated by prompt length) run fault-free once as the reference,
then again while a prefill worker is SIGKILLed, a decode worker is SIGKILLed, each is
SIGSTOPped longer than the gateway's deadlines then SIGCONTed, and the gateway restarts.

Each case asserts: every request completes (the gateway restart: a client that saw it go
gets UNAVAILABLE and succeeds on retry), every output equals the reference token for token,
and once the load is over every worker's pool is back to all blocks free with nothing
running or reserved (Stats, with the cluster token). A killed child is restarted by a
supervisor thread (what `pdserve up` does) before the next case.

Those loads' streams are short, so a killed decode worker's requests move before they
stream anything. `test_decode_worker_killed_mid_stream` kills one while long streams
(greedy and seeded) are being read, each ≥ 10 tokens in: the streams continue, the output
equals the fault-free run's token for token, usage is the client's, and the gateway's log
and `pdserve:request_migrations_total` show migrations with tokens already streamed.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.chaos import (
    LoadRequest,
    Supervisor,
    held_blocks,
    inject,
    make_load,
    run_load,
    start_cluster,
)
from pdserve.client import PdserveClient
from pdserve.cluster_auth import TOKEN_METADATA
from pdserve.protos.pdserve.v1 import common_pb2, decode_pb2_grpc

pytestmark = pytest.mark.slow  # a multi-process cluster for about two minutes

THRESHOLD = 32  # prompts of at least this many tokens are disaggregated
RATE = 8.0  # requests per second: the load spans ~4 s, so faults land mid-load
FAULT_AT_S = 1.0
STOP_S = 5.0  # longer than the 3 s rpc / stream idle timeouts below


@pytest.fixture(scope="module")
def chaos(tiny_model_dir):
    cluster = start_cluster(tiny_model_dir, ("--kv-cache-memory", "8MiB", "--threads", "1"),
                            THRESHOLD, timeout_s=3.0)
    sup = Supervisor(cluster)
    try:
        load = make_load(32)
        assert {len(r.token_ids) >= THRESHOLD for r in load} == {True, False}  # mixed paths
        ref = asyncio.run(run_load(cluster.endpoints.grpc_address, load, rate=RATE))
        assert [o.status for o in ref] == ["OK"] * len(load), [o.error for o in ref]
        assert all(len(o.token_ids) == r.max_tokens for o, r in zip(ref, load))
        yield cluster, load, {o.index: o.token_ids for o in ref}
    finally:
        sup.close()
        cluster.stop()


def _moves(cluster) -> int:
    """Failovers and migrations the gateway logged (its log survives its restarts)."""
    text = cluster.log_path("gateway").read_text(errors="replace")
    return text.count("failing over") + text.count("; migrating (")


def _under(chaos, fault: str, retry_s: float = 0.0) -> list:
    cluster, load, reference = chaos
    restarts, moves = cluster.restarts, _moves(cluster)
    hit: list[tuple[str, bool]] = []
    faulter = threading.Thread(target=lambda: (
        time.sleep(FAULT_AT_S),
        hit.append(inject(cluster, fault, STOP_S, busy_within_s=5.0))), daemon=True)
    faulter.start()
    outs = asyncio.run(run_load(cluster.endpoints.grpc_address, load, rate=RATE,
                                retry_s=retry_s, timeout_s=120))
    faulter.join()
    bad = [(o.index, o.status, o.error) for o in outs if o.status != "OK"]
    assert not bad, bad
    differ = [o.index for o in outs if o.token_ids != reference[o.index]]
    assert not differ, f"outputs differ from the fault-free run: {differ}"
    if fault.startswith(("kill", "restart")):
        end = time.monotonic() + 120
        while cluster.restarts == restarts:  # the supervisor brings the victim back
            assert time.monotonic() < end, "the killed child was not restarted"
            time.sleep(0.2)
    cluster.wait_healthy(timeout=300)
    held = held_blocks(cluster)
    assert not any(held.values()), f"blocks held after the load: {held}"
    if not fault.startswith("restart") and _moves(cluster) == moves:
        # Every request came back whole and as the fault-free run's, and none moved: the
        # fault found no request in hand on its victim. Either none was seen there within
        # 5 s, or the one seen finished between the poll and the signal (a clean-clone CI
        # run: seen busy, 13 moves before and after). Moving mid-stream is asserted by
        # test_decode_worker_killed_mid_stream, whose streams cannot finish first.
        victim, busy = hit[0]
        pytest.skip(f"the fault on {victim} landed between requests (seen with requests in "
                    f"hand within 5 s: {busy}); nothing to move on a loaded machine")
    return outs


def test_prefill_worker_killed(chaos):
    _under(chaos, "kill-prefill")


def test_decode_worker_killed(chaos):
    _under(chaos, "kill-decode")


def test_prefill_worker_stopped_then_continued(chaos):
    _under(chaos, "stop-prefill")


def test_decode_worker_stopped_then_continued(chaos):
    _under(chaos, "stop-decode")


# -- a decode worker killed mid-stream --------------------------------------------------------

# long enough that no stream can finish while the slowest is still reaching KILL_AFTER
# (at 200, under CI load, one stream alone on a worker finished first)
LONG_TOKENS = 600
KILL_AFTER = 10  # tokens every stream has received before the kill


def _long_streams() -> list[tuple[LoadRequest, float, int | None]]:
    """8 long streams, each (request, temperature, seed): greedy and seeded, prompts on both
    sides of the disaggregation threshold (so first attempts take both paths)."""
    base = make_load(8, seed=5, min_prompt=12, max_prompt=12)
    out = []
    for k, r in enumerate(base):
        n = THRESHOLD + 8 if k % 2 else 12
        ids = (r.token_ids * 4)[:n]
        temperature, seed = (0.0, None) if k < 4 else (0.8, 100 + k)
        out.append((LoadRequest(k, ids, LONG_TOKENS), temperature, seed))
    return out


async def _read_streams(address: str, streams, on_token=None) -> list[dict]:
    """Every stream at once, read token by token; `on_token(counts, done)` after each chunk
    (counts: tokens received per stream, done: streams finished)."""
    counts = [0] * len(streams)
    done: set[int] = set()

    async def one(k: int, req: LoadRequest, temperature: float, seed: int | None) -> dict:
        ids: list[int] = []
        last = None
        async with PdserveClient(address) as c:
            async for ch in c.generate(token_ids=req.token_ids, max_tokens=req.max_tokens,
                                       temperature=temperature, seed=seed, ignore_eos=True,
                                       timeout=120):
                ids.extend(ch.token_ids)
                counts[k] = len(ids)
                last = ch
                if ch.finish_reason:
                    done.add(k)
                if on_token is not None:
                    on_token(counts, done)
        return {"ids": tuple(ids), "finish": last.finish_reason,
                "usage": (last.prompt_tokens, last.completion_tokens)}

    return list(await asyncio.gather(*(one(k, *s) for k, s in enumerate(streams))))


def _running(cluster, w) -> int:
    with grpc.insecure_channel(w.address) as ch:
        load = decode_pb2_grpc.DecodeWorkerStub(ch).Stats(
            common_pb2.StatsRequest(), timeout=5,
            metadata=((TOKEN_METADATA, cluster.cluster_token),)).load
    return load.num_running + load.num_waiting


def _migrations(cluster, reason: str) -> float:
    with urllib.request.urlopen(cluster.endpoints.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdserve:request_migrations_total"
               and s.labels.get("reason") == reason)


def test_decode_worker_killed_mid_stream(chaos):
    cluster, _, _ = chaos
    streams = _long_streams()
    address = cluster.endpoints.grpc_address
    ref = asyncio.run(_read_streams(address, streams))
    assert [len(o["ids"]) for o in ref] == [LONG_TOKENS] * len(streams)

    log_path = cluster.log_path("gateway")
    log_from = len(log_path.read_bytes())
    before = _migrations(cluster, "decode_migration")
    restarts = cluster.restarts
    decodes = [w for w in cluster.endpoints.workers if w.tier == "decode"]
    at_kill: dict = {}

    def kill_once_all_streaming(counts: list[int], done: set[int]) -> None:
        if not at_kill and min(counts) >= KILL_AFTER:
            # the decode worker running the most of them (blocks the loop for a Stats call)
            victim = max(decodes, key=lambda w: (_running(cluster, w), w.name == "decode-0"))
            at_kill.update(counts=list(counts), done=set(done), victim=victim.name)
            os.kill(victim.pid, signal.SIGKILL)

    outs = asyncio.run(_read_streams(address, streams, kill_once_all_streaming))
    assert at_kill, "the streams ended before every one had streamed enough"
    # none had finished: whatever decode-0 served was mid-stream when it died
    assert at_kill["done"] == set(), at_kill

    for (req, _, _), out, want in zip(streams, outs, ref):
        assert out["ids"] == want["ids"], f"stream {req.index} differs from the fault-free run"
        assert out["finish"] == "length"
        assert out["usage"] == (len(req.token_ids), LONG_TOKENS)

    text = log_path.read_bytes()[log_from:].decode(errors="replace")
    moved = [int(n) for n in re.findall(r"; migrating \(\d+ of at most \d+\) with (\d+) tokens "
                                        r"streamed", text)]
    assert moved, f"no stream migrated (none ran on {at_kill['victim']}?)"
    assert all(KILL_AFTER <= n < LONG_TOKENS for n in moved), moved
    assert _migrations(cluster, "decode_migration") - before >= len(moved)

    end = time.monotonic() + 120
    while cluster.restarts == restarts:  # the supervisor brings the victim back
        assert time.monotonic() < end, "the killed decode worker was not restarted"
        time.sleep(0.2)
    cluster.wait_healthy(timeout=300)
    held = held_blocks(cluster)
    assert not any(held.values()), f"blocks held after the streams: {held}"


def test_gateway_restarted(chaos):
    outs = _under(chaos, "restart-gateway", retry_s=120)
    saw = [o for o in outs if o.failures]
    assert saw, "no request saw the gateway go (the fault missed the load)"
    assert {s for o in saw for s in o.failures} == {"UNAVAILABLE"}
