"""Migration policy: when a request moves to another worker, and what it carries there.

A request whose worker fails is not lost. Two moves, both decided here as pure functions
over plain values (the orchestrator does the I/O):

- **Prefill failover.** A prefill that fails for any reason but the request's own fault
  (`prefill_may_fail_over`) is retried on the next prefill worker with a fresh reservation,
  and when none is left the prompt runs colocated on a decode worker.
- **Decode migration (recompute).** A token stream that breaks — the worker died, stalled
  past the stream idle bound, aborted the request or failed its engine — is re-admitted as
  a colocated request whose prompt is the original prompt plus every token already
  streamed (`resumed`). Its limits shrink by what was streamed and
  `SamplingParams.output_offset` says how much that was, so greedy output is unchanged and a
  seeded request continues its seed stream. The client's stream just continues.

Bounds: at most `MAX_MIGRATIONS` moves per request, then UNAVAILABLE naming the last
failure. A worker that failed this request is tried again only when no other one is left
(it may have been restarted), after a backoff; after an engine failure (INTERNAL) it is not
tried again at all — it reports NOT_SERVING until it recovers — and the client gets the
INTERNAL itself when no other worker is left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from pdserve.gateway.errors import ErrorKind, GatewayError
from pdserve.gateway.registry import Worker
from pdserve.gateway.request import GenerationRequest

MAX_MIGRATIONS = 3
BACKOFF_BASE_S = 0.5  # before retrying a worker that already failed this request
MAX_BACKOFF_S = 2.0

# what a prefill worker answers when the request itself is at fault: no other worker would
# do better
_REQUEST_FAULTS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})


def prefill_may_fail_over(code: grpc.StatusCode) -> bool:
    return code not in _REQUEST_FAULTS


def may_migrate(err: GatewayError, num_streamed: int) -> bool:
    """A failed attempt's error moves the request elsewhere when it says the worker could
    not serve it. A capacity refusal ends a request that streamed nothing yet (the client
    may retry), but not one the client is already reading."""
    if err.kind in (ErrorKind.UNAVAILABLE, ErrorKind.INTERNAL, ErrorKind.CANCELLED):
        return True
    return err.kind is ErrorKind.OVERLOADED and num_streamed > 0


def candidates(alive: Sequence[Worker], failed: dict[str, ErrorKind]
               ) -> tuple[list[Worker], bool]:
    """Decode workers for the next attempt, and whether they are workers that already failed
    this request (then the caller backs off first). `failed`: worker id -> how it failed."""
    fresh = [w for w in alive if w.worker_id not in failed]
    if fresh:
        return fresh, False
    again = [w for w in alive if failed[w.worker_id] is not ErrorKind.INTERNAL]
    return again, True


def backoff_s(migrations: int) -> float:
    return min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2.0 ** max(0, migrations - 1))


def resumed(req: GenerationRequest, streamed: Sequence[int], attempt: int) -> GenerationRequest:
    """The request re-admitted after `streamed` tokens (all of its output so far): prompt
    extended by them, limits reduced by them, a fresh cluster id per attempt (the failed
    worker may still hold the old one, and a late Cancel for it must not hit this one)."""
    cluster_id = f"{req.cluster_id}-m{attempt}"
    if not streamed:
        return dataclasses.replace(req, cluster_id=cluster_id)
    n = len(streamed)
    p = req.params
    assert n < p.max_tokens, "a request that reached max_tokens has finished"
    params = dataclasses.replace(p, max_tokens=p.max_tokens - n,
                                 min_tokens=max(0, p.min_tokens - n),
                                 output_offset=p.output_offset + n)
    return dataclasses.replace(req, prompt_token_ids=(*req.prompt_token_ids, *streamed),
                               params=params, cluster_id=cluster_id)
