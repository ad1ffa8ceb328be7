"""Liveness and readiness with real components on loopback: a hung KV endpoint does not hold
up other requests, a full prefill queue answers RESOURCE_EXHAUSTED, an engine failure is
INTERNAL / 500 and NOT_SERVING until the engine recovers, the gateway says SERVING only once
a request can be routed, a SIGSTOPped decode worker gives a clear status (not a hang) and
serves again after SIGCONT, a SIGKILLed child of a local cluster is restarted, and a cluster
restarts at once on the ports it just released, registration calls carry the worker's
rpc timeout (a heartbeat at most its interval), and a worker still loading its model turns
tier calls away with UNAVAILABLE (retryable elsewhere), not UNIMPLEMENTED."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import tiny_engine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_cluster import _fake_cluster, fakes  # noqa: F401  (the fixture)
from test_gateway_support import Cluster

from pdserve import cluster as cluster_mod
from pdserve.cluster import ClusterError, LocalCluster, port_is_free
from pdserve.cluster_auth import TOKEN_METADATA
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protos.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.worker_runtime import GrpcService, WorkerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING


def _post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _completion(model: str, max_tokens: int = 4, **kw) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **kw}


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return -1


class _HungKV(kvtransfer_pb2_grpc.KVTransferServicer):
    """A KVTransfer service that takes every push and never answers (a wedged receiver)."""

    async def Push(self, request_iterator, context):
        await asyncio.Event().wait()


async def _hung_kv_server() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(_HungKV(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _add_worker(c: Cluster, cls, engine, **config) -> object:
    w = cls(WorkerConfig(engine=engine.config, heartbeat_interval_s=0.3,
                         gateways=(c.gateway.registry_address,), **config), engine=engine)
    c.lt.run(w.start())
    c.workers.append(w)
    c.wait_for(lambda: any(x.address == w.address for x in c.gateway.registry.all()))
    return w


# ---------------------------------------------------------------------------- prefill tier


def test_hung_kv_endpoint_does_not_delay_others_and_full_queue_sheds(tiny_model_dir):
    from pdserve.prefill_worker.server import PrefillWorker

    c = Cluster(tiny_model_dir)
    hung_server, hung_address = c.lt.run(_hung_kv_server())
    try:
        # long bounds here, so that the hung pushes are still hung when the others run
        p = _add_worker(c, PrefillWorker, tiny_engine(tiny_model_dir, num_threads=1),
                        rpc_timeout_s=300)
        c.add_worker("decode")
        p.service.max_queue = 20
        stub_holder = {}

        async def hung_prefills() -> list[grpc.aio.Call]:
            ch = grpc.aio.insecure_channel(p.address)
            stub_holder["ch"] = ch
            stub = prefill_pb2_grpc.PrefillWorkerStub(ch)
            return [stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=f"hung-{i}", prompt_token_ids=[1, 5, 9, 13],
                decode_address=hung_address, reservation_id=f"r{i}"), timeout=120)
                for i in range(20)]

        calls = c.lt.run(hung_prefills())
        # every one is computed and waits on its commit: the queue is full
        c.wait_for(lambda: p.service.in_flight == 20 and not p.aengine.stats().running
                   and not p.aengine.stats().waiting, timeout=60)

        async def one_more() -> grpc.StatusCode:
            stub = prefill_pb2_grpc.PrefillWorkerStub(stub_holder["ch"])
            try:
                await stub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="extra", prompt_token_ids=[1, 2], decode_address=hung_address,
                    reservation_id="rx"), timeout=30)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        assert c.lt.run(one_more()) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # an unrelated request through the gateway (another prefill slot frees for it)
        p.service.max_queue = 0
        status, body = _post(c.gateway.http_url, _completion(tiny_model_dir, timeout=30))
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4

        async def cancel_all() -> None:
            for call in calls:
                call.cancel()
            await stub_holder["ch"].close()
        c.lt.run(cancel_all())
        c.wait_for(lambda: p.service.in_flight == 0, timeout=30)
        c.assert_no_leaks()
    finally:
        c.lt.run(hung_server.stop(0))
        c.close()


# ---------------------------------------------------------------------------- engine failure


class _BreakableEngine(LLMEngine):
    """The real engine whose step raises while `broken` is set (a device fault, say)."""

    broken = False

    def step(self):
        if self.broken:
            raise RuntimeError("injected fault in step")
        return super().step()


def test_engine_failure_is_internal_and_not_serving_until_it_recovers(tiny_model_dir):
    from pdserve.decode_worker.server import DecodeWorker

    c = Cluster(tiny_model_dir, heartbeat_timeout_s=2.0)
    try:
        engine = _BreakableEngine(EngineConfig(model=tiny_model_dir, show_progress=False,
                                               num_kv_blocks=256, max_num_batched_tokens=128,
                                               num_threads=1))
        w = _add_worker(c, DecodeWorker, engine)
        c.wait_for(c.gateway.ready)
        status, body = _post(c.gateway.http_url, _completion(tiny_model_dir))
        assert status == 200, body

        engine.broken = True
        status, body = _post(c.gateway.http_url, _completion(tiny_model_dir))
        assert status == 500, body
        assert body["error"]["code"].upper() == "INTERNAL"
        assert "injected fault in step" in body["error"]["message"]
        c.wait_for(lambda: _health(w.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
        c.wait_for(lambda: not c.gateway.ready())  # it deregistered: nothing to route to
        c.wait_for(lambda: _health(c.gateway.grpc_address)
                   == health_pb2.HealthCheckResponse.NOT_SERVING)

        engine.broken = False  # the worker's probe finds it healthy and re-registers
        c.wait_for(lambda: _health(w.address) == SERVING, timeout=20)
        c.wait_for(c.gateway.ready, timeout=10)
        status, body = _post(c.gateway.http_url, _completion(tiny_model_dir))
        assert status == 200, body
        c.assert_no_leaks()
    finally:
        c.close()


# ---------------------------------------------------------------------------- readiness


def test_gateway_turns_serving_only_when_a_request_can_be_routed(tiny_model_dir):
    from pdserve.decode_worker.server import DecodeWorker

    c = Cluster(tiny_model_dir)
    try:
        assert _health(c.gateway.grpc_address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(c.gateway.http_url + "/health", timeout=5)
        assert e.value.code == 503
        engine = tiny_engine(tiny_model_dir, num_threads=1)
        w = DecodeWorker(WorkerConfig(engine=engine.config, heartbeat_interval_s=0.3,
                                      gateways=(c.gateway.registry_address,)), engine=engine)
        c.workers.append(w)
        fut = asyncio.run_coroutine_threadsafe(w.start(), c.lt.loop)
        while _health(c.gateway.grpc_address) != SERVING:  # the first SERVING seen
            assert not fut.done() or fut.exception() is None
            time.sleep(0.02)
        status, body = _post(c.gateway.http_url, _completion(tiny_model_dir))
        assert status == 200, body
        with urllib.request.urlopen(c.gateway.http_url + "/health", timeout=5) as r:
            assert r.status == 200
        fut.result(30)
        c.assert_no_leaks()
    finally:
        c.close()


# ---------------------------------------------------------------------------- processes


def _worker_stats(address: str, token: str) -> common_pb2.StatsResponse:
    with grpc.insecure_channel(address) as ch:
        return decode_pb2_grpc.DecodeWorkerStub(ch).Stats(
            common_pb2.StatsRequest(), timeout=10, metadata=((TOKEN_METADATA, token),))


def _pools_clean(cluster: LocalCluster) -> None:
    end = time.monotonic() + 30
    for w in cluster.endpoints.workers:
        if w.tier != "decode":
            continue
        while True:
            load = _worker_stats(w.address, cluster.cluster_token).load
            if load.free_blocks == load.total_blocks and not load.num_running:
                break
            assert time.monotonic() < end, f"{w.name}: blocks held: {load}"
            time.sleep(0.2)


def test_stopped_decode_worker_is_a_clear_error_and_a_killed_one_restarts(tiny_model_dir):
    cluster = LocalCluster(
        model=tiny_model_dir, http_port=0, grpc_port=0, cpus="none",
        engine_args=("--kv-cache-memory", "64MiB", "--threads", "1"),
        # the gateway keeps routing to the stopped worker: the deadlines must answer
        gateway_args=("--rpc-timeout", "3", "--stream-idle-timeout", "3",
                      "--heartbeat-timeout", "60"),
        decode_args=("--stream-keepalive", "0.5", "--reservation-timeout", "10"))
    try:
        cluster.start()
        e = cluster.wait_healthy(timeout=300)
        url = e.http_url
        status, body = _post(url, _completion(tiny_model_dir))
        assert status == 200, body
        decode = next(w for w in e.workers if w.tier == "decode")

        os.kill(decode.pid, signal.SIGSTOP)
        try:
            # no client deadline: the gateway's own bounds end it (the 60 s is a hang guard)
            status, body = _post(url, _completion(tiny_model_dir), timeout=60)
            assert status == 503, body
            assert "decode worker" in body["error"]["message"]
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        status, body = _post(url, _completion(tiny_model_dir, max_tokens=8))
        assert status == 200, body
        _pools_clean(cluster)

        os.kill(decode.pid, signal.SIGKILL)
        lines: list[str] = []
        end = time.monotonic() + 60
        while cluster.restarts == 0:
            assert time.monotonic() < end
            cluster.supervise(lines.append)
            time.sleep(0.2)
        assert any("decode-0 exited" in x for x in lines), lines
        cluster.wait_healthy(timeout=300)
        status, body = _post(url, _completion(tiny_model_dir))
        assert status == 200, body
        _pools_clean(cluster)
    finally:
        cluster.stop()


def test_a_child_that_keeps_dying_stops_the_cluster(fakes, monkeypatch):  # noqa: F811
    monkeypatch.setattr(cluster_mod, "BACKOFF_BASE_S", 0.01)
    cluster = _fake_cluster(fakes, num_prefill=0, env={"FAKE_CRASH": "decode-0"})
    lines: list[str] = []
    try:
        cluster.start()
        end = time.monotonic() + 120
        with pytest.raises(ClusterError, match=r"decode-0 exited 6 times(.|\n)*boom"):
            while time.monotonic() < end:
                cluster.supervise(lines.append)
                time.sleep(0.05)
        assert cluster.restarts == cluster_mod.MAX_RESTARTS
        assert sum("restarted" in x for x in lines) == cluster_mod.MAX_RESTARTS
    finally:
        cluster.stop(grace=5)


# ---------------------------------------------------------------------------- ports


def test_port_in_time_wait_counts_as_free():
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end of the pair lingers in TIME_WAIT
    cli.close()
    srv.close()
    assert port_is_free("127.0.0.1", port)


def test_cluster_starts_again_at_once_on_the_same_ports(fakes):  # noqa: F811
    first = _fake_cluster(fakes, num_prefill=0)
    first.start()
    try:
        e = first.wait_healthy(timeout=60, poll_s=0.1)
    finally:
        first.stop(grace=5)
    http_port = int(e.http_url.rsplit(":", 1)[1])
    grpc_port = int(e.grpc_address.rsplit(":", 1)[1])
    again = _fake_cluster(fakes, num_prefill=0)
    again = LocalCluster(again.config, http_port=http_port, grpc_port=grpc_port)
    again.start()
    try:
        e2 = again.wait_healthy(timeout=60, poll_s=0.1)
        assert e2.http_url == e.http_url and e2.grpc_address == e.grpc_address
    finally:
        again.stop(grace=5)


def test_registration_calls_run_under_the_rpc_timeout_and_heartbeats_under_the_interval():
    """What a worker's registration calls allow the registry: the configured rpc timeout
    (not a fixed 5 s), a heartbeat and the shutdown's Deregister at most one interval."""
    from pdserve.protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc
    from pdserve.worker_runtime import GatewayRegistration

    seen: dict[str, list[float]] = {}

    class Registry(gateway_pb2_grpc.WorkerRegistryServicer):
        def _note(self, name, context):
            seen.setdefault(name, []).append(context.time_remaining())

        async def RegisterWorker(self, request, context):
            self._note("register", context)
            return gateway_pb2.RegisterWorkerResponse()

        async def Heartbeat(self, request, context):
            self._note("heartbeat", context)
            return gateway_pb2.HeartbeatResponse(known=True)

        async def Deregister(self, request, context):
            self._note("deregister", context)
            return gateway_pb2.DeregisterResponse()

    async def main():
        server = grpc.aio.server()
        gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(Registry(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        reg = GatewayRegistration(
            f"127.0.0.1:{port}", lambda: gateway_pb2.WorkerInfo(worker_id="w"),
            common_pb2.WorkerLoad, interval_s=0.2, rpc_timeout_s=7.0)
        reg.start()
        try:
            async with asyncio.timeout(60):
                while len(seen.get("heartbeat", ())) < 2:
                    await asyncio.sleep(0.05)
        finally:
            await reg.stop()
            await server.stop(None)

    asyncio.run(main())
    # the deadline crosses the wire rounded up a little: 0.3 allows that, far below 7
    assert len(seen["register"]) == 1 and 1.0 < seen["register"][0] <= 7.1, seen
    assert all(0 < t <= 0.3 for t in seen["heartbeat"]), seen["heartbeat"]
    assert len(seen["deregister"]) == 1 and 0 < seen["deregister"][0] <= 0.3, seen


def test_a_worker_still_loading_is_unavailable_not_unimplemented():
    """A decode worker SIGKILLed and restarted on its address is routed to before its model
    is in: the gateway must read that as "try another worker" (UNAVAILABLE), not as a
    worker without the method (UNIMPLEMENTED makes its sessions fall back to per-request
    calls, which then fail the same way). Once every servicer is in, an unknown method is
    UNIMPLEMENTED again."""
    async def run() -> tuple[list, list, int]:
        svc = GrpcService("127.0.0.1", 0, ("pdserve.v1.DecodeWorker",))
        await svc.start()
        address = f"127.0.0.1:{svc.port}"
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = decode_pb2_grpc.DecodeWorkerStub(ch)
                loading = []
                for call in (lambda: stub.Cancel(decode_pb2.CancelRequest(request_id="r"),
                                                 timeout=5),
                             lambda: _first(stub.Session(iter(()), timeout=5))):
                    try:
                        await call()
                        loading.append(("OK", ""))
                    except grpc.aio.AioRpcError as e:
                        loading.append((e.code(), e.details()))
                status = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
                svc.services.opened()
                opened = []
                try:
                    await stub.Cancel(decode_pb2.CancelRequest(request_id="r"), timeout=5)
                except grpc.aio.AioRpcError as e:
                    opened.append(e.code())
            return loading, opened, status.status
        finally:
            await svc.stop(0)

    loading, opened, health = asyncio.run(run())
    assert [c for c, _ in loading] == [grpc.StatusCode.UNAVAILABLE] * 2, loading
    assert all("starting" in d for _, d in loading), loading
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert opened == [grpc.StatusCode.UNIMPLEMENTED]


def test_a_starting_gateway_answers_unavailable_rather_than_holding_the_connection(
        tiny_model_dir, monkeypatch):
    """While the gateway loads its tokenizer, its public and registry ports already answer:
    health NOT_SERVING, every other call UNAVAILABLE ("starting"), which callers retry. A
    port that listened before it served held each connection until gRPC's connect timeout
    (20 s): workers registering then, or a client, waited that long."""
    import threading

    from pdserve.gateway import server as gateway_server
    from pdserve.gateway.server import Gateway, GatewayConfig

    release = threading.Event()
    real = gateway_server.load_tokenizer

    def slow_tokenizer(source):
        release.wait(30)
        return real(source)

    monkeypatch.setattr(gateway_server, "load_tokenizer", slow_tokenizer)

    async def run() -> tuple[list, int, int]:
        g = Gateway(GatewayConfig(model=tiny_model_dir, http_port=0, grpc_port=0,
                                  registry_port=0))
        start = asyncio.create_task(g.start())
        while g.registry_port is None:
            await asyncio.sleep(0.01)
        starting = []
        try:
            async with grpc.aio.insecure_channel(g.grpc_address) as pub, \
                    grpc.aio.insecure_channel(g.registry_address) as reg:
                # wait_for_ready: a held connection shows as DEADLINE_EXCEEDED, not as a
                # refusal the channel would fail fast with
                for call in (
                        lambda: gateway_pb2_grpc.GatewayStub(pub).ListModels(
                            gateway_pb2.ListModelsRequest(), timeout=5, wait_for_ready=True),
                        lambda: gateway_pb2_grpc.WorkerRegistryStub(reg).Heartbeat(
                            gateway_pb2.HeartbeatRequest(worker_id="w"), timeout=5,
                            wait_for_ready=True)):
                    try:
                        await call()
                        starting.append(("OK", ""))
                    except grpc.aio.AioRpcError as e:
                        starting.append((e.code(), e.details()))
                health = (await health_pb2_grpc.HealthStub(pub).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)).status
                release.set()
                await start
                models = await gateway_pb2_grpc.GatewayStub(pub).ListModels(
                    gateway_pb2.ListModelsRequest(), timeout=5)
            return starting, health, len(models.models)
        finally:
            release.set()
            if not start.done():
                start.cancel()
            await g.stop(0)

    starting, health, models = asyncio.run(run())
    assert [c for c, _ in starting] == [grpc.StatusCode.UNAVAILABLE] * 2, starting
    assert all("gateway is starting" in d for _, d in starting), starting
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert models == 1


async def _first(call):
    async for _ in call:
        return
