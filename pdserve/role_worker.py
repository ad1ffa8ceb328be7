"""RoleWorker: a worker process that hosts both tiers' servicers on one port over one
engine and serves one role at a time, which the gateway's planner may switch
(`WorkerControl.SwitchRole`). `python -m pdserve.role_worker --role prefill|decode` runs
one; the single-tier workers (`pdserve.prefill_worker`, `pdserve.decode_worker`) stay as
they are and are never switched.

A switch, prefill -> decode or back:

    serving R ──SwitchRole(R')──▶ draining: deregistered from every gateway; calls that
        start new work of either role are refused with UNAVAILABLE (the gateway tries the
        next worker); in-flight requests finish, open reservations commit or expire, KV
        pushes for them still arrive — for up to drain_timeout_s
    ──▶ serving R': registers with every gateway under R'

The engine, its KV pool and its prefix cache stay; only what the gateway routes here
changes. Heartbeats report the current role's load.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import grpc

from pdserve import event_loop
from pdserve.decode_worker import server as decode
from pdserve.prefill_worker import server as prefill
from pdserve.prefill_worker.service import DEFAULT_MAX_QUEUE
from pdserve.protos.pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pdserve.worker_runtime import (
    WorkerBase,
    WorkerConfig,
    add_worker_args,
    run_until_signal,
    worker_config_from_args,
)

log = logging.getLogger("pdserve.worker")

CONTROL_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name
ROLES = {prefill.ROLE: prefill.ROLE_PROTO, decode.ROLE: decode.ROLE_PROTO}
_NEW_WORK = {prefill.ROLE: prefill.NEW_WORK_METHODS, decode.ROLE: decode.NEW_WORK_METHODS}


class SwitchInProgress(Exception):
    """A switch to the other role is already draining."""


class RoleWorker(WorkerBase):
    switchable = True
    service_names = (*prefill.SERVICE_NAMES, *decode.SERVICE_NAMES, CONTROL_SERVICE)
    max_prefix_hashes = prefill.MAX_REPORTED_HASHES

    def __init__(self, config: WorkerConfig, role: str, engine=None,
                 max_chunk_bytes: int = 1 << 20, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if role not in ROLES:
            raise ValueError(f"role: must be one of {sorted(ROLES)}, got {role!r}")
        self._role = role
        self._target: str | None = None  # the role being drained towards
        self._switch_task: asyncio.Task | None = None
        self.num_switches = 0
        super().__init__(config, engine)
        self.max_chunk_bytes = max_chunk_bytes
        self.max_queue = max_queue

    @property
    def role(self) -> str:  # type: ignore[override]
        return self._role

    @property
    def role_proto(self) -> int:  # type: ignore[override]
        return ROLES[self._role]

    @property
    def switching_to(self) -> str | None:
        return self._target

    def add_services(self, server) -> None:
        self.prefill = prefill.PrefillTier(self, server, self.max_chunk_bytes, self.max_queue)
        self.decode = decode.DecodeTier(self, server)
        gateway_pb2_grpc.add_WorkerControlServicer_to_server(_ControlServicer(self), server)
        server.refuse = self._refusal

    def _refusal(self, method: str) -> str | None:
        for role, methods in _NEW_WORK.items():
            if method in methods and (self._target is not None or role != self._role):
                state = (f"switching to {self._target}" if self._target
                         else f"serving {self._role}")
                return f"worker {self.worker_id} is {state}: it takes no new {role} work"
        return None

    def routable(self) -> bool:
        return super().routable() and self._target is None

    # -- switching ------------------------------------------------------------------------
    def switch_role(self, role: str) -> bool:
        """Start draining towards `role`; False when already there or on the way. Raises
        ValueError for an unknown role, SwitchInProgress while draining towards the other."""
        if role not in ROLES:
            raise ValueError(f"role: must be one of {sorted(ROLES)}, got {role!r}")
        if role == (self._target or self._role):
            return False
        if self._target is not None:
            raise SwitchInProgress(f"role: already switching to {self._target}")
        log.info("worker %s: switching %s -> %s: draining", self.worker_id, self._role, role)
        self._target = role
        self._poke()
        self._switch_task = asyncio.get_running_loop().create_task(self._finish_switch())
        return True

    async def _finish_switch(self) -> None:
        await self.drain(self.config.drain_timeout_s)
        old, self._role, self._target = self._role, self._target, None
        self.num_switches += 1
        log.info("worker %s: drained; now serving %s (was %s)", self.worker_id, self._role, old)
        self._poke()

    def _poke(self) -> None:
        for r in self.registrations:
            r.poke()

    # -- both tiers -----------------------------------------------------------------------
    def busy(self) -> bool:
        return super().busy() or self.prefill.busy()

    def load(self) -> common_pb2.WorkerLoad:
        if self._role == prefill.ROLE:
            return self.prefill.load(super().load())
        return self.decode.load()

    def refresh_metrics(self) -> None:
        super().refresh_metrics()
        self.decode.refresh_metrics()

    def end_sessions(self) -> None:
        if hasattr(self, "decode"):
            self.decode.service.end_sessions()

    async def stop_tier(self) -> None:
        if self._switch_task is not None:
            self._switch_task.cancel()
        if hasattr(self, "prefill"):
            self.prefill.close()
            await self.decode.close()


class _ControlServicer(gateway_pb2_grpc.WorkerControlServicer):
    _NAMES = {v: k for k, v in ROLES.items()}

    def __init__(self, worker: RoleWorker) -> None:
        self.worker = worker

    async def SwitchRole(self, request: gateway_pb2.SwitchRoleRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.SwitchRoleResponse:
        role = self._NAMES.get(request.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "role: must be PREFILL or DECODE")
        try:
            started = self.worker.switch_role(role)
        except SwitchInProgress as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return gateway_pb2.SwitchRoleResponse(role=request.role, started=started)


DESCRIPTION = ("A pdserve worker that serves either tier over one engine — prefill, or "
               "decode (and colocated requests) — and switches between them when the "
               "gateway's planner says so (WorkerControl.SwitchRole): it drains its current "
               "role's work, then registers in the other.")


def build_parser(prog: str = "python -m pdserve.role_worker") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    p.add_argument("--role", choices=sorted(ROLES), required=True, help="role to start in")
    add_worker_args(p)
    p.add_argument("--max-chunk-bytes", type=int, default=1 << 20,
                   help="prefill: largest KV payload per transfer message (default 1 MiB)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="prefill: Prefill calls queued or computing at once; more are refused "
                        f"with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_QUEUE}, 0 = no limit)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = worker_config_from_args(a)
    except ValueError as e:
        print(f"role worker: {e}", file=sys.stderr)
        return 2
    worker = RoleWorker(config, a.role, max_chunk_bytes=a.max_chunk_bytes,
                        max_queue=a.max_queue)
    event_loop.run(run_until_signal(worker.start, worker.stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
