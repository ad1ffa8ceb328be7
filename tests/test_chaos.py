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
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.bench.chaos import (
    Supervisor,
    held_blocks,
    inject,
    make_load,
    run_load,
    start_cluster,
)

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
    faulter = threading.Thread(target=lambda: (
        time.sleep(FAULT_AT_S), inject(cluster, fault, STOP_S, busy_within_s=2.0)), daemon=True)
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
    if not fault.startswith("restart"):  # the fault hit requests in hand, which moved
        assert _moves(cluster) > moves, "no request failed over or migrated"
    cluster.wait_healthy(timeout=300)
    held = held_blocks(cluster)
    assert not any(held.values()), f"blocks held after the load: {held}"
    return outs


def test_prefill_worker_killed(chaos):
    _under(chaos, "kill-prefill")


def test_decode_worker_killed(chaos):
    _under(chaos, "kill-decode")


def test_prefill_worker_stopped_then_continued(chaos):
    _under(chaos, "stop-prefill")


def test_decode_worker_stopped_then_continued(chaos):
    _under(chaos, "stop-decode")


def test_gateway_restarted(chaos):
    outs = _under(chaos, "restart-gateway", retry_s=120)
    saw = [o for o in outs if o.failures]
    assert saw, "no request saw the gateway go (the fault missed the load)"
    assert {s for o in saw for s in o.failures} == {"UNAVAILABLE"}
