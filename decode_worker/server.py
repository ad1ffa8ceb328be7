"""DecodeWorker: one decode-tier process — the engine thread, the DecodeWorker and
KVTransfer gRPC services on one port, /metrics, and registration with the gateway
(life cycle in `pdserve.worker_runtime.WorkerBase`). With `kv_transport` other than
"grpc" it also owns the pool of shared-memory segments it offers same-host prefill workers
at Reserve (`pdserve.kvtransfer.shm`), created with the services and unlinked at stop.

`DecodeTier` is the tier's part of a worker — reservation table, servicers, load — so that
a worker able to switch role (`pdserve.role_worker`) hosts it beside the prefill tier's."""

from __future__ import annotations

from pdserve.decode_worker.reservations import ReservationTable
from pdserve.decode_worker.service import DecodeService
from pdserve.kvtransfer.receiver import KVTransferService
from pdserve.kvtransfer.shm import DEFAULT_POOL_BYTES, ShmSegmentPool, host_id
from pdserve.protos.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    kvtransfer_pb2,
)
from pdserve.worker_runtime import WorkerBase, WorkerConfig

ROLE = "decode"
ROLE_PROTO = gateway_pb2.WORKER_ROLE_DECODE
SERVICE_NAMES = (decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
                 kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name)
# the calls that start new decode work (a reservation, a colocated request): a worker leaving
# the tier refuses them; Decode on a reservation already made, Cancel and KV pushes go on
GENERATE_METHOD = f"/{SERVICE_NAMES[0]}/Generate"
NEW_WORK_METHODS = frozenset({f"/{SERVICE_NAMES[0]}/Reserve", GENERATE_METHOD})


class DecodeTier:
    """The reservation table, DecodeWorker and KVTransfer servicers on `worker`'s server."""

    def __init__(self, worker: WorkerBase, server, kv_transport: str = "auto",
                 kv_shm_bytes: int = DEFAULT_POOL_BYTES) -> None:
        """kv_transport: "grpc" offers no shared memory; "shm" and "auto" offer it when
        this host has an id. kv_shm_bytes bounds the segments held at once."""
        self.aengine = worker.aengine
        self.metrics = worker.metrics
        host = host_id() if kv_transport != "grpc" else None
        shm = self.shm = ShmSegmentPool(host, kv_shm_bytes) if host is not None else None
        self.table = ReservationTable(
            worker.aengine, worker.config.reservation_timeout_s,
            on_expired=lambda _: worker.metrics.reservations_expired.inc(),
            on_released=lambda rid: shm.finish(rid, clean=False) if shm else None)
        self.table.start()
        self.service = DecodeService(worker.aengine, self.table, worker.metrics, worker.stats,
                                     shm, keepalive_s=worker.config.stream_keepalive_s,
                                     stream_interval=worker.config.stream_interval,
                                     colocated_refusal=lambda: server.refuse(GENERATE_METHOD))
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(self.service, server)
        self.kv_receiver = KVTransferService(self.table, shm)
        self.kv_receiver.add_to_server(server)

    def load(self) -> common_pb2.WorkerLoad:
        # reservations waiting for their KV count as queued work
        s = self.aengine.stats()
        return common_pb2.WorkerLoad(
            num_running=s.running, num_waiting=s.waiting + s.reserved, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, tokens_per_s=s.tokens_per_s,
            queue_depth=s.waiting + s.reserved)

    def refresh_metrics(self) -> None:
        self.metrics.set_counter_to(self.metrics.kv_transfer_failures,
                                    self.kv_receiver.num_rejected)
        self.metrics.set_counter_to(self.metrics.kv_received_bytes,
                                    self.kv_receiver.bytes_received)

    async def close(self) -> None:
        await self.table.stop()
        if self.shm is not None:
            self.shm.close()


class DecodeWorker(WorkerBase):
    role = ROLE
    role_proto = ROLE_PROTO
    service_names = SERVICE_NAMES

    def __init__(self, config: WorkerConfig, engine=None, kv_transport: str = "auto",
                 kv_shm_bytes: int = DEFAULT_POOL_BYTES) -> None:
        super().__init__(config, engine)
        self.kv_transport = kv_transport
        self.kv_shm_bytes = kv_shm_bytes

    def add_services(self, server) -> None:
        self.tier = DecodeTier(self, server, self.kv_transport, self.kv_shm_bytes)
        self.table, self.service = self.tier.table, self.tier.service
        self.kv_receiver, self.shm = self.tier.kv_receiver, self.tier.shm

    def end_sessions(self) -> None:
        if hasattr(self, "tier"):
            self.tier.service.end_sessions()

    async def stop_tier(self) -> None:
        if hasattr(self, "tier"):
            await self.tier.close()

    def load(self) -> common_pb2.WorkerLoad:
        return self.tier.load()

    def refresh_metrics(self) -> None:
        super().refresh_metrics()
        self.tier.refresh_metrics()
