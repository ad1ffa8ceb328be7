"""What every worker process shares: its command-line flags, a grpc.aio server with the
health and reflection services, the `/metrics` HTTP endpoint, registration and heartbeats
to the gateway, and the SIGTERM -> NOT_SERVING -> graceful stop sequence.

Health is NOT_SERVING until the model is loaded and the servicers are added.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from aiohttp import web

from pdserve.convert import kv_spec_to_proto
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine_args import add_engine_args, engine_config_from_args
from pdserve.grpc_health import GrpcHealth
from pdserve.metrics import CONTENT_TYPE, TierMetrics
from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("pdserve.worker")

MAX_MESSAGE_BYTES = 64 * 2**20  # KV chunks and long prompts fit comfortably


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    metrics_port: int | None = None  # None = no /metrics server; 0 = pick a free port
    gateway: str | None = None  # the gateway's gRPC address to register with
    worker_id: str | None = None
    advertise_address: str | None = None  # what others dial; default host:bound port
    heartbeat_interval_s: float = 1.0
    reservation_timeout_s: float = 30.0  # decode: uncommitted reservations expire


def add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=0, help="gRPC port (default: a free port)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics over HTTP on this port (default: off)")
    g.add_argument("--gateway", default=None,
                   help="gateway gRPC address (host:port) to register and heartbeat with")
    g.add_argument("--worker-id", default=None, help="stable worker id (default: random)")
    g.add_argument("--advertise-address", default=None,
                   help="host:port the gateway and other workers dial (default: host:port)")
    g.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between heartbeats to the gateway (default 1)")
    add_engine_args(p)


def worker_config_from_args(a: argparse.Namespace, **extra) -> WorkerConfig:
    return WorkerConfig(engine=engine_config_from_args(a), host=a.host, port=a.port,
                        metrics_port=a.metrics_port, gateway=a.gateway, worker_id=a.worker_id,
                        advertise_address=a.advertise_address,
                        heartbeat_interval_s=a.heartbeat_interval, **extra)


class _LateServices(grpc.GenericRpcHandler):
    """Servicers added after the server started (the model loads while health already
    answers). Installed before start as one generic handler; calls to a service that is
    not there yet get UNIMPLEMENTED."""

    def __init__(self) -> None:
        self._handlers: list[grpc.GenericRpcHandler] = []

    def service(self, handler_call_details):
        for h in self._handlers:
            handler = h.service(handler_call_details)
            if handler is not None:
                return handler
        return None

    # what the generated add_*Servicer_to_server functions call on a "server"
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._handlers.extend(handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        pass  # the generic handler above already routes these methods


class GrpcService:
    """A grpc.aio server with health (NOT_SERVING until `set_serving`) and reflection.
    Tier servicers go on `services`, which works before and after `start()`."""

    def __init__(self, host: str, port: int, service_names: tuple[str, ...] = ()) -> None:
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self.services = _LateServices()
        self.server.add_generic_rpc_handlers((self.services,))
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
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
    """Registers with the gateway and heartbeats load; re-registers when forgotten.
    The gateway being down is not fatal: the worker keeps trying."""

    def __init__(self, gateway: str, info: Callable[[], gateway_pb2.WorkerInfo],
                 load: Callable[[], common_pb2.WorkerLoad], interval_s: float) -> None:
        self.gateway = gateway
        self.info = info
        self.load = load
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._channel = grpc.aio.insecure_channel(gateway)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        known = False
        while True:
            try:
                if not known:
                    resp = await self._stub.RegisterWorker(
                        gateway_pb2.RegisterWorkerRequest(worker=self.info()), timeout=5)
                    if resp.heartbeat_interval_s > 0:
                        self.interval_s = min(self.interval_s, resp.heartbeat_interval_s)
                    known = True
                    self.registered.set()
                    log.info("registered with gateway %s", self.gateway)
                else:
                    resp = await self._stub.Heartbeat(gateway_pb2.HeartbeatRequest(
                        worker_id=self.info().worker_id, load=self.load()), timeout=5)
                    known = resp.known
            except grpc.aio.AioRpcError as e:
                if known:
                    log.warning("heartbeat to %s failed: %s", self.gateway, e.code().name)
                known = False
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await self._stub.Deregister(
                gateway_pb2.DeregisterRequest(worker_id=self.info().worker_id), timeout=2)
        except grpc.aio.AioRpcError:
            pass
        await self._channel.close()


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
                 -> tier servicers -> /metrics -> SERVING -> register + heartbeat
        stop():  NOT_SERVING -> deregister -> grpc stop(grace) -> engine thread stops
    """

    role = ""  # "prefill" | "decode"
    role_proto = 0  # gateway_pb2.WorkerRole value
    service_names: tuple[str, ...] = ()  # full names of the tier's gRPC services

    def __init__(self, config: WorkerConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.worker_id = config.worker_id or new_worker_id(self.role)
        self._engine = engine  # tests may hand in an already-loaded engine
        self.grpc: GrpcService | None = None
        self.address = ""
        self.metrics_server: MetricsServer | None = None
        self.registration: GatewayRegistration | None = None
        self.aengine: AsyncEngine | None = None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    async def start(self) -> None:
        cfg = self.config
        self.grpc = GrpcService(cfg.host, cfg.port, self.service_names)
        await self.grpc.start()  # health answers NOT_SERVING while the model loads
        self.address = cfg.advertise_address or f"{cfg.host}:{self.grpc.port}"
        self.engine = self._engine or await asyncio.to_thread(LLMEngine, cfg.engine)
        self.model_name = cfg.engine.model
        self.metrics = TierMetrics(self.model_name, self.role, self.worker_id)
        self.aengine = AsyncEngine(self.engine)
        self.aengine.start()
        self.add_services(self.grpc.services)
        if cfg.metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics, self.refresh_metrics)
            await self.metrics_server.start(cfg.host, cfg.metrics_port)
        await self.grpc.set_serving(True)
        if cfg.gateway:
            self.registration = GatewayRegistration(cfg.gateway, self.worker_info, self.load,
                                                    cfg.heartbeat_interval_s)
            self.registration.start()
        log.info("%s worker %s serving on %s", self.role, self.worker_id, self.address)

    def add_services(self, server) -> None:
        """Add the tier's servicers to `server`, as the generated add_*_to_server
        functions do."""
        raise NotImplementedError

    async def stop(self, grace: float = 2.0) -> None:
        if self.grpc is not None:
            await self.grpc.set_serving(False)
        if self.registration is not None:
            await self.registration.stop()
        if self.grpc is not None:
            await self.grpc.stop(grace)
        await self.stop_tier()
        if self.aengine is not None:
            await self.aengine.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()

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
            load=self.load())

    async def stats(self) -> common_pb2.StatsResponse:
        return common_pb2.StatsResponse(worker_id=self.worker_id, model=self.model_name,
                                        load=self.load(),
                                        kv_spec=kv_spec_to_proto(self.engine.kv_spec))
