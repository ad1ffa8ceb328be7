"""The request and its outputs as they cross the gateway's layers: the client APIs build a
`GenerationRequest`, the orchestrator streams back `GenerationDelta`s. Frozen, plain data."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pdserve.protocol import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str  # the client's (or one assigned for it): echoed back, never a key
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    priority: int = 0
    timeout_s: float | None = None  # from arrival; None: no deadline of its own
    arrival: float = 0.0  # time.monotonic() when the request reached the gateway
    # the id workers know it by: minted here, so one client cannot name another's request
    cluster_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request has at least one prompt token"
        assert self.timeout_s is None or self.timeout_s > 0
        assert all(self.stop), "stop strings are non-empty"

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.arrival + self.timeout_s


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class RequestTiming:
    """Where the request's time went, in seconds (proto Timing)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class GenerationDelta:
    """Output since the previous delta. The last one has finish_reason ('stop', 'length',
    'abort'), usage and timing set."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    timing: RequestTiming | None = field(default=None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
