"""BlockPool: exact block ids, ref counts, prefix hits and LRU eviction order."""

from __future__ import annotations

import pytest

from pdserve.engine.block_hash import block_hashes, hash_block
from pdserve.engine.block_pool import BlockPool


def test_allocate_free_accounting():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert pool.num_free_blocks == 5
    b = pool.allocate(5)
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(1)
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8
    with pytest.raises(AssertionError, match="double free"):
        pool.free([0])


def test_prefix_hits_and_refcounts():
    pool = BlockPool(8, 4)
    tokens = list(range(14))  # 3 full blocks + 2 tokens
    blocks = pool.allocate(4)
    pool.register_full_blocks(blocks, tokens, 0, 3)
    assert pool.cached_hashes() == block_hashes(tokens, 4)
    # a second prompt sharing 2 full blocks, then diverging
    other = tokens[:8] + [99, 98, 97, 96, 95]
    hits = pool.match_prefix(other, max_blocks=3)
    assert hits == blocks[:2]
    assert pool.blocks[blocks[0]].ref_count == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 6  # the two shared blocks are still held by `hits`
    pool.free(hits)
    assert pool.num_free_blocks == 8
    assert pool.num_cached_blocks == 3


def test_lru_eviction_order_tail_first():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.register_full_blocks(a, [1, 2, 3, 4], 0, 2)
    b = pool.allocate(2)
    pool.register_full_blocks(b, [5, 6, 7, 8], 0, 2)
    pool.free(a)  # released tail first: a[1] then a[0]
    pool.free(b)
    assert pool.num_cached_blocks == 4
    got = pool.allocate(1)
    assert got == [a[1]]  # the least recently released, and a's tail before its head
    assert pool.evictions == 1
    # a's first block is still a hit; its second is gone so the chain stops there
    assert pool.match_prefix([1, 2, 3, 4], 2) == [a[0]]


def test_hash_collision_guard():
    pool = BlockPool(4, 2)
    a = pool.allocate(1)
    pool.register_full_blocks(a, [1, 2], 0, 1)
    # forge a stored-token mismatch under the same hash: must not be reused
    pool.blocks[a[0]].token_ids = (7, 7)
    pool.free(a)
    assert pool.match_prefix([1, 2, 3], 1) == []


def test_hash_is_chained_and_stable():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(None, [3, 4])
    assert block_hashes([1, 2, 3, 4, 5], 2) == [h1, hash_block(h1, [3, 4])]
    assert h1 == hash_block(None, (1, 2))  # same value for lists and tuples, every process
    assert 0 <= h1 < 2**63


def test_length_buckets_bound_padding():
    from pdserve.engine.attention.torch_backend import length_buckets

    lens = [700, 33, 64, 65, 130, 31, 512, 300]
    groups = length_buckets(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert max(lens[i] for i in g) <= 2 * min(lens[i] for i in g)
    assert [[lens[i] for i in g] for g in groups] == [[31, 33], [64, 65], [130], [300, 512],
                                                       [700]]
