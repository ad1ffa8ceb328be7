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
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import EngineConfig
from pdserve.engine_args import add_engine_args, engine_config_from_args
from pdserve.metrics import CONTENT_TYPE, TierMetrics
from protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

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


class GrpcService:
    """A grpc.aio server with health (NOT_SERVING until `set_serving`) and reflection."""

    def __init__(self, host: str, port: int) -> None:
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else \
            health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
        self._service_names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                               reflection.SERVICE_NAME]

    def add_service_name(self, name: str) -> None:
        self._service_names.append(name)

    async def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self.server)
        await self._set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self._service_names]:
            await self._set(name, status)

    async def _set(self, name: str, status) -> None:
        r = self.health.set(name, status)
        if asyncio.iscoroutine(r):
            await r

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
