"""Admission: how many requests the gateway lets through to the workers, and in what order.

A request either gets one of `max_inflight` slots at once, or waits in line: lower priority
number served first, FIFO within a priority. At most `max_queue` requests wait in all,
whatever their priorities (priority orders the line; it does not buy room in it), and a
request arriving to a full line is refused at once with a retry hint (`Overloaded`).
A waiting request whose deadline passes leaves the queue with `asyncio.TimeoutError`; one
that is cancelled leaves it too. A slot is returned with
`release()` (the `slot()` context manager does both), and goes to the next waiting request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass


class Overloaded(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"the gateway's admission queue is full; retry in {retry_after_s:g}s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionStats:
    inflight: int
    queued: int
    max_inflight: int
    max_queue: int


class AdmissionController:
    def __init__(self, max_inflight: int, max_queue: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.num_inflight = 0
        self._queues: dict[int, collections.deque[asyncio.Future[None]]] = {}
        self._num_queued = 0
        self._mean_service_s = 1.0  # EWMA of slot hold times, for the retry hint

    def stats(self) -> AdmissionStats:
        return AdmissionStats(self.num_inflight, self._num_queued, self.max_inflight,
                              self.max_queue)

    def retry_after_s(self) -> float:
        """Roughly when a slot frees up for a newcomer: the queue ahead, drained at
        max_inflight per mean service time; at least one second."""
        waves = (self._num_queued + 1) / self.max_inflight
        return float(max(1, math.ceil(waves * self._mean_service_s)))

    async def acquire(self, priority: int = 0, deadline: float | None = None) -> None:
        """Take a slot, waiting in line if needed. Overloaded when the queues are full;
        asyncio.TimeoutError when `deadline` (time.monotonic()) passes first."""
        if self.num_inflight < self.max_inflight and self._num_queued == 0:
            self.num_inflight += 1
            return
        if self._num_queued >= self.max_queue:
            raise Overloaded(self.retry_after_s())
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(priority, collections.deque()).append(fut)
        self._num_queued += 1
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # granted while we were being cancelled: pass it on
            else:
                fut.cancel()
                self._forget(priority, fut)
            raise

    def release(self, held_s: float | None = None) -> None:
        assert self.num_inflight > 0, "release() without a slot"
        if held_s is not None:
            self._mean_service_s = 0.8 * self._mean_service_s + 0.2 * held_s
        self.num_inflight -= 1
        self._grant_next()

    @contextlib.asynccontextmanager
    async def slot(self, priority: int = 0, deadline: float | None = None
                   ) -> AsyncIterator[None]:
        await self.acquire(priority, deadline)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.release(time.monotonic() - t0)

    def _forget(self, priority: int, fut: asyncio.Future[None]) -> None:
        q = self._queues.get(priority)
        if q is not None and fut in q:
            q.remove(fut)
            self._num_queued -= 1
            if not q:
                del self._queues[priority]

    def _grant_next(self) -> None:
        while self.num_inflight < self.max_inflight and self._queues:
            prio = min(self._queues)
            q = self._queues[prio]
            fut = q.popleft()
            self._num_queued -= 1
            if not q:
                del self._queues[prio]
            if not fut.done():
                fut.set_result(None)
                self.num_inflight += 1
