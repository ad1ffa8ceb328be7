"""Routing costs in KV blocks (gateway/router.py), with exact expectations: decode = blocks
in use + blocks needed (+ requests sent since the last heartbeat), prefill = uncached
prompt blocks + queued prompts' blocks."""

from __future__ import annotations

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.gateway.registry import Load, Role, Worker
from pdserve.gateway.router import decode_cost, prefill_cost, rank_decode, rank_prefill

SPEC = KVCacheSpec(2, 64, 16, 2, 16, "float32")  # 16 tokens per block


def _w(wid: str, role: Role, **load) -> Worker:
    return Worker(wid, role, f"h:{wid}", "m", SPEC, Load(**load), last_seen=0.0)


def test_decode_cost_blocks_in_use_plus_needed():
    w = _w("d", Role.DECODE, num_running=2, free_blocks=40, total_blocks=64)
    assert decode_cost(w, 100, {}) == 24 + 7  # 24 in use, ceil(100/16) = 7 needed
    assert decode_cost(w, 16, {}) == 24 + 1
    assert decode_cost(w, 100, {"d": 2}) == 24 + 7  # the heartbeat already shows both
    assert decode_cost(w, 100, {"d": 5}) == 24 + 7 + 3 * 7  # three it does not show yet


def test_decode_rank_cheapest_that_fits_then_most_free():
    busy = _w("busy", Role.DECODE, num_running=1, free_blocks=10, total_blocks=64)  # 54 + 7
    idle = _w("idle", Role.DECODE, num_running=9, free_blocks=60, total_blocks=64)  # 4 + 7
    full = _w("full", Role.DECODE, free_blocks=6, total_blocks=64)  # 7 do not fit
    fuller = _w("fuller", Role.DECODE, free_blocks=2, total_blocks=64)
    # many short sequences on `idle` use fewer blocks than one long one on `busy`
    assert [w.worker_id for w in rank_decode([full, busy, fuller, idle], 100, {})] == \
        ["idle", "busy", "full", "fuller"]
    # 8 unreported requests on idle: 4 + 7 + 8 * 7 = 67 > 61
    assert [w.worker_id for w in rank_decode([busy, idle], 100, {"idle": 17})] == \
        ["busy", "idle"]


def test_prefill_cost_uncached_blocks_plus_queued():
    prompt = list(range(1000, 1100))  # 100 tokens: 7 blocks, 6 full (hashable)
    hashes = block_hashes(prompt, 16)
    assert len(hashes) == 6
    cold = _w("cold", Role.PREFILL)
    warm = _w("warm", Role.PREFILL, cached_block_hashes=frozenset(hashes[:4]))
    assert prefill_cost(cold, prompt, {}) == 7
    assert prefill_cost(warm, prompt, {}) == 3
    queued = _w("q", Role.PREFILL, queue_depth=2, num_running=1,
                cached_block_hashes=frozenset(hashes))
    # 2 prompts held (the running one among them), priced at 7 blocks each; 1 uncached
    assert prefill_cost(queued, prompt, {}) == 1 + 2 * 7
    assert prefill_cost(queued, prompt, {"q": 3}) == 1 + 3 * 7  # sent, not yet reported
    assert [w.worker_id for w in rank_prefill([cold, queued, warm], prompt, {})] == \
        ["warm", "cold", "q"]
