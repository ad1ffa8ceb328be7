"""PrefillWorker: one prefill-tier process — engine thread with the KV pusher hooked into
its forward, the PrefillWorker gRPC service, /metrics, registration with the gateway.

    start(): bind gRPC (health NOT_SERVING) -> load model -> engine thread -> SERVING
             -> register + heartbeat (load and cached prefix hashes)
    stop():  NOT_SERVING -> deregister -> grpc stop(grace) -> engine thread stops
"""

from __future__ import annotations

import asyncio
import logging

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from kvtransfer.grpc_sender import GrpcKVTransport
from pdserve.convert import kv_spec_to_proto
from pdserve.metrics import TierMetrics
from pdserve.worker_runtime import (
    GatewayRegistration,
    GrpcService,
    MetricsServer,
    WorkerConfig,
    new_worker_id,
)
from prefill_worker.kv_pusher import KVPusher
from prefill_worker.service import PrefillService
from protos.pdserve.v1 import common_pb2, gateway_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("pdserve.prefill")

MAX_REPORTED_HASHES = 8192  # bounds the heartbeat; the oldest prefixes are dropped first


class PrefillWorker:
    role = "prefill"

    def __init__(self, config: WorkerConfig, engine: LLMEngine | None = None,
                 max_chunk_bytes: int = 1 << 20) -> None:
        self.config = config
        self.worker_id = config.worker_id or new_worker_id(self.role)
        self._engine = engine
        self.max_chunk_bytes = max_chunk_bytes
        self.grpc: GrpcService | None = None
        self.address = ""
        self.metrics_server: MetricsServer | None = None
        self.registration: GatewayRegistration | None = None
        self._hashes: list[int] = []

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    async def start(self) -> None:
        cfg = self.config
        self.grpc = GrpcService(cfg.host, cfg.port)
        await self.grpc.start()
        self.address = cfg.advertise_address or f"{cfg.host}:{self.grpc.port}"
        engine = self._engine or await asyncio.to_thread(LLMEngine, cfg.engine)
        self.engine = engine
        self.model_name = cfg.engine.model
        self.metrics = TierMetrics(self.model_name, self.role, self.worker_id)
        self.pusher = KVPusher(engine.kv_cache)
        engine.kv_layer_hook = self.pusher.on_layer
        self.transport = GrpcKVTransport(max_chunk_bytes=self.max_chunk_bytes)
        self.aengine = AsyncEngine(engine)
        self.aengine.start()
        self.service = PrefillService(self.aengine, self.pusher, self.transport, self.metrics,
                                      self.stats)
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(self.service, self.grpc.server)
        self.grpc.add_service_name(prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"]
                                   .full_name)
        if cfg.metrics_port is not None:
            self.metrics_server = MetricsServer(
                self.metrics, lambda: self.metrics.observe_engine(self.aengine.stats()))
            await self.metrics_server.start(cfg.host, cfg.metrics_port)
        await self.grpc.set_serving(True)
        if cfg.gateway:
            self.registration = GatewayRegistration(cfg.gateway, self.worker_info, self.load,
                                                    cfg.heartbeat_interval_s)
            self._hash_task = asyncio.create_task(self._refresh_hashes())
            self.registration.start()
        log.info("prefill worker %s serving on %s", self.worker_id, self.address)

    async def stop(self, grace: float = 2.0) -> None:
        if self.grpc is not None:
            await self.grpc.set_serving(False)
        if self.registration is not None:
            self._hash_task.cancel()
            await self.registration.stop()
        if self.grpc is not None:
            await self.grpc.stop(grace)
        if hasattr(self, "aengine"):
            await self.aengine.stop()
            self.transport.close()
        if self.metrics_server is not None:
            await self.metrics_server.stop()

    async def _refresh_hashes(self) -> None:
        # read on the engine thread, between steps: the pool is the engine's alone
        while True:
            hashes = await self.aengine.run_in_engine(lambda e: e.pool.cached_hashes())
            self._hashes = hashes[-MAX_REPORTED_HASHES:]
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def load(self) -> common_pb2.WorkerLoad:
        s = self.aengine.stats()
        return common_pb2.WorkerLoad(
            num_running=s.running, num_waiting=s.waiting, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, tokens_per_s=s.tokens_per_s,
            queue_depth=self.service.in_flight, cached_block_hashes=self._hashes)

    def worker_info(self) -> gateway_pb2.WorkerInfo:
        return gateway_pb2.WorkerInfo(
            worker_id=self.worker_id, role=gateway_pb2.WORKER_ROLE_PREFILL, address=self.address,
            model=self.model_name, kv_spec=kv_spec_to_proto(self.engine.kv_spec),
            load=self.load())

    async def stats(self) -> common_pb2.StatsResponse:
        return common_pb2.StatsResponse(worker_id=self.worker_id, model=self.model_name,
                                        load=self.load(),
                                        kv_spec=kv_spec_to_proto(self.engine.kv_spec))
