"""The worker registry: which prefill and decode workers exist and how loaded they are.

A worker's life here: `register` (at its start-up) → a `heartbeat` every ~1 s carrying its
`WorkerLoad` → `deregister` at shutdown, or `expire` once it has been silent for
`heartbeat_timeout_s`. A worker id is bound to the address it first registered with until
then: registering it again from the same address refreshes the entry, from another one
raises `WorkerIdTaken` (the registry never lets one member take over another's traffic).
Only workers heard from within the timeout are routable, so a dead worker gets no new
traffic even between sweeps, and a new one gets traffic as soon as it registers.

Static workers (given on the command line) never register: the gateway polls their Stats
RPC (see `StatsPoller` in server.py) and reports each answer with `observe`; they are
routable while their last answer is fresh, and stay in the table when they are not.

Pure bookkeeping: no I/O, an injectable clock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.engine.kv_spec import KVCacheSpec


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Load:
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    tokens_per_s: float = 0.0
    queue_depth: int = 0
    cached_block_hashes: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Worker:
    worker_id: str
    role: Role
    address: str
    model: str
    kv_spec: KVCacheSpec | None
    load: Load
    last_seen: float  # clock() of the last registration, heartbeat or Stats answer
    static: bool = False
    switchable: bool = False  # serves WorkerControl.SwitchRole: the planner may move it

    @property
    def block_size(self) -> int | None:
        return self.kv_spec.block_size if self.kv_spec else None


class WorkerIdTaken(Exception):
    """A live worker already holds this id at another address."""


def static_worker_id(role: Role, address: str) -> str:
    return f"static-{role.value}-{address}"


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self._workers: dict[str, Worker] = {}
        self.on_remove: list[Callable[[Worker], None]] = []

    # -- registered workers -----------------------------------------------------------------
    def register(self, worker_id: str, role: Role, address: str, model: str,
                 kv_spec: KVCacheSpec | None, load: Load, switchable: bool = False) -> Worker:
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        if not address:
            raise ValueError("address must not be empty")
        old = self._workers.get(worker_id)
        if old is not None and (old.static or old.address != address):
            raise WorkerIdTaken(f"worker_id {worker_id!r} is registered at {old.address}; "
                                "it can move once that worker deregisters or expires")
        w = Worker(worker_id, role, address, model, kv_spec, load, self.clock(),
                   switchable=switchable)
        self._workers[worker_id] = w
        return w

    def heartbeat(self, worker_id: str, load: Load) -> bool:
        """False when the worker is unknown (never registered, or expired): re-register."""
        w = self._workers.get(worker_id)
        if w is None or w.static:
            return False
        self._workers[worker_id] = replace(w, load=load, last_seen=self.clock())
        return True

    def deregister(self, worker_id: str) -> bool:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._removed(w)
        return w is not None

    def expire(self) -> list[Worker]:
        """Drop registered workers silent for longer than the timeout."""
        now = self.clock()
        gone = [w for w in self._workers.values()
                if not w.static and now - w.last_seen > self.heartbeat_timeout_s]
        for w in gone:
            del self._workers[w.worker_id]
            self._removed(w)
        return gone

    # -- static workers ---------------------------------------------------------------------
    def add_static(self, role: Role, address: str) -> Worker:
        wid = static_worker_id(role, address)
        w = Worker(wid, role, address, "", None, Load(), last_seen=-float("inf"), static=True)
        self._workers[wid] = w
        return w

    def observe(self, worker_id: str, model: str, kv_spec: KVCacheSpec | None, load: Load) -> None:
        """A static worker answered its Stats poll."""
        w = self._workers.get(worker_id)
        if w is not None:
            self._workers[worker_id] = replace(w, model=model, kv_spec=kv_spec, load=load,
                                               last_seen=self.clock())

    def static_workers(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.static]

    # -- queries ----------------------------------------------------------------------------
    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def alive(self, role: Role) -> list[Worker]:
        """Routable workers of a role: heard from within the timeout, one per address (a
        registered entry wins over a static one for the same address)."""
        now = self.clock()
        by_addr: dict[str, Worker] = {}
        for w in self._workers.values():
            if w.role is not role or now - w.last_seen > self.heartbeat_timeout_s:
                continue
            prev = by_addr.get(w.address)
            if prev is None or (prev.static and not w.static):
                by_addr[w.address] = w
        return sorted(by_addr.values(), key=lambda w: w.worker_id)

    def _removed(self, w: Worker) -> None:
        for fn in self.on_remove:
            fn(w)
