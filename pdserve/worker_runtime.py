"""What every worker process shares: its command-line flags, a grpc.aio server with the
health and reflection services, the `/metrics` HTTP endpoint, registration and heartbeats
to every gateway's registry it is given (one independent registration each: gateways share
nothing), and the SIGTERM -> NOT_SERVING -> drain -> stop sequence.

Health is NOT_SERVING until the model is loaded and the servicers are added, and again
while the engine is failed (its last step raised): the worker then deregisters, so the
gateway stops routing to it, and probes the engine with a one-token request every few
seconds; the first probe that succeeds turns it SERVING and it registers again. Every RPC
but health needs the cluster credential (`pdserve.cluster_auth`), and the server and the
registration channel come from `pdserve.rpc`, whose keepalive settings agree.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch
from aiohttp import web

from pdserve import fingerprint, rpc
from pdserve.addresses import addresses
from pdserve.cluster_auth import ClusterCredentials, add_credential_args, credentials_from_args
from pdserve.convert import kv_spec_to_proto
from pdserve.deadlines import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S, STREAM_KEEPALIVE_S
from pdserve.engine.async_engine import AsyncEngine, RequestError
from pdserve.engine.config import EngineConfig
from pdserve.engine.heap_tuning import retain_freed_memory
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine_args import add_engine_args, engine_config_from_args
from pdserve.grpc_health import GrpcHealth
from pdserve.grpc_refusal import LateServices
from pdserve.metrics import CONTENT_TYPE, TierMetrics
from pdserve.protocol import SamplingParams
from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("pdserve.worker")

PROBE_INTERVAL_S = 2.0  # a failed engine is probed this often


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    metrics_port: int | None = None  # None = no /metrics server; 0 = pick a free port
    gateways: tuple[str, ...] = ()  # gateways' registry addresses; registers with each
    worker_id: str | None = None
    advertise_address: str | None = None  # what others dial; default host:bound port
    heartbeat_interval_s: float = 1.0
    reservation_timeout_s: float = 30.0  # decode: uncommitted reservations expire
    credentials: ClusterCredentials = ClusterCredentials()
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S  # outgoing calls: KV pushes, registration
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # SIGTERM: in-flight work gets this long
    stream_keepalive_s: float = STREAM_KEEPALIVE_S  # decode: empty chunk after this silence
    stream_interval: int = 1  # decode: a request's tokens go out N at a time (first, last: at once)
    # the engine's step thread and the event loop on the first of this process's cores, the
    # engine's other threads on the rest (`pin_cores`)
    pin_threads: bool = False


def add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=0, help="gRPC port (default: a free port)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics over HTTP on this port (default: off)")
    g.add_argument("--gateway", action="append", default=[], metavar="ADDRS",
                   help="gateway registry address(es) host:port,... (each gateway's "
                        "--registry-port) to register and heartbeat with; repeatable. Each "
                        "gateway is independent: one down does not stop the others' heartbeats")
    g.add_argument("--worker-id", default=None, help="stable worker id (default: random)")
    g.add_argument("--advertise-address", default=None,
                   help="host:port the gateway and other workers dial (default: host:port)")
    g.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between heartbeats to the gateway (default 1)")
    add_credential_args(p)
    g.add_argument("--rpc-timeout", type=float, default=DEFAULT_RPC_TIMEOUT_S, metavar="S",
                   help="deadline of this worker's own calls: a KV push from open to ack, "
                        f"registration and deregistration; a heartbeat's is at most the heartbeat "
                        f"interval (default {DEFAULT_RPC_TIMEOUT_S:g})")
    g.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM: NOT_SERVING, deregister, then let in-flight requests "
                        "finish for up to S seconds before stopping (default "
                        f"{DEFAULT_DRAIN_TIMEOUT_S:g}: the manifests' "
                        "terminationGracePeriodSeconds 60 minus a margin)")
    g.add_argument("--stream-keepalive", type=float, default=STREAM_KEEPALIVE_S, metavar="S",
                   help="decode: a token stream silent for S seconds sends an empty chunk, "
                        f"so the gateway knows it is alive (default {STREAM_KEEPALIVE_S:g})")
    g.add_argument("--stream-interval", type=int_at_least(1), default=1, metavar="N",
                   help="decode: send a request's tokens N at a time, so N tokens cost one "
                        "message through the worker, the gateway and the client's stream; "
                        "its first token and its end go out at once (default 1: every token "
                        "as it comes)")
    g.add_argument("--pin-threads", action="store_true",
                   help="run the engine's step thread and this worker's event loop on the "
                        "first core this process may use, and the engine's other threads on "
                        "the others (needs --threads equal to those cores, two or more; "
                        "`pdserve up` sets it where the gateway shares a worker's cores)")
    add_engine_args(p)


def pin_cores(engine: EngineConfig) -> tuple[int, ...] | None:
    """The cores `--pin-threads` places the engine's threads on (the step thread on the first),
    or None, with a warning saying why, where it cannot: the engine not on the CPU, fewer than
    two cores, or a thread count other than the cores'."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    if torch.device(engine.device).type != "cpu":
        why = "the engine is not on the CPU"
    elif len(cores) < 2:
        why = f"{len(cores)} core(s)"
    elif engine.threads() != len(cores):
        why = f"{engine.threads()} engine thread(s) on {len(cores)} cores"
    else:
        return cores
    log.warning("--pin-threads: not pinning: %s", why)
    return None


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer, refused below `lo`."""
    def parse(text: str) -> int:
        n = int(text)
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, not {n}")
        return n

    parse.__name__ = "int"  # argparse names it in "invalid int value"
    return parse


def worker_config_from_args(a: argparse.Namespace, **extra) -> WorkerConfig:
    """Raises ValueError naming the flag for a malformed --gateway entry."""
    return WorkerConfig(engine=engine_config_from_args(a), host=a.host, port=a.port,
                        metrics_port=a.metrics_port,
                        gateways=tuple(addresses(a.gateway, "--gateway")), worker_id=a.worker_id,
                        advertise_address=a.advertise_address,
                        heartbeat_interval_s=a.heartbeat_interval, rpc_timeout_s=a.rpc_timeout,
                        drain_timeout_s=a.drain_timeout,
                        stream_keepalive_s=a.stream_keepalive,
                        stream_interval=a.stream_interval, pin_threads=a.pin_threads,
                        credentials=credentials_from_args(a), **extra)


class GrpcService:
    """A grpc.aio server with health (NOT_SERVING until `set_serving`) and reflection.
    Tier servicers go on `services`, which works before and after `start()`."""

    def __init__(self, host: str, port: int, service_names: tuple[str, ...] = (),
                 credentials: ClusterCredentials = ClusterCredentials()) -> None:
        self.server = rpc.server(credentials)
        self.services = LateServices("the worker is starting: its model is still loading")
        self.server.add_generic_rpc_handlers((self.services,))
        self.port = rpc.add_port(self.server, f"{host}:{port}", credentials)
        self.health = GrpcHealth(self.server, service_names)

    async def start(self) -> None:
        await self.health.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        await self.health.set_serving(serving)

    async def stop(self, grace: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


class MetricsServer:
    """`/metrics` (Prometheus text) and `/health` over HTTP for one TierMetrics."""

    def __init__(self, metrics: TierMetrics, refresh: Callable[[], None]) -> None:
        self.metrics = metrics
        self.refresh = refresh
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _metrics(self, _req: web.Request) -> web.Response:
        self.refresh()
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class GatewayRegistration:
    """Registers with one gateway's registry and heartbeats load; re-registers when
    forgotten. The gateway being down is not fatal: the worker keeps trying. A refusal
    (wrong credential, incompatible fingerprint, id bound elsewhere) is logged as an error
    each time its reason changes, and retried: the gateway may be the one to change. A
    worker holds one per gateway, each with its own channel and task, so one gateway's
    failure never delays another's heartbeats.

    Every call runs under the worker's rpc timeout (`--rpc-timeout`); a heartbeat under the
    heartbeat interval where that is shorter: one still unanswered when the next is due is
    late already, and waiting longer would only delay the next."""

    def __init__(self, gateway: str, info: Callable[[], gateway_pb2.WorkerInfo],
                 load: Callable[[], common_pb2.WorkerLoad], interval_s: float,
                 credentials: ClusterCredentials = ClusterCredentials(),
                 rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                 serving: Callable[[], bool] = lambda: True,
                 role: Callable[[], int] = lambda: 0) -> None:
        self.gateway = gateway
        self.serving = serving  # False: deregister and stay away until it is True again
        self.role = role  # a change (a role switch) registers again under the new role
        self._wake = asyncio.Event()
        self.info = info
        self.load = load
        self.interval_s = interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self._task: asyncio.Task | None = None
        self._channel = rpc.aio_channel(gateway, credentials)
        self._stub = gateway_pb2_grpc.WorkerRegistryStub(self._channel)
        self.registered = asyncio.Event()
        self.refusal: str | None = None  # the registry's last refusal, if it refused

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def poke(self) -> None:
        """Act on a change of `serving` or `role` now rather than at the next heartbeat."""
        self._wake.set()

    async def _sleep(self) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), self.interval_s)
        except asyncio.TimeoutError:  # TimeoutError itself only from 3.11
            pass
        self._wake.clear()

    @property
    def heartbeat_timeout_s(self) -> float:
        return min(self.rpc_timeout_s, self.interval_s)

    async def _run(self) -> None:
        known = False
        registered_role = None
        while True:
            try:
                if not self.serving():
                    if known:
                        await self._stub.Deregister(gateway_pb2.DeregisterRequest(
                            worker_id=self.info().worker_id), timeout=self.rpc_timeout_s)
                        log.warning("not serving: deregistered from gateway %s", self.gateway)
                    known = False
                elif not known or self.role() != registered_role:
                    registered_role = self.role()
                    resp = await self._stub.RegisterWorker(
                        gateway_pb2.RegisterWorkerRequest(worker=self.info()),
                        timeout=self.rpc_timeout_s)
                    if resp.heartbeat_interval_s > 0:
                        self.interval_s = min(self.interval_s, resp.heartbeat_interval_s)
                    known = True
                    self.registered.set()
                    log.info("registered with gateway %s", self.gateway)
                else:
                    resp = await self._stub.Heartbeat(gateway_pb2.HeartbeatRequest(
                        worker_id=self.info().worker_id, load=self.load()),
                        timeout=self.heartbeat_timeout_s)
                    known = resp.known
            except grpc.aio.AioRpcError as e:
                if known:
                    log.warning("heartbeat to %s failed: %s", self.gateway, e.code().name)
                elif e.code() in _REFUSALS:
                    refusal = f"{e.code().name}: {e.details()}"
                    if refusal != self.refusal:
                        log.error("gateway %s refused the registration: %s", self.gateway,
                                  refusal)
                    self.refusal = refusal
                known = False
            await self._sleep()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await self._stub.Deregister(
                # as short as a heartbeat: at shutdown, an unreachable gateway must not
                # hold the stop; it expires this worker anyway
                gateway_pb2.DeregisterRequest(worker_id=self.info().worker_id),
                timeout=self.heartbeat_timeout_s)
        except grpc.aio.AioRpcError:
            pass
        await self._channel.close()


_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


async def run_until_signal(start: Callable[[], Awaitable[None]],
                           stop: Callable[[], Awaitable[None]]) -> None:
    """Start, then wait for SIGTERM/SIGINT and stop gracefully."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await start()
    await done.wait()
    log.info("signal received: stopping")
    await stop()


