"""The receiving end's contract: `KVSink`, which the decode worker implements over its
engine's KV connector, and `KVCommitInfo`, what a finished transfer hands it.

The receiver (`pdserve.kvtransfer.receiver`) validates every chunk header before it calls
the sink and leaves the payload's CRC-32C to the sink, which checks it as it copies (one
pass over the bytes: `pdserve.engine.kv_blocks.ingest_blocks`); otherwise a sink only moves
tensors on and keeps its own bookkeeping. Calls come from the decode worker's event loop
thread and never block it: a sink over an engine queues writes to the engine thread, and
`commit_kv` is a coroutine that waits for the engine.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from pdserve.engine.kv_spec import KVCacheSpec


@dataclass(frozen=True)
class KVCommitInfo:
    """What the prefill worker reports when all of a prompt's KV has been sent."""

    num_prompt_tokens: int
    first_token_id: int
    # log p(first token); None when the request did not ask for logprobs.
    first_token_logprob: float | None = None
    # The top alternatives at the first position, most likely first: (token id, logprob).
    first_token_top_logprobs: tuple[tuple[int, float], ...] = ()
    # Prompt tokens the prefill worker served from its prefix cache.
    num_cached_tokens: int = 0
    # Prefill worker time, seconds (see PrefillTiming in common.proto).
    queue_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.num_prompt_tokens >= 1, self.num_prompt_tokens
        assert self.first_token_id >= 0, self.first_token_id
        assert 0 <= self.num_cached_tokens <= self.num_prompt_tokens, self.num_cached_tokens
        assert min(self.queue_s, self.compute_s, self.transfer_s) >= 0.0


@runtime_checkable
class KVSink(Protocol):
    """Where received KV goes: the decode worker's paged cache and its reservations.

    A reservation is a list of physical blocks set aside for one prompt; the transfer
    addresses them by logical index 0 .. n-1. Rules:

    - `reservation_secret` is the one-time secret a push into the reservation must carry
      (None like `reservation_num_blocks`); the receiver compares it before anything else.
    - `reservation_num_blocks` is the number of blocks the transfer must fill,
      `ceil(num_prompt_tokens / block_size)`. It returns None for an unknown reservation
      and for one that no longer accepts KV (committed, aborted or expired).
    - `write_kv` receives tensors `[L, n, block_size, kv_heads, head_dim]` of the spec's
      dtype on the CPU, the same n blocks of layers `layer` .. `layer + L - 1` (a chunk
      covers one layer or several), every header field validated: read-only views of the
      received message or segment (no copy was made), which the sink copies into its cache
      (at once, or later but before the commit: the views keep the message alive) and must
      not write to; and `crc32c`, the chunk's stated CRC-32C of the payload (each layer's
      K bytes then its V bytes, layer after layer), which the sink checks.
      The bytes may reach the reservation's own blocks before that check, never a block
      anything else can read; a mismatch fails the reservation: its commit raises
      ValueError("crc32c: ..."). It returns None when the write is done and checked (a
      mismatch raised `ChecksumMismatch`, a ValueError, from the call), or a future that
      resolves when it is (None, or the error: `ChecksumMismatch`, KeyError). It raises
      KeyError if the reservation is gone.
    - `commit_kv` (awaited) is called once, after every (layer, block) was written; from
      then on the sequence belongs to the decode scheduler, which frees the blocks when it
      finishes. It raises ValueError (the message starting with the field) when the
      commit is invalid and KeyError when the reservation is gone; the receiver then
      aborts the reservation.
    - `abort_kv` frees the reservation's blocks; it is a no-op for an unknown reservation.
    """

    @property
    def kv_spec(self) -> KVCacheSpec: ...

    def reservation_num_blocks(self, reservation_id: str) -> int | None: ...

    def reservation_secret(self, reservation_id: str) -> str | None: ...

    def write_kv(
        self, reservation_id: str, layer: int, block_indices: list[int],
        k: torch.Tensor, v: torch.Tensor, crc32c: int,
    ) -> concurrent.futures.Future | None: ...

    async def commit_kv(self, reservation_id: str, commit: KVCommitInfo) -> None: ...

    def abort_kv(self, reservation_id: str, reason: str) -> None: ...
