"""PrefillWorker: one prefill-tier process — the engine thread with the KV pusher hooked
into its forward, the PrefillWorker gRPC service, /metrics, and registration with the
gateway, heartbeating its load and the prefix hashes it caches (life cycle in
`pdserve.worker_runtime.WorkerBase`)."""

from __future__ import annotations

import asyncio

from pdserve.kvtransfer.grpc_sender import GrpcKVTransport
from pdserve.prefill_worker.kv_pusher import KVPusher
from pdserve.prefill_worker.service import DEFAULT_MAX_QUEUE, PrefillService
from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.worker_runtime import WorkerBase, WorkerConfig

MAX_REPORTED_HASHES = 8192  # bounds the heartbeat; the oldest prefixes are dropped first


class PrefillWorker(WorkerBase):
    role = "prefill"
    role_proto = gateway_pb2.WORKER_ROLE_PREFILL
    service_names = (prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name,)

    def __init__(self, config: WorkerConfig, engine=None, max_chunk_bytes: int = 1 << 20,
                 max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        super().__init__(config, engine)
        self.max_chunk_bytes = max_chunk_bytes
        self.max_queue = max_queue
        self._hashes: list[int] = []
        self._hash_task: asyncio.Task | None = None

    def add_services(self, server) -> None:
        self.pusher = KVPusher(self.engine.kv_cache)
        self.engine.kv_layer_hook = self.pusher.on_layer
        self.transport = GrpcKVTransport(max_chunk_bytes=self.max_chunk_bytes,
                                         timeout_s=self.config.rpc_timeout_s)
        self.service = PrefillService(self.aengine, self.pusher, self.transport, self.metrics,
                                      self.stats, max_queue=self.max_queue,
                                      commit_timeout_s=self.config.rpc_timeout_s)
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(self.service, server)
        if self.config.gateway:
            self._hash_task = asyncio.get_running_loop().create_task(self._refresh_hashes())

    async def stop_tier(self) -> None:
        if self._hash_task is not None:
            self._hash_task.cancel()
        if hasattr(self, "transport"):
            self.transport.close()

    async def _refresh_hashes(self) -> None:
        # read on the engine thread, between steps: the pool is the engine's alone
        while True:
            hashes = await self.aengine.run_in_engine(lambda e: e.pool.cached_hashes())
            self._hashes = hashes[-MAX_REPORTED_HASHES:]
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def busy(self) -> bool:
        return super().busy() or bool(self.service.in_flight)

    def load(self) -> common_pb2.WorkerLoad:
        load = super().load()
        load.queue_depth = self.service.in_flight
        load.cached_block_hashes.extend(self._hashes)
        return load
