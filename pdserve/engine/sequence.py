"""A request's state inside the engine.

Life cycle (status only moves forward, except RUNNING <-> PREEMPTED):

    WAITING ──schedule──▶ RUNNING ──finish──▶ FINISHED_*
       ▲                    │
       └──── PREEMPTED ◀────┘  (blocks freed; its tokens are recomputed on resume)
    WAITING_FOR_KV ──commit──▶ RUNNING     (disaggregated: KV arrives from a prefill worker)

A sequence's computed tokens catch up to its tokens: prefill chunks, prefix-cache hits and
KV pushed from another worker are all the same jump in `num_computed_tokens`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.protocol import ABORT, LENGTH, STOP, SamplingParams, TokenLogprobs


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    # everything after PREEMPTED is finished
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: STOP,
    SequenceStatus.FINISHED_LENGTH: LENGTH,
    SequenceStatus.FINISHED_ABORTED: ABORT,
}

__all__ = ["FINISH_REASONS", "Sequence", "SequenceStatus"]


@dataclass
class Sequence:
    """One request: prompt + generated tokens and how much of it the cache holds."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in this sequence's blocks
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_registered_blocks: int = 0  # leading full blocks entered in the prefix cache
    first_scheduled_time: float | None = None  # monotonic; the end of its queue time
    # a prefill worker samples the first token and then drops the sequence
    prefill_only: bool = False
    # its prompt's KV was pushed by another worker: its blocks are never shared
    remote_kv: bool = False

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a sequence needs at least one prompt token"
        assert 0 <= self.num_computed_tokens <= self.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id(self, position: int) -> int:
        """The token at `position` of prompt + output, without building that list (the
        decode step reads one token per sequence)."""
        n = len(self.prompt_token_ids)
        return (self.prompt_token_ids[position] if position < n
                else self.output_token_ids[position - n])

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens
