"""What this gateway has in flight at each worker, so that a worker the registry drops takes
its calls down with it at once instead of leaving them to their deadlines.

A request holds a `Slot` at a worker from the moment it chooses the worker until it is done
with it (`InFlight.hold`). The number of open slots per worker is the routing load this
gateway adds before the worker's heartbeat reports it (router.py reads `InFlight` as a
`Mapping[worker id, int]`). A slot also keeps the gRPC calls the request opened there
(`Slot.track`); a Prefill call is tracked at both its prefill worker and the decode worker
its KV goes to, since it cannot finish without either.

    hold(w) ──track(call)…──▶ closed (the request left w)
       └── drop(w's id, reason): every tracked call cancelled, the slot marked; a call
           tracked later is cancelled at once

The registry drops a worker whose heartbeats stopped (stopped process, lost link, host gone)
— gateway/server.py calls `drop` for each one `expire` returns. A cancelled gRPC call
surfaces in the awaiting task as `asyncio.CancelledError`, which would read as the client
leaving; `ended_by_drop` turns it into `WorkerLost` (UNAVAILABLE naming the worker), a worker
failure that the orchestrator fails over or migrates (migration.py). A CancelledError aimed
at the task itself — the client left, the request's deadline fired — passes through.

A worker that deregisters keeps its calls: it is draining (shutdown, role switch) and
finishes them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from pdserve.gateway.errors import ErrorKind, GatewayError
from pdserve.gateway.registry import Worker


class WorkerLost(GatewayError):
    """A call ended because its worker was dropped from the registry."""

    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(ErrorKind.UNAVAILABLE,
                         f"{worker.role.value} worker {worker.address} dropped: {reason}")
        self.worker_id = worker.worker_id


@dataclass(eq=False)
class Slot:
    """One request's hold on one worker."""

    worker: Worker
    dropped: str | None = None  # why the worker was dropped while this slot was open
    _calls: list[grpc.aio.Call] = field(default_factory=list)

    def track(self, call: grpc.aio.Call) -> grpc.aio.Call:
        """Note a call to end when the worker is dropped; returns it."""
        self._calls.append(call)
        if self.dropped is not None:
            call.cancel()
        return call

    def _drop(self, reason: str) -> None:
        self.dropped = reason
        for call in self._calls:
            call.cancel()

    def lost(self) -> WorkerLost | None:
        return None if self.dropped is None else WorkerLost(self.worker, self.dropped)


class InFlight(Mapping[str, int]):
    """worker id -> slots open there. Touched only from the event loop."""

    def __init__(self) -> None:
        self._slots: dict[str, set[Slot]] = {}

    def __getitem__(self, worker_id: str) -> int:
        return len(self._slots[worker_id])

    def __iter__(self) -> Iterator[str]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __repr__(self) -> str:
        return f"InFlight({ {k: len(v) for k, v in self._slots.items()} })"

    def open(self, w: Worker) -> Slot:
        """A slot at `w`, counted from now; `close` it when the request leaves `w`."""
        s = Slot(w)
        self._slots.setdefault(w.worker_id, set()).add(s)
        return s

    def close(self, s: Slot) -> None:
        held = self._slots.get(s.worker.worker_id)
        if held is not None:
            held.discard(s)
            if not held:
                del self._slots[s.worker.worker_id]

    @contextlib.contextmanager
    def hold(self, w: Worker) -> Iterator[Slot]:
        s = self.open(w)
        try:
            yield s
        finally:
            self.close(s)

    def drop(self, worker_id: str, reason: str) -> int:
        """End every call open at a worker the registry dropped; returns how many slots
        it hit. Their requests see `WorkerLost` (through `ended_by_drop`)."""
        held = self._slots.get(worker_id, ())
        for s in held:
            s._drop(reason)
        return len(held)


@contextlib.contextmanager
def ended_by_drop(*slots: Slot) -> Iterator[None]:
    """Around an await on calls tracked in `slots`: a cancellation that came from a dropped
    worker (the first of `slots` dropped) is raised as its `WorkerLost`."""
    try:
        yield
    except asyncio.CancelledError:
        task = asyncio.current_task()
        lost = next((e for e in (s.lost() for s in slots) if e is not None), None)
        if lost is None or (task is not None and task.cancelling()):
            raise
        raise lost from None
