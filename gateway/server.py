"""The gateway process: one asyncio loop serving the public gRPC port (Gateway, health,
reflection), the OpenAI HTTP API and the internal registry listener (WorkerRegistry and
health, cluster credential required), plus housekeeping tasks — expiring silent workers
(whose calls in flight the orchestrator then ends at once), polling the Stats of static
ones and, with a planner mode set, the planner's driver: every interval it feeds
`planner.Planner` the registry's loads and this gateway's recent TTFT/TPOT, orders the
switch it decides (WorkerControl.SwitchRole), logs and counts it.

Life cycle: `start()` binds and starts the gRPC servers with health NOT_SERVING (other
calls UNAVAILABLE), loads the tokenizer and config (never weights) and fingerprints the
model, then serves; health (gRPC and HTTP
`/health`) says SERVING only while a request can be routed (`ready`): at least one live
decode worker, and a live prefill worker when static prefill workers are configured
(registered ones are optional: without any, prompts run colocated); `stop()` turns
NOT_SERVING, stops taking requests, lets in-flight ones finish within the grace period,
and closes the channels.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

import grpc
from aiohttp import web

from pdserve import fingerprint, rpc
from pdserve.addresses import addresses
from pdserve.cluster_auth import ClusterCredentials
from pdserve.deadlines import DEFAULT_RPC_TIMEOUT_S, DEFAULT_STREAM_IDLE_S
from pdserve.engine.model_files import load_config, load_tokenizer, resolve_model
from pdserve.gateway.admission import AdmissionController
from pdserve.gateway.channels import WorkerChannels
from pdserve.gateway.convert import kv_spec_from_proto, load_from_proto
from pdserve.gateway.grpc_api import GatewayServicer
from pdserve.gateway.http_api import MAX_BODY_BYTES, OpenAIServer
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.planner import (
    LIVE_TPOT_TOKENS,
    Planner,
    PlannerConfig,
    PlannerMode,
    Signals,
    Switch,
    WindowedMean,
    decode_tpot,
)
from pdserve.gateway.prompts import PromptProcessor
from pdserve.gateway.registry import Role, Worker, WorkerRegistry
from pdserve.gateway.registry_api import RegistryServicer
from pdserve.gateway.wire_check import MalformedRequests
from pdserve.grpc_health import GrpcHealth
from pdserve.grpc_refusal import LateServices
from pdserve.metrics import PlannerMetrics, TierMetrics, histogram_totals
from pdserve.protocol import DEFAULT_MAX_TOKENS
from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("pdserve.gateway")

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
REGISTRY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["WorkerRegistry"].full_name


@dataclass(frozen=True)
class GatewayConfig:
    model: str
    host: str = "127.0.0.1"
    http_port: int = 8000  # 0: pick a free port
    grpc_port: int = 50051  # 0: pick a free port
    # internal: workers register here; 0: pick a free port; None: grpc_port + 1 (0 if that is)
    registry_port: int | None = None
    prefill: tuple[str, ...] = ()  # static worker addresses
    decode: tuple[str, ...] = ()
    disagg_threshold: int = 0  # prompts shorter than this go colocated; 0: never
    max_queue: int = 256
    max_inflight: int = 128
    heartbeat_timeout_s: float = 5.0
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_body_bytes: int = MAX_BODY_BYTES  # HTTP request bodies; larger ones get 413
    # a client that reads none of its stream for this long is dropped, its request cancelled
    reader_timeout_s: float = 30.0
    grace_s: float = 5.0
    credentials: ClusterCredentials = ClusterCredentials()
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S  # every unary call to a worker
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S  # a token stream silent this long: UNAVAILABLE
    # token streams on one Session call per decode worker; False: one call per request
    decode_sessions: bool = True
    planner: PlannerConfig = PlannerConfig()  # mode OFF: no planner task

    def __post_init__(self) -> None:
        for name in ("disagg_threshold", "max_queue"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        for name in ("heartbeat_timeout_s", "rpc_timeout_s", "stream_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.registry_port is None:
            object.__setattr__(self, "registry_port", self.grpc_port + 1 if self.grpc_port else 0)
        if self.reader_timeout_s <= 0:
            raise ValueError("reader_timeout_s must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        object.__setattr__(self, "prefill", tuple(addresses(",".join(self.prefill))))
        object.__setattr__(self, "decode", tuple(addresses(",".join(self.decode))))


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.gateway_id = f"gateway-{uuid.uuid4().hex[:8]}"
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.registry_port: int | None = None
        self.registry = WorkerRegistry(config.heartbeat_timeout_s)
        self.channels = WorkerChannels(config.credentials, sessions=config.decode_sessions)
        self.admission = AdmissionController(config.max_inflight, config.max_queue)
        self.metrics = TierMetrics(config.model, "gateway", self.gateway_id)
        self.metrics.running.set_function(lambda: self.admission.num_inflight)
        self.metrics.waiting.set_function(lambda: self.admission.stats().queued)
        self.metrics.kv_usage.set_function(self._decode_kv_usage)
        self.health: GrpcHealth | None = None  # the public port's: SERVING only when `ready`
        # the registry listener's own health: SERVING while it takes registrations, which it
        # must do before the gateway can route anything (so it never follows `ready`)
        self.registry_health: GrpcHealth | None = None
        self.prompts: PromptProcessor | None = None
        self.orchestrator: Orchestrator | None = None
        self._serving = False
        self._health_serving: bool | None = None
        self._server: grpc.aio.Server | None = None
        self._registry_server: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []
        self.registry.on_remove.append(self._on_worker_removed)
        self.planner = Planner(config.planner)
        self.planner_metrics = PlannerMetrics(self.metrics)

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def registry_address(self) -> str:
        """Where workers register (`--gateway` of a worker)."""
        return f"{self.config.host}:{self.registry_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    @property
    def serving(self) -> bool:
        return self._serving

    def ready(self) -> bool:
        """A request sent now would be routed: started, not stopping, a live decode worker,
        and a live prefill worker when static ones are configured."""
        return (self._serving and bool(self.registry.alive(Role.DECODE))
                and (not self.config.prefill or bool(self.registry.alive(Role.PREFILL))))

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        cfg.credentials.require_for(cfg.host, "the gateway's registry listener")
        # the public port: clients carry no cluster credential. Both servers answer from
        # the moment they listen (UNAVAILABLE until their servicers are in), never holding
        # a connection while the tokenizer loads (grpc_refusal.LateServices)
        self._server = rpc.server(cfg.credentials, internal=False,
                                  interceptors=(MalformedRequests(),))
        starting = "the gateway is starting: its tokenizer is still loading"
        public = LateServices(starting)
        self._server.add_generic_rpc_handlers((public,))
        self.health = GrpcHealth(self._server, (GATEWAY_SERVICE,))
        await self._set_health(False)
        self.grpc_port = rpc.add_port(self._server, f"{cfg.host}:{cfg.grpc_port}", None)
        self._registry_server = rpc.server(cfg.credentials)
        registry = LateServices(starting)
        self._registry_server.add_generic_rpc_handlers((registry,))
        self.registry_health = GrpcHealth(self._registry_server, (REGISTRY_SERVICE,))
        await self.registry_health.set_serving(False)
        self.registry_port = rpc.add_port(self._registry_server,
                                          f"{cfg.host}:{cfg.registry_port}", cfg.credentials)
        await self._server.start()
        await self._registry_server.start()

        source = resolve_model(cfg.model)
        # one thread: transformers' lazy imports are not safe to race
        hf_config, tokenizer, own = await asyncio.to_thread(
            lambda: (load_config(source), load_tokenizer(source), fingerprint.of_source(source)))
        max_ctx = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
        self.prompts = PromptProcessor(cfg.model, tokenizer, max_ctx,
                                       int(hf_config.vocab_size), cfg.default_max_tokens)
        self.orchestrator = Orchestrator(self.registry, self.channels, self.admission,
                                         self.metrics, tokenizer, cfg.disagg_threshold,
                                         cfg.rpc_timeout_s, cfg.stream_idle_s,
                                         reader_timeout_s=cfg.reader_timeout_s)
        servicer = GatewayServicer(self.prompts, self.orchestrator, self.registry)
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, public)
        public.opened()
        gateway_pb2_grpc.add_WorkerRegistryServicer_to_server(
            RegistryServicer(self.registry, own,
                             heartbeat_interval_s=min(1.0, cfg.heartbeat_timeout_s / 3)),
            registry)
        registry.opened()

        http = OpenAIServer(self.prompts, self.orchestrator, self.registry, self.metrics,
                            self.ready, cfg.max_body_bytes, cfg.reader_timeout_s)
        self._runner = web.AppRunner(http.app(), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=cfg.grace_s)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.http_port))
        self.http_port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

        for addr in cfg.prefill:
            self.registry.add_static(Role.PREFILL, addr)
        for addr in cfg.decode:
            self.registry.add_static(Role.DECODE, addr)
        await self._poll_static_once()
        self._serving = True
        await self.registry_health.set_serving(True)
        self._tasks = [asyncio.create_task(self._sweep_loop()),
                       asyncio.create_task(self._poll_loop()),
                       asyncio.create_task(self._readiness_loop())]
        if cfg.planner.mode is not PlannerMode.OFF:
            self._tasks.append(asyncio.create_task(self._planner_loop()))
        await self._update_health()
        log.info("gateway %s serving %s: gRPC %s, HTTP %s, registry %s (%s; pid %d)",
                 self.gateway_id, cfg.model, self.grpc_address, self.http_url,
                 self.registry_address, _describe(cfg.credentials), os.getpid())

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.config.grace_s if grace_s is None else grace_s
        self._serving = False
        if self.health is not None:
            await self._set_health(False)
        if self.registry_health is not None:
            await self.registry_health.set_serving(False)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._server is not None:
            await self._server.stop(grace)
        if self._registry_server is not None:
            await self._registry_server.stop(grace)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.orchestrator is not None:
            await self.orchestrator.drain(grace)
        await self.channels.close_all()
        if self.prompts is not None:
            self.prompts.close()
        log.info("gateway %s stopped", self.gateway_id)

    async def _readiness_loop(self) -> None:
        # workers come and go by registration, heartbeat silence and polling: follow them
        while True:
            await asyncio.sleep(0.1)
            await self._update_health()

    async def _update_health(self) -> None:
        ready = self.ready()
        if ready != self._health_serving:
            await self._set_health(ready)

    async def _set_health(self, serving: bool) -> None:
        self._health_serving = serving
        assert self.health is not None
        await self.health.set_serving(serving)

    # -- housekeeping -----------------------------------------------------------------------
    async def _sweep_loop(self) -> None:
        period = max(0.05, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            for w in self.registry.expire():
                reason = f"missed heartbeats for {self.config.heartbeat_timeout_s:g}s"
                log.warning("%s worker %s at %s %s: dropped", w.role.value, w.worker_id,
                            w.address, reason)
                if self.orchestrator is not None:
                    # its calls in flight end now, not at their deadlines: their requests
                    # fail over or migrate (gateway/inflight.py)
                    self.orchestrator.drop_worker(w, reason)

    async def _poll_loop(self) -> None:
        period = max(0.05, min(1.0, self.config.heartbeat_timeout_s / 3))
        while True:
            await asyncio.sleep(period)
            await self._poll_static_once()

    async def _poll_static_once(self) -> None:
        workers = self.registry.static_workers()
        if workers:
            await asyncio.gather(*(self._poll(w) for w in workers))

    async def _poll(self, w: Worker) -> None:
        stubs = self.channels.get(w.address)
        stub = stubs.decode if w.role is Role.DECODE else stubs.prefill
        try:
            s = await stub.Stats(common_pb2.StatsRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            log.debug("Stats from %s failed: %s", w.address, e.code().name)
            return
        self.registry.observe(w.worker_id, s.model, kv_spec_from_proto(s.kv_spec),
                              load_from_proto(s.load))

    # -- planner --------------------------------------------------------------------------
    async def _planner_loop(self) -> None:
        cfg = self.config.planner
        # TPOT is the SLO's: a request's own (last token - first token) / (tokens - 1), the
        # histogram /metrics exports and the bench scores, averaged over the requests that
        # finished in the window and those still streaming with at least LIVE_TPOT_TOKENS
        # tokens (their TPOT so far). Finished requests alone show a slowdown only once
        # they end: with 256-token outputs ~40 s late, after a 60 s load phase was over
        # (docs/benchmarks.md section 7). A mean of every streamed gap instead would weight
        # a request by its length, and a young stream's first gap (KV transfer, admission)
        # is not yet diluted by the tokens after it: hence the minimum
        ttft, tpot = WindowedMean(cfg.window_s), WindowedMean(cfg.window_s)
        while True:
            await asyncio.sleep(cfg.interval_s)
            now = time.monotonic()
            timers = self.orchestrator.streaming if self.orchestrator is not None else ()
            streaming = (t.tpot() for t in timers if t.count >= LIVE_TPOT_TOKENS)
            signals = Signals(now, tuple(self.registry.alive(Role.PREFILL)),
                              tuple(self.registry.alive(Role.DECODE)),
                              ttft.add(now, *histogram_totals(self.metrics.ttft)),
                              decode_tpot(tpot.totals(now, *histogram_totals(self.metrics.tpot)),
                                          streaming))
            try:
                d = self.planner.observe(signals)
                for role in Role:
                    self.planner_metrics.workers(role.value, d.desired[role], d.actual[role],
                                                 d.pressure[role])
                if d.switch is not None:
                    await self._order_switch(d.switch)
            except Exception:  # a bug must not end planning for the gateway's life
                log.exception("planner: tick failed")

    async def _order_switch(self, sw: Switch) -> None:
        log.info("planner: switching worker %s at %s to %s: %s", sw.worker_id, sw.address,
                 sw.to.value, sw.reason)
        stub = gateway_pb2_grpc.WorkerControlStub(self.channels.get(sw.address).channel)
        role = (gateway_pb2.WORKER_ROLE_PREFILL if sw.to is Role.PREFILL
                else gateway_pb2.WORKER_ROLE_DECODE)
        try:
            await stub.SwitchRole(gateway_pb2.SwitchRoleRequest(role=role),
                                  timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("planner: worker %s refused the switch to %s: %s %s", sw.worker_id,
                        sw.to.value, e.code().name, e.details())
            self.planner.abandon()
            return
        self.planner_metrics.switched(sw.to.value)

    def _on_worker_removed(self, w: Worker) -> None:
        in_use = any(x.address == w.address for x in self.registry.all())
        busy = self.orchestrator is not None and self.orchestrator.inflight.get(w.worker_id)
        if not in_use and not busy:
            self.channels.close_soon(w.address)

    def _decode_kv_usage(self) -> float:
        ws = self.registry.alive(Role.DECODE)
        total = sum(w.load.total_blocks for w in ws)
        return 0.0 if total == 0 else 1.0 - sum(w.load.free_blocks for w in ws) / total


def _describe(creds: ClusterCredentials) -> str:
    parts = (["cluster token"] if creds.token else []) + (["mTLS"] if creds.tls else [])
    return " + ".join(parts) or "no cluster credential: loopback only"
