"""How long anything inside the cluster may wait: one place for the defaults.

Every internal unary RPC (Reserve, Prefill, Cancel, Stats, registration) runs under
`min(rpc timeout, the request's own time left)`; a KV push, open to ack, under the rpc
timeout. Token streams (Decode, Generate) are long by nature, so instead of a deadline they
get a liveness bound: the decode worker sends an empty `TokenChunk` after
`STREAM_KEEPALIVE_S` of silence, and the gateway gives up on a stream that shows nothing —
no token, no keepalive — for the stream idle timeout (UNAVAILABLE). A stopped or wedged
worker thus becomes a clear error instead of a hang.

`DEFAULT_RPC_TIMEOUT_S` stays below the decode worker's reservation timeout (30 s), so a
prefill still queued when its reservation would expire is cancelled before it computes.
`DEFAULT_DRAIN_TIMEOUT_S` is the manifests' terminationGracePeriodSeconds (60) minus a
margin for the stop itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_RPC_TIMEOUT_S = 20.0
DEFAULT_STREAM_IDLE_S = 10.0
STREAM_KEEPALIVE_S = 2.0
DEFAULT_DRAIN_TIMEOUT_S = 55.0


def call_timeout(rpc_timeout_s: float, deadline: float | None) -> float:
    """Seconds an internal call may take: the rpc timeout, or the time left before
    `deadline` (time.monotonic()) when that is shorter; never below a millisecond."""
    if deadline is None:
        return rpc_timeout_s
    return max(0.001, min(rpc_timeout_s, deadline - time.monotonic()))


class IdleWatch:
    """Calls `on_idle` once `idle_s` has passed since `arm()` with no `arm()` or `disarm()`
    since: the keepalive a quiet stream sends, the stall a stream shows. One loop timer per
    watch, re-armed when it fires, instead of a timeout armed and cancelled per token.
    `on_idle` returns whether to go on watching (armed again from then); `fired` says
    whether it was ever called."""

    def __init__(self, idle_s: float, on_idle: Callable[[], bool], armed: bool = False
                 ) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle_s, self._on_idle = idle_s, on_idle
        now = self._loop.time()
        self._since: float | None = now if armed else None
        self.fired = False
        self._handle = self._loop.call_at(now + idle_s, self._fire)

    def arm(self) -> None:
        self._since = self._loop.time()

    def disarm(self) -> None:
        self._since = None

    def _fire(self) -> None:
        now = self._loop.time()
        if self._since is not None and now - self._since >= self._idle_s:
            self.fired = True
            if not self._on_idle():
                return
            self._since = now
        self._handle = self._loop.call_at(
            (self._since if self._since is not None else now) + self._idle_s, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()
