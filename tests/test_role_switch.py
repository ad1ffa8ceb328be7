"""Role switch end to end: real gateway and RoleWorkers (tiny random-weight model) on
127.0.0.1. A decode worker told to serve prefill (by SwitchRole, then by the planner)
drains while requests keep succeeding, registers again as prefill, serves prefill traffic,
and every pool is clean after."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from conftest import tiny_engine
from test_gateway_support import Cluster

from pdserve import rpc
from pdserve.client import PdserveClient
from pdserve.cluster_auth import ClusterCredentials
from pdserve.gateway.planner import PlannerConfig, PlannerMode
from pdserve.gateway.registry import Role
from pdserve.protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from pdserve.role_worker import RoleWorker
from pdserve.worker_runtime import WorkerConfig

PROMPT = "Once upon a time, in a land of rivers and hills, a curious child asked"


def _add(c: Cluster, role: str) -> RoleWorker:
    engine = tiny_engine(c.model_dir, num_threads=1)
    cfg = WorkerConfig(engine=engine.config, heartbeat_interval_s=0.3, drain_timeout_s=20,
                       reservation_timeout_s=5, gateways=(c.gateway.registry_address,))
    w = RoleWorker(cfg, role, engine=engine)
    c.lt.run(w.start())
    c.wait_for(lambda: _role_of(c, w) is Role(role))
    c.workers.append(w)
    return w


def _role_of(c: Cluster, w: RoleWorker) -> Role | None:
    entry = c.gateway.registry.get(w.worker_id)
    return None if entry is None else entry.role


async def _one(address: str, max_tokens: int) -> str:
    async with PdserveClient(address) as client:
        try:
            chunks = [x async for x in client.generate(PROMPT, max_tokens=max_tokens,
                                                        temperature=0, ignore_eos=True)]
            assert chunks[-1].completion_tokens == max_tokens
            return "ok"
        except grpc.aio.AioRpcError as e:
            return e.code().name


async def _many(address: str, n: int) -> list[str]:
    return list(await asyncio.gather(*(_one(address, 8) for _ in range(n))))


async def _load(address: str, stop: asyncio.Event, results: list[str]) -> None:
    """Requests back to back from 4 clients until `stop` (each finishes what it began)."""
    async def client() -> None:
        n = 0
        while not stop.is_set():
            results.append(await _one(address, 12 + 4 * (n % 3)))
            n += 1
    await asyncio.gather(*(client() for _ in range(4)))


async def _switch(address: str, role: int) -> gateway_pb2.SwitchRoleResponse:
    async with rpc.aio_channel(address, ClusterCredentials()) as ch:
        return await gateway_pb2_grpc.WorkerControlStub(ch).SwitchRole(
            gateway_pb2.SwitchRoleRequest(role=role), timeout=5)


async def _reserve(address: str) -> grpc.StatusCode:
    """A Reserve straight to a worker (cancelled at once when it succeeds)."""
    async with rpc.aio_channel(address, ClusterCredentials()) as ch:
        stub = decode_pb2_grpc.DecodeWorkerStub(ch)
        try:
            r = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id="direct", prompt_token_ids=[1, 2, 3]), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
        await stub.Cancel(decode_pb2.CancelRequest(reservation_id=r.reservation_id), timeout=5)
    return grpc.StatusCode.OK


def test_switch_decode_to_prefill_under_load_loses_nothing(tiny_model_dir):
    c = Cluster(tiny_model_dir, heartbeat_timeout_s=10)
    try:
        p = _add(c, "prefill")
        d1, d2 = _add(c, "decode"), _add(c, "decode")
        stop, results = asyncio.Event(), []
        load = asyncio.run_coroutine_threadsafe(
            _load(c.gateway.grpc_address, stop, results), c.lt.loop)
        c.wait_for(lambda: len(results) >= 4, timeout=60)
        c.wait_for(lambda: d1.aengine.stats().running > 0, timeout=30)  # mid-stream

        resp = c.lt.run(_switch(d1.address, gateway_pb2.WORKER_ROLE_PREFILL))
        assert resp.started and resp.role == gateway_pb2.WORKER_ROLE_PREFILL
        assert d1.switching_to == "prefill"
        # while it drains: out of the decode tier, new decode work refused (retryable)
        c.wait_for(lambda: _role_of(c, d1) is None, timeout=5)
        # asked again: already on its way
        assert not c.lt.run(_switch(d1.address, gateway_pb2.WORKER_ROLE_PREFILL)).started
        with pytest.raises(grpc.aio.AioRpcError) as e:
            c.lt.run(_switch(d1.address, gateway_pb2.WORKER_ROLE_DECODE))
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION

        c.wait_for(lambda: _role_of(c, d1) is Role.PREFILL, timeout=30)
        assert d1.role == "prefill" and d1.switching_to is None and d1.num_switches == 1
        assert c.lt.run(_reserve(d1.address)) is grpc.StatusCode.UNAVAILABLE
        assert c.lt.run(_reserve(d2.address)) is grpc.StatusCode.OK
        # the new prefill worker gets prefill traffic
        prompt_tokens = d1.engine.counters.prompt_tokens
        n = len(results)
        c.wait_for(lambda: len(results) >= n + 12, timeout=90)
        stop.set()
        load.result(90)
        assert d1.engine.counters.prompt_tokens > prompt_tokens
        assert set(results) == {"ok"}, results
        assert {w.worker_id for w in c.gateway.registry.alive(Role.PREFILL)} == \
            {p.worker_id, d1.worker_id}
        assert [w.worker_id for w in c.gateway.registry.alive(Role.DECODE)] == [d2.worker_id]
        c.assert_no_leaks(timeout=15)
    finally:
        c.close()


def test_planner_moves_one_decode_worker_to_prefill(tiny_model_dir):
    # TTFT over an SLO no request can meet is prefill pressure; decode has no pressure
    planner = PlannerConfig(mode=PlannerMode.SLO, ttft_slo_s=1e-6, tpot_slo_s=1e3,
                            sustain_s=0.5, dwell_s=0.0, interval_s=0.2, window_s=60)
    # a generous heartbeat timeout: a loaded machine must not drop a live worker mid-test
    c = Cluster(tiny_model_dir, planner=planner, heartbeat_timeout_s=10)
    try:
        _add(c, "prefill")
        d1, d2 = _add(c, "decode"), _add(c, "decode")
        results = c.lt.run(_many(c.gateway.grpc_address, 6), timeout=120)
        assert results == ["ok"] * 6
        c.wait_for(lambda: len(c.gateway.registry.alive(Role.PREFILL)) == 2, timeout=30)
        moved = d1 if d1.role == "prefill" else d2
        assert moved.num_switches == 1
        # never the last decode worker: the pressure stays, nothing more moves
        results = c.lt.run(_many(c.gateway.grpc_address, 4), timeout=120)
        assert results == ["ok"] * 4
        assert d1.num_switches + d2.num_switches == 1
        assert len(c.gateway.registry.alive(Role.DECODE)) == 1
        def metrics() -> str:
            with urllib.request.urlopen(c.gateway.http_url + "/metrics", timeout=5) as r:
                return r.read().decode()

        # the gauges follow the registry at the planner's next tick (0.2 s)
        c.wait_for(lambda: _sample(metrics(), "pdserve:planner_actual_workers",
                                   'role="prefill"') == 2)
        text = metrics()
        assert _sample(text, "pdserve:planner_role_switches_total", 'to_role="prefill"') == 1
        assert _sample(text, "pdserve:planner_role_switches_total", 'to_role="decode"') == 0
        assert _sample(text, "pdserve:planner_actual_workers", 'role="prefill"') == 2
        assert _sample(text, "pdserve:planner_actual_workers", 'role="decode"') == 1
        # it still wants another prefill worker, and never an empty decode tier
        assert _sample(text, "pdserve:planner_desired_workers", 'role="prefill"') == 3
        assert _sample(text, "pdserve:planner_desired_workers", 'role="decode"') == 1
        c.assert_no_leaks(timeout=15)
    finally:
        c.close()


def _sample(text: str, name: str, label: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{label}}} not in /metrics")


def test_switch_role_needs_the_cluster_token_and_a_known_role(tiny_model_dir):
    creds = ClusterCredentials(token="role-switch-test-token")
    c = Cluster(tiny_model_dir, credentials=creds)
    try:
        engine = tiny_engine(tiny_model_dir, num_threads=1)
        w = RoleWorker(WorkerConfig(engine=engine.config, credentials=creds), "decode",
                       engine=engine)
        c.lt.run(w.start())
        c.workers.append(w)

        async def calls() -> list:
            out = []
            async with grpc.aio.insecure_channel(w.address) as ch:
                try:
                    await gateway_pb2_grpc.WorkerControlStub(ch).SwitchRole(
                        gateway_pb2.SwitchRoleRequest(role=gateway_pb2.WORKER_ROLE_PREFILL),
                        timeout=5)
                except grpc.aio.AioRpcError as e:
                    out.append(e.code())
            async with rpc.aio_channel(w.address, creds) as ch:
                stub = gateway_pb2_grpc.WorkerControlStub(ch)
                try:
                    await stub.SwitchRole(gateway_pb2.SwitchRoleRequest(), timeout=5)
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details()))
                r = await stub.SwitchRole(
                    gateway_pb2.SwitchRoleRequest(role=gateway_pb2.WORKER_ROLE_DECODE), timeout=5)
                out.append(r.started)
            return out

        assert c.lt.run(calls()) == [
            grpc.StatusCode.UNAUTHENTICATED,
            (grpc.StatusCode.INVALID_ARGUMENT, "role: must be PREFILL or DECODE"),
            False]  # already serving decode
        assert w.role == "decode" and w.switching_to is None
    finally:
        c.close()