class WorkerBase:
    """The life cycle both worker tiers share; a tier adds its servicers and its load.

        start(): bind gRPC (health NOT_SERVING) -> load model -> engine thread
                 -> tier servicers -> /metrics -> SERVING -> register + heartbeat (each gateway)
        stop():  NOT_SERVING -> deregister -> drain (in-flight work finishes, up to
                 drain_timeout_s; KV pushes for reservations made still arrive) ->
                 grpc stop -> engine thread stops
    """

    role = ""  # "prefill" | "decode"
    role_proto = 0  # gateway_pb2.WorkerRole value
    service_names: tuple[str, ...] = ()  # full names of the tier's gRPC services
    max_prefix_hashes = 0  # cached prefix hashes the engine's stats carry (AsyncEngine)
    switchable = False  # serves WorkerControl.SwitchRole (pdserve.role_worker)

    def __init__(self, config: WorkerConfig, engine: LLMEngine | None = None) -> None:
        if torch.device(config.engine.device).type == "cpu":
            # before gRPC and the model loader start threads, each of which would take an
            # arena of its own for the engine thread to share later (heap_tuning.py)
            retain_freed_memory()
        self.config = config
        self.worker_id = config.worker_id or new_worker_id(self.role)
        self._engine = engine  # tests may hand in an already-loaded engine
        self.grpc: GrpcService | None = None
        self.address = ""
        self.metrics_server: MetricsServer | None = None
        self.registrations: list[GatewayRegistration] = []
        self.aengine: AsyncEngine | None = None
        self._stopping = False
        self._engine_ok = True  # False from a failed step until a probe succeeds
        self._probe_task: asyncio.Task | None = None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    async def start(self) -> None:
        cfg = self.config
        cfg.credentials.require_for(cfg.host, f"the {self.role} worker")
        self.grpc = GrpcService(cfg.host, cfg.port, self.service_names, cfg.credentials)
        await self.grpc.start()  # health answers NOT_SERVING while the model loads
        self.address = cfg.advertise_address or f"{cfg.host}:{self.grpc.port}"
        self.engine = self._engine or await asyncio.to_thread(LLMEngine, cfg.engine)
        self.model_name = cfg.engine.model
        self.fingerprint = await asyncio.to_thread(fingerprint.of_model, cfg.engine.model)
        self.metrics = TierMetrics(self.model_name, self.role, self.worker_id)
        self.aengine = AsyncEngine(self.engine, self.max_prefix_hashes)
        cores = pin_cores(self.engine.config) if cfg.pin_threads else None
        self.aengine.start(cores)
        if cores:
            # the GIL lets the loop's Python and the step thread's run only in turn, so the
            # loop loses little beside it, and the engine's other threads keep the other
            # cores (docs/benchmarks.md, session 36)
            os.sched_setaffinity(0, cores[:1])  # this thread only (Linux)
        self.add_services(self.grpc.services)
        self.grpc.services.opened()
        if cfg.metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics, self.refresh_metrics)
            await self.metrics_server.start(cfg.host, cfg.metrics_port)
        await self.grpc.set_serving(True)
        self._probe_task = asyncio.get_running_loop().create_task(self._watch_engine())
        self.registrations = [
            GatewayRegistration(gw, self.worker_info, self.load, cfg.heartbeat_interval_s,
                                cfg.credentials, cfg.rpc_timeout_s, serving=self.routable,
                                role=lambda: self.role_proto)
            for gw in cfg.gateways]
        for r in self.registrations:
            r.start()
        log.info("%s worker %s serving on %s", self.role, self.worker_id, self.address)

    def add_services(self, server) -> None:
        """Add the tier's servicers to `server`, as the generated add_*_to_server
        functions do."""
        raise NotImplementedError

    # -- engine health --------------------------------------------------------------------
    async def _watch_engine(self) -> None:
        """NOT_SERVING while the engine is failed; a failed engine is probed until a step
        succeeds again (nothing else would run one: the gateway routes nothing to it)."""
        n = 0
        while True:
            await asyncio.sleep(0.2)
            failure = self.aengine.failure
            if failure is not None and self._engine_ok:
                log.error("engine failed, NOT_SERVING until it recovers: %s", failure)
                self._engine_ok = False
                await self.grpc.set_serving(False)
            if self._engine_ok or self._stopping:
                continue
            n += 1
            try:
                async for _ in self.aengine.generate(f"health-probe-{self.worker_id}-{n}", [1],
                                                     SamplingParams(max_tokens=1)):
                    pass
            except RequestError:
                await asyncio.sleep(PROBE_INTERVAL_S)
                continue
            if self.aengine.failure is None and not self._stopping:
                log.info("engine recovered: SERVING")
                self._engine_ok = True
                await self.grpc.set_serving(True)

    @property
    def engine_ok(self) -> bool:
        return self._engine_ok

    def routable(self) -> bool:
        """The gateways may route new work here: it is registered with them while True."""
        return self._engine_ok and not self._stopping

    # -- stop -----------------------------------------------------------------------------
    def busy(self) -> bool:
        """Work in flight: requests in the engine (running, queued, reserved)."""
        s = self.aengine.stats()
        return bool(s.running or s.waiting or s.reserved)

    async def drain(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while self.busy() and time.monotonic() < end:
            await asyncio.sleep(0.1)
        if self.busy():
            log.warning("drain: work still in flight after %.0fs; stopping anyway", timeout_s)

    async def stop(self, grace: float | None = None) -> None:
        """grace: how long in-flight work may take (default: the config's drain timeout)."""
        grace = self.config.drain_timeout_s if grace is None else grace
        self._stopping = True
        if self._probe_task is not None:
            self._probe_task.cancel()
        if self.grpc is not None:
            await self.grpc.set_serving(False)
        # in parallel: an unreachable gateway's Deregister timeout delays none of the others
        await asyncio.gather(*(r.stop() for r in self.registrations))
        if self.aengine is not None and grace > 0:
            await self.drain(grace)
        self.end_sessions()
        if self.grpc is not None:
            await self.grpc.stop(min(grace, 2.0))
        await self.stop_tier()
        if self.aengine is not None:
            await self.aengine.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()

    def end_sessions(self) -> None:
        """Tier-specific: end the long-lived calls that carry many requests once those
        requests have ended, so that the server's stop need not cancel them."""

    async def stop_tier(self) -> None:
        """Tier-specific teardown, after the server stopped and before the engine does."""

    def refresh_metrics(self) -> None:
        self.metrics.observe_engine(self.aengine.stats())

    def load(self) -> common_pb2.WorkerLoad:
        s = self.aengine.stats()
        return common_pb2.WorkerLoad(
            num_running=s.running, num_waiting=s.waiting, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, tokens_per_s=s.tokens_per_s, queue_depth=s.waiting)

    def worker_info(self) -> gateway_pb2.WorkerInfo:
        return gateway_pb2.WorkerInfo(
            worker_id=self.worker_id, role=self.role_proto, address=self.address,
            model=self.model_name, kv_spec=kv_spec_to_proto(self.engine.kv_spec),
            load=self.load(), fingerprint=fingerprint.to_proto(self.fingerprint),
            switchable=self.switchable)

    async def stats(self) -> common_pb2.StatsResponse:
        return common_pb2.StatsResponse(worker_id=self.worker_id, model=self.model_name,
                                        load=self.load(),
                                        kv_spec=kv_spec_to_proto(self.engine.kv_spec))
