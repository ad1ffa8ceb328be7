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

import time

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
