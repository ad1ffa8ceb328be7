"""Routing: which decode worker holds a request's KV and which prefill worker computes it.

Both tiers are ranked by a cost in KV blocks, as Dynamo's KV router does, from the load
workers publish in heartbeats:

Decode: cost = KV blocks in use + the blocks this request needs (its prompt's), plus the
prompt's blocks again for every request this gateway sent there that the last heartbeat
does not show yet (heartbeats lag a second behind bursts). Among the workers whose free
blocks fit the prompt, the cheapest; ties go to more free blocks. When none has room, the
one with the most free blocks (its Reserve decides).

Prefill: cost = the prompt's blocks not in the worker's prefix cache (its leading block
hashes that the worker reports in `cached_block_hashes`) + the blocks queued there: workers
publish how many prompts they hold (queued or computing), not their tokens, so each is
priced at this prompt's size. So a warm cache wins while queues are even, and a long queue
outweighs it.

Compatibility: a prefill worker is paired only with decode workers whose KV layout equals
its own (`kv_compatible`: everything but the pool size, as the prefill worker checks); one
that no live decode worker can take KV from gets no prompts (`pairable_prefills`), so a
mixed fleet (say, two --kv-cache-dtype values) serves colocated rather than failing.

Conditional disaggregation: prompts shorter than `disagg_threshold` tokens (and every
prompt when no prefill worker is up) are served colocated by the decode worker.

Pure functions over registry snapshots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdserve.convert import layouts_match
from pdserve.engine.block_hash import block_hashes
from pdserve.gateway.registry import Worker
from pdserve.protocol import cdiv


def _blocks_for(num_tokens: int, block_size: int | None) -> int:
    bs = block_size or 16
    return cdiv(num_tokens, bs)


def decode_cost(w: Worker, num_prompt_tokens: int, inflight: Mapping[str, int]) -> int:
    """KV blocks in use + blocks needed, counting requests sent since the last heartbeat."""
    need = _blocks_for(num_prompt_tokens, w.block_size)
    in_use = max(0, w.load.total_blocks - w.load.free_blocks)
    unreported = max(0, inflight.get(w.worker_id, 0) - w.load.num_running - w.load.num_waiting)
    return in_use + need + unreported * need


def rank_decode(workers: Sequence[Worker], num_prompt_tokens: int,
                inflight: Mapping[str, int]) -> list[Worker]:
    """Decode workers best first (the caller tries them in order)."""
    def key(w: Worker) -> tuple[int, int, int, str]:
        fits = w.load.free_blocks >= _blocks_for(num_prompt_tokens, w.block_size)
        return (0 if fits else 1, decode_cost(w, num_prompt_tokens, inflight) if fits else 0,
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
    """Uncached prompt blocks + queued prompts' blocks (each priced at this prompt's)."""
    bs = w.block_size or 16
    nblocks = _blocks_for(len(prompt_token_ids), bs)
    cache = hashes_by_block_size if hashes_by_block_size is not None else {}
    if bs not in cache:
        cache[bs] = block_hashes(prompt_token_ids, bs)
    overlap = prefix_overlap(cache[bs], w.load.cached_block_hashes)
    # queue_depth counts the prompts a prefill worker holds, those in its engine included
    queued = max(w.load.queue_depth, w.load.num_running + w.load.num_waiting,
                 inflight.get(w.worker_id, 0))
    return (nblocks - overlap) + queued * nblocks


def rank_prefill(workers: Sequence[Worker], prompt_token_ids: Sequence[int],
                 inflight: Mapping[str, int]) -> list[Worker]:
    """Prefill workers best first."""
    cache: dict[int, list[int]] = {}
    return sorted(workers, key=lambda w: (prefill_cost(w, prompt_token_ids, inflight, cache),
                                          w.worker_id))


def kv_compatible(prefill: Worker, decode: Worker) -> bool:
    """Whether KV computed by `prefill` can enter `decode`'s cache. A layout not known yet (a
    static worker before its first Stats answer) excludes nobody: the prefill worker's own
    check then refuses a mismatch with FAILED_PRECONDITION."""
    a, b = prefill.kv_spec, decode.kv_spec
    return a is None or b is None or layouts_match(a, b)


def decodes_for(prefill: Worker, decodes: Sequence[Worker]) -> list[Worker]:
    """The decode workers `prefill` may push KV to."""
    return [d for d in decodes if kv_compatible(prefill, d)]


def pairable_prefills(prefills: Sequence[Worker], decodes: Sequence[Worker]) -> list[Worker]:
    """The prefill workers with at least one compatible decode worker among `decodes`."""
    return [p for p in prefills if any(kv_compatible(p, d) for d in decodes)]


def disaggregate(num_prompt_tokens: int, disagg_threshold: int, num_prefill: int) -> bool:
    """True: prefill on a prefill worker; False: colocated on the decode worker."""
    return num_prefill > 0 and num_prompt_tokens >= disagg_threshold
