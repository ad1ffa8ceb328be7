"""Routing: which decode worker holds a request's KV and which prefill worker computes it.

Decode: among the workers whose free KV blocks fit the prompt, the one with the fewest
sequences (running + waiting, or the requests this gateway has in flight there when that is
more — heartbeats lag a second behind bursts); ties go to more free blocks. When none has
room, the one with the most free blocks (its Reserve decides).

Prefill: the lowest estimated cost, counted in prompt blocks to compute: the prompt's
blocks not in the worker's prefix cache (its leading block hashes that the worker reports
in `cached_block_hashes`) plus, for every request queued or running there, a prompt of
this size. So a warm cache wins while queues are even, and a long queue outweighs it.

Conditional disaggregation: prompts shorter than `disagg_threshold` tokens (and every
prompt when no prefill worker is up) are served colocated by the decode worker.

Pure functions over registry snapshots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdserve.engine.block_hash import block_hashes
from pdserve.gateway.registry import Worker
from pdserve.protocol import cdiv


def _blocks_for(num_tokens: int, block_size: int | None) -> int:
    bs = block_size or 16
    return cdiv(num_tokens, bs)


def decode_load(w: Worker, inflight: Mapping[str, int]) -> int:
    return max(w.load.num_running + w.load.num_waiting, inflight.get(w.worker_id, 0))


def rank_decode(workers: Sequence[Worker], num_prompt_tokens: int,
                inflight: Mapping[str, int]) -> list[Worker]:
    """Decode workers best first (the caller tries them in order)."""
    def key(w: Worker) -> tuple[int, int, int, str]:
        fits = w.load.free_blocks >= _blocks_for(num_prompt_tokens, w.block_size)
        return (0 if fits else 1, decode_load(w, inflight) if fits else 0,
                -w.load.free_blocks, w.worker_id)
    return sorted(workers, key=key)


def prefix_overlap(prompt_hashes: Sequence[int], cached: frozenset[int]) -> int:
    """Leading blocks of the prompt present in a worker's prefix cache."""
    n = 0
    for h in prompt_hashes:
        if h not in cached:
            break
        n += 1
    return n


def prefill_cost(w: Worker, prompt_token_ids: Sequence[int], inflight: Mapping[str, int],
                 hashes_by_block_size: dict[int, list[int]] | None = None) -> int:
    bs = w.block_size or 16
    nblocks = _blocks_for(len(prompt_token_ids), bs)
    cache = hashes_by_block_size if hashes_by_block_size is not None else {}
    if bs not in cache:
        cache[bs] = block_hashes(prompt_token_ids, bs)
    overlap = prefix_overlap(cache[bs], w.load.cached_block_hashes)
    queued = max(w.load.queue_depth + w.load.num_running + w.load.num_waiting,
                 inflight.get(w.worker_id, 0))
    return (nblocks - overlap) + queued * nblocks


def rank_prefill(workers: Sequence[Worker], prompt_token_ids: Sequence[int],
                 inflight: Mapping[str, int]) -> list[Worker]:
    """Prefill workers best first."""
    cache: dict[int, list[int]] = {}
    return sorted(workers, key=lambda w: (prefill_cost(w, prompt_token_ids, inflight, cache),
                                          w.worker_id))


def disaggregate(num_prompt_tokens: int, disagg_threshold: int, num_prefill: int) -> bool:
    """True: prefill on a prefill worker; False: colocated on the decode worker."""
    return num_prefill > 0 and num_prompt_tokens >= disagg_threshold
