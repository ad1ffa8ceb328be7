"""PrefillWorker: one prefill-tier process — the engine thread (whose KV connector saves
each prompt's KV into a push stream), the PrefillWorker gRPC service, /metrics, and
registration with the gateway, heartbeating its load and the prefix hashes it caches, read
from the engine's stats (life cycle in `pdserve.worker_runtime.WorkerBase`).

`PrefillTier` is the tier's part of a worker — its servicer, KV transport, busy and load —
so that a worker able to switch role (`pdserve.role_worker`) hosts it beside the decode
tier's."""

from __future__ import annotations

from pdserve.kvtransfer.shm_sender import ShmKVTransport
from pdserve.prefill_worker.service import DEFAULT_MAX_QUEUE, PrefillService
from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.worker_runtime import WorkerBase, WorkerConfig

MAX_REPORTED_HASHES = 8192  # bounds the heartbeat; the oldest prefixes are dropped first
ROLE = "prefill"
ROLE_PROTO = gateway_pb2.WORKER_ROLE_PREFILL
SERVICE_NAMES = (prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name,)
# the calls that start new prefill work: a worker leaving the tier refuses them
NEW_WORK_METHODS = frozenset({f"/{SERVICE_NAMES[0]}/Prefill"})


class PrefillTier:
    """The prefill servicer and KV push transport on `worker`'s server."""

    def __init__(self, worker: WorkerBase, server, max_chunk_bytes: int = 1 << 20,
                 max_queue: int = DEFAULT_MAX_QUEUE, kv_transport: str = "auto") -> None:
        """kv_transport: `pdserve.kvtransfer.shm_sender.ShmKVTransport`'s mode."""
        cfg = worker.config
        self.aengine = worker.aengine
        self.transport = ShmKVTransport(kv_transport, max_chunk_bytes=max_chunk_bytes,
                                        credentials=cfg.credentials, timeout_s=cfg.rpc_timeout_s)
        self.service = PrefillService(worker.aengine, self.transport, worker.metrics,
                                      worker.stats, max_queue=max_queue,
                                      commit_timeout_s=cfg.rpc_timeout_s)
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(self.service, server)

    def busy(self) -> bool:
        return bool(self.service.in_flight)

    def load(self, load: common_pb2.WorkerLoad) -> common_pb2.WorkerLoad:
        load.queue_depth = self.service.in_flight
        # the engine thread publishes them with its stats: the pool is the engine's alone
        load.cached_block_hashes.extend(self.aengine.stats().prefix_hashes)
        return load

    def close(self) -> None:
        self.transport.close()


class PrefillWorker(WorkerBase):
    role = ROLE
    role_proto = ROLE_PROTO
    service_names = SERVICE_NAMES
    max_prefix_hashes = MAX_REPORTED_HASHES

    def __init__(self, config: WorkerConfig, engine=None, max_chunk_bytes: int = 1 << 20,
                 max_queue: int = DEFAULT_MAX_QUEUE, kv_transport: str = "auto") -> None:
        super().__init__(config, engine)
        self.max_chunk_bytes = max_chunk_bytes
        self.max_queue = max_queue
        self.kv_transport = kv_transport

    def add_services(self, server) -> None:
        self.tier = PrefillTier(self, server, self.max_chunk_bytes, self.max_queue,
                                self.kv_transport)
        self.transport = self.tier.transport
        self.service = self.tier.service

    async def stop_tier(self) -> None:
        if hasattr(self, "tier"):
            self.tier.close()

    def busy(self) -> bool:
        return super().busy() or self.tier.busy()

    def load(self) -> common_pb2.WorkerLoad:
        return self.tier.load(super().load())
