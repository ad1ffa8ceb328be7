"""DecodeWorker: one decode-tier process — the engine thread, the DecodeWorker and
KVTransfer gRPC services on one port, /metrics, and registration with the gateway
(life cycle in `pdserve.worker_runtime.WorkerBase`). With `kv_transport` other than
"grpc" it also owns the pool of shared-memory segments it offers same-host prefill workers
at Reserve (`pdserve.kvtransfer.shm`), created with the services and unlinked at stop."""

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


class DecodeWorker(WorkerBase):
    role = "decode"
    role_proto = gateway_pb2.WORKER_ROLE_DECODE
    service_names = (decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
                     kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name)

    def __init__(self, config: WorkerConfig, engine=None, kv_transport: str = "auto",
                 kv_shm_bytes: int = DEFAULT_POOL_BYTES) -> None:
        """kv_transport: "grpc" offers no shared memory; "shm" and "auto" offer it when
        this host has an id. kv_shm_bytes bounds the segments held at once."""
        super().__init__(config, engine)
        self.kv_transport = kv_transport
        self.kv_shm_bytes = kv_shm_bytes
        self.shm: ShmSegmentPool | None = None

    def add_services(self, server) -> None:
        host = host_id() if self.kv_transport != "grpc" else None
        if host is not None:
            self.shm = ShmSegmentPool(host, self.kv_shm_bytes)
        shm = self.shm
        self.table = ReservationTable(
            self.aengine, self.config.reservation_timeout_s,
            on_expired=lambda _: self.metrics.reservations_expired.inc(),
            on_released=lambda rid: shm.finish(rid, clean=False) if shm else None)
        self.table.start()
        self.service = DecodeService(self.aengine, self.table, self.metrics, self.stats, shm,
                                     keepalive_s=self.config.stream_keepalive_s)
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(self.service, server)
        self.kv_receiver = KVTransferService(self.table, shm)
        self.kv_receiver.add_to_server(server)

    async def stop_tier(self) -> None:
        if hasattr(self, "table"):
            await self.table.stop()
        if self.shm is not None:
            self.shm.close()

    def load(self) -> common_pb2.WorkerLoad:
        # reservations waiting for their KV count as queued work
        s = self.aengine.stats()
        return common_pb2.WorkerLoad(
            num_running=s.running, num_waiting=s.waiting + s.reserved, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, tokens_per_s=s.tokens_per_s,
            queue_depth=s.waiting + s.reserved)

    def refresh_metrics(self) -> None:
        super().refresh_metrics()
        self.metrics.set_counter_to(self.metrics.kv_transfer_failures,
                                    self.kv_receiver.num_rejected)
        self.metrics.set_counter_to(self.metrics.kv_received_bytes,
                                    self.kv_receiver.bytes_received)
