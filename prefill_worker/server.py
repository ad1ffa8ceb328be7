"""PrefillWorker: one prefill-tier process — the engine thread (whose KV connector saves
each prompt's KV into a push stream), the PrefillWorker gRPC service, /metrics, and
registration with the gateway, heartbeating its load and the prefix hashes it caches, read
from the engine's stats (life cycle in `pdserve.worker_runtime.WorkerBase`)."""

from __future__ import annotations

from pdserve.kvtransfer.shm_sender import ShmKVTransport
from pdserve.prefill_worker.service import DEFAULT_MAX_QUEUE, PrefillService
from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.worker_runtime import WorkerBase, WorkerConfig

MAX_REPORTED_HASHES = 8192  # bounds the heartbeat; the oldest prefixes are dropped first


class PrefillWorker(WorkerBase):
    role = "prefill"
    role_proto = gateway_pb2.WORKER_ROLE_PREFILL
    service_names = (prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name,)
    max_prefix_hashes = MAX_REPORTED_HASHES

    def __init__(self, config: WorkerConfig, engine=None, max_chunk_bytes: int = 1 << 20,
                 max_queue: int = DEFAULT_MAX_QUEUE, kv_transport: str = "auto") -> None:
        """kv_transport: `pdserve.kvtransfer.shm_sender.ShmKVTransport`'s mode."""
        super().__init__(config, engine)
        self.max_chunk_bytes = max_chunk_bytes
        self.max_queue = max_queue
        self.kv_transport = kv_transport

    def add_services(self, server) -> None:
        self.transport = ShmKVTransport(self.kv_transport,
                                        max_chunk_bytes=self.max_chunk_bytes,
                                        credentials=self.config.credentials,
                                        timeout_s=self.config.rpc_timeout_s)
        self.service = PrefillService(self.aengine, self.transport, self.metrics, self.stats,
                                      max_queue=self.max_queue,
                                      commit_timeout_s=self.config.rpc_timeout_s)
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(self.service, server)

    async def stop_tier(self) -> None:
        if hasattr(self, "transport"):
            self.transport.close()

    def busy(self) -> bool:
        return super().busy() or bool(self.service.in_flight)

    def load(self) -> common_pb2.WorkerLoad:
        load = super().load()
        load.queue_depth = self.service.in_flight
        # the engine thread publishes them with its stats: the pool is the engine's alone
        load.cached_block_hashes.extend(self.aengine.stats().prefix_hashes)
        return load
