"""PrefillBacklog: how much prompt work this gateway has handed the prefill tier and not yet
seen prefilled, and the wait that keeps it short.

A disaggregated request reserves KV at a decode worker before its prompt is sent to a
prefill worker, and both the reservation (its TTL at the decode worker) and the Prefill call
(its rpc timeout) are bounded in time. A burst sent straight through would queue every
prompt at the prefill worker at once, and the ones at the back would expire there. So a
request first takes a place in this backlog, in arrival order. It is let through while the
prompt tokens outstanding at the prefill tier would drain within `horizon_s` at the rate
the tier has been draining them (`max_tokens` per worker until that rate is known), and
the calls stay under `max_calls` per worker; one request is always let through, however
long its prompt. A request that waits here holds nothing anywhere else — no reservation,
no place in a worker's queue — so nothing of it can expire; only its own deadline (and a
client that leaves) ends the wait. With `horizon_s` well below the rpc timeout and the
reservation TTL, a prompt let through starts long before either.

Life of a place: `acquire(n, workers)` (waits) -> the caller reserves and prefills ->
`release(n)` (always, in a finally), which lets the next ones in.
"""

from __future__ import annotations

import asyncio
import collections
import time

# Until the drain rate is measured: two steps' worth of the engine's default 2048-token
# prefill budget per worker.
DEFAULT_MAX_TOKENS = 4096
# Half of a prefill worker's default queue limit (64), leaving room for other gateways.
DEFAULT_MAX_CALLS = 32
# A quarter of the default rpc timeout (20 s), itself below the reservation TTL (30 s).
DEFAULT_HORIZON_S = 5.0
_RATE_MIN_BUSY_S = 0.5  # busy time before the measured rate replaces the default budget
_RATE_WINDOW_S = 30.0  # the rate forgets older work at about this scale


class PrefillBacklog:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_calls: int = DEFAULT_MAX_CALLS,
                 horizon_s: float = DEFAULT_HORIZON_S) -> None:
        if max_tokens < 1 or max_calls < 1 or horizon_s <= 0:
            raise ValueError(f"max_tokens, max_calls and horizon_s must be positive, got "
                             f"{max_tokens}, {max_calls}, {horizon_s}")
        self.max_tokens = max_tokens
        self.max_calls = max_calls
        self.horizon_s = horizon_s
        self.tokens = 0  # prompt tokens let through and not yet released
        self.calls = 0
        self._waiting: collections.deque[tuple[int, int, asyncio.Future[None]]] = (
            collections.deque())
        self._done_tokens = 0.0  # released while busy, over `_busy_s`: the drain rate
        self._busy_s = 0.0
        self._t = time.monotonic()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def drain_rate(self) -> float | None:
        """Prompt tokens per busy second the prefill tier has been taking from this
        backlog; None until it has been busy long enough to tell."""
        if self._busy_s < _RATE_MIN_BUSY_S:
            return None
        return self._done_tokens / self._busy_s

    def budget(self, num_workers: int) -> int:
        rate = self.drain_rate()
        if rate is None:
            return self.max_tokens * max(1, num_workers)
        return max(1, int(rate * self.horizon_s))

    def _fits(self, n: int, workers: int) -> bool:
        return self.calls == 0 or (self.tokens + n <= self.budget(workers)
                                   and self.calls < self.max_calls * max(1, workers))

    async def acquire(self, num_tokens: int, num_workers: int) -> None:
        """Wait for a place for a prompt of `num_tokens` with `num_workers` prefill workers
        alive; FIFO. Cancellation leaves the queue cleanly."""
        if not self._waiting and self._fits(num_tokens, num_workers):
            self._take(num_tokens)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (num_tokens, num_workers, fut)
        self._waiting.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(num_tokens, drained=False)  # let in while cancelled: pass it on
            else:
                self._waiting.remove(entry)
                self._wake()  # the ones behind may fit now
            raise

    def release(self, num_tokens: int, drained: bool = True) -> None:
        """Give a place back; `drained`: its prompt was prefilled (counts toward the rate)."""
        self._clock()
        self.tokens -= num_tokens
        self.calls -= 1
        assert self.tokens >= 0 and self.calls >= 0
        if drained:
            self._done_tokens += num_tokens
        self._wake()

    def _clock(self) -> None:
        now = time.monotonic()
        if self.calls > 0:
            self._busy_s += now - self._t
            if self._busy_s > _RATE_WINDOW_S:  # keep the rate recent
                self._busy_s /= 2
                self._done_tokens /= 2
        self._t = now

    def _take(self, n: int) -> None:
        self._clock()
        self.tokens += n
        self.calls += 1

    def _wake(self) -> None:
        while self._waiting:
            n, workers, fut = self._waiting[0]
            if not self._fits(n, workers):
                return
            self._waiting.popleft()
            self._take(n)
            fut.set_result(None)
