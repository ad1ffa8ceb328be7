"""DecodeWorker: one decode-tier process — engine thread, DecodeWorker + KVTransfer gRPC
services on one port, /metrics, and registration with the gateway.

    start(): load model -> bind gRPC (health NOT_SERVING) -> engine thread -> SERVING
             -> register + heartbeat
    stop():  NOT_SERVING -> deregister -> grpc stop(grace) -> engine thread stops
"""

from __future__ import annotations

import asyncio
import logging

from decode_worker.reservations import ReservationTable
from decode_worker.service import DecodeService
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from kvtransfer.receiver import KVTransferService
from pdserve.convert import kv_spec_to_proto
from pdserve.metrics import TierMetrics
from pdserve.worker_runtime import (
    GatewayRegistration,
    GrpcService,
    MetricsServer,
    WorkerConfig,
    new_worker_id,
)
from protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2

log = logging.getLogger("pdserve.decode")


class DecodeWorker:
    role = "decode"

    def __init__(self, config: WorkerConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.worker_id = config.worker_id or new_worker_id(self.role)
        self._engine = engine  # tests may share one loaded engine
        self.grpc: GrpcService | None = None
        self.address = ""
        self.metrics_server: MetricsServer | None = None
        self.registration: GatewayRegistration | None = None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server else None

    async def start(self) -> None:
        cfg = self.config
        self.grpc = GrpcService(cfg.host, cfg.port)
        await self.grpc.start()  # health answers NOT_SERVING while the model loads
        self.address = cfg.advertise_address or f"{cfg.host}:{self.grpc.port}"
        engine = self._engine or await asyncio.to_thread(LLMEngine, cfg.engine)
        self.engine = engine
        self.model_name = cfg.engine.model
        self.metrics = TierMetrics(self.model_name, self.role, self.worker_id)
        self.aengine = AsyncEngine(engine)
        self.aengine.start()
        self.table = ReservationTable(self.aengine, cfg.reservation_timeout_s,
                                      on_expired=lambda _: self.metrics.reservations_expired.inc())
        self.table.start()
        self.service = DecodeService(self.aengine, self.table, self.metrics, self.stats)
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(self.service, self.grpc.server)
        self.kv_receiver = KVTransferService(self.table)
        self.kv_receiver.add_to_server(self.grpc.server)
        self.grpc.add_service_name(decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"]
                                   .full_name)
        self.grpc.add_service_name("pdserve.v1.KVTransfer")
        if cfg.metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics, self.refresh_metrics)
            await self.metrics_server.start(cfg.host, cfg.metrics_port)
        await self.grpc.set_serving(True)
        if cfg.gateway:
            self.registration = GatewayRegistration(cfg.gateway, self.worker_info, self.load,
                                                    cfg.heartbeat_interval_s)
            self.registration.start()
        log.info("decode worker %s serving on %s", self.worker_id, self.address)

    async def stop(self, grace: float = 2.0) -> None:
        if self.grpc is not None:
            await self.grpc.set_serving(False)
        if self.registration is not None:
            await self.registration.stop()
        if self.grpc is not None:
            await self.grpc.stop(grace)
        if hasattr(self, "table"):
            await self.table.stop()
            await self.aengine.stop()
        if self.metrics_server is not None:
            await self.metrics_server.stop()

    # -- load and metrics -------------------------------------------------------------------
    def load(self) -> common_pb2.WorkerLoad:
        s = self.aengine.stats()
        return common_pb2.WorkerLoad(
            num_running=s.running, num_waiting=s.waiting + s.reserved, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, tokens_per_s=s.tokens_per_s,
            queue_depth=s.waiting + s.reserved)

    def worker_info(self) -> gateway_pb2.WorkerInfo:
        return gateway_pb2.WorkerInfo(
            worker_id=self.worker_id, role=gateway_pb2.WORKER_ROLE_DECODE, address=self.address,
            model=self.model_name, kv_spec=kv_spec_to_proto(self.engine.kv_spec),
            load=self.load())

    async def stats(self) -> common_pb2.StatsResponse:
        return common_pb2.StatsResponse(worker_id=self.worker_id, model=self.model_name,
                                        load=self.load(),
                                        kv_spec=kv_spec_to_proto(self.engine.kv_spec))

    def refresh_metrics(self) -> None:
        self.metrics.observe_engine(self.aengine.stats())
        self.metrics.set_counter_to(self.metrics.kv_transfer_failures,
                                    self.kv_receiver.num_rejected)

