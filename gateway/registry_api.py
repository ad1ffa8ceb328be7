"""The gRPC face of the worker registry: `pdserve.v1.WorkerRegistry`, served only on the
gateway's internal registry listener, behind the cluster credential (its server checks
the token and, with mTLS, the client certificate before a call gets here).

A registration is refused with
  INVALID_ARGUMENT     a malformed WorkerInfo (the details name the field)
  FAILED_PRECONDITION  a fingerprint that differs from the gateway's (weights, tokenizer,
                       proto or pdserve version): such a worker would pair silently with
                       the others and produce garbage
  PERMISSION_DENIED    a worker id live at another address (no takeover)
"""

from __future__ import annotations

import logging

import grpc

from pdserve import fingerprint
from pdserve.gateway.convert import kv_spec_from_proto, load_from_proto
from pdserve.gateway.registry import Role, WorkerIdTaken, WorkerRegistry
from pdserve.protos.pdserve.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("pdserve.gateway")

_ROLES = {gateway_pb2.WORKER_ROLE_PREFILL: Role.PREFILL,
          gateway_pb2.WORKER_ROLE_DECODE: Role.DECODE}


class RegistryServicer(gateway_pb2_grpc.WorkerRegistryServicer):
    def __init__(self, registry: WorkerRegistry, expected: fingerprint.Fingerprint,
                 heartbeat_interval_s: float) -> None:
        self.registry = registry
        self.expected = expected
        self.heartbeat_interval_s = heartbeat_interval_s

    async def RegisterWorker(self, request: gateway_pb2.RegisterWorkerRequest,
                             context: grpc.aio.ServicerContext
                             ) -> gateway_pb2.RegisterWorkerResponse:
        w = request.worker
        role = _ROLES.get(w.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "worker.role: must be PREFILL or DECODE")
        if not w.HasField("fingerprint"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "worker.fingerprint: missing (a pdserve older than the gateway)")
        diff = self.expected.differences(fingerprint.from_proto(w.fingerprint))
        if diff:
            log.error("refused %s worker %s at %s: its %s differ from the gateway's (model "
                      "%r): it serves another model, tokenizer or protocol", role.value,
                      w.worker_id, w.address, ", ".join(diff), w.model)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"worker.fingerprint: {', '.join(diff)} differ from the "
                                "gateway's")
        try:
            self.registry.register(w.worker_id, role, w.address, w.model,
                                   kv_spec_from_proto(w.kv_spec), load_from_proto(w.load),
                                   switchable=w.switchable)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker.{e}")
        except WorkerIdTaken as e:
            log.warning("refused worker %s at %s: %s", w.worker_id, w.address, e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"worker.worker_id: {e}")
        log.info("registered %s worker %s at %s", role.value, w.worker_id, w.address)
        return gateway_pb2.RegisterWorkerResponse(
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.registry.heartbeat_timeout_s)

    async def Heartbeat(self, request: gateway_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> gateway_pb2.HeartbeatResponse:
        known = self.registry.heartbeat(request.worker_id, load_from_proto(request.load))
        return gateway_pb2.HeartbeatResponse(known=known)

    async def Deregister(self, request: gateway_pb2.DeregisterRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.DeregisterResponse:
        known = self.registry.deregister(request.worker_id)
        if known:
            log.info("deregistered worker %s", request.worker_id)
        return gateway_pb2.DeregisterResponse(known=known)
