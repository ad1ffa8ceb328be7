"""BlockPool: the physical KV blocks of one worker — allocation, ref counts, prefix cache.

Every block is in exactly one of three states:
    in use   ref_count > 0 (owned by one or more sequences)
    cached   ref_count == 0 but holds a full block registered under its chained hash;
             reusable by a prompt with the same prefix, evictable (LRU) when space is needed
    free     ref_count == 0, no hash

`num_free_blocks` counts free + cached: both are available to allocate. Blocks released by a
sequence are appended to the LRU queue tail-block first, so a sequence's last blocks are
evicted before its first ones (the first are the ones other prompts share).
A cached block is reused only when its stored token ids also match (hash collisions).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.engine.block_hash import hash_block
from pdserve.protocol import cdiv


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PoolStats:
    total: int
    free: int  # allocatable: free + cached
    cached: int  # ref_count == 0 and holding a prefix
    in_use: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found
    evictions: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, least recently released first
        self._lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._num_cached = 0  # blocks in _lru that hold a hash; kept as they move
        self._hash_to_block: dict[int, int] = {}  # in registration order
        self.hash_version = 0  # changes whenever the set of cached hashes does
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    def stats(self) -> PoolStats:
        free = self.num_free_blocks
        return PoolStats(self.num_blocks, free, self.num_cached_blocks, self.num_blocks - free,
                         self.prefix_queries, self.prefix_hits, self.evictions)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cached_hashes(self, limit: int | None = None) -> list[int]:
        """Hashes of the blocks holding a registered prefix (in use or cached), oldest
        first; with `limit`, only the newest `limit` of them."""
        if limit is None or limit >= len(self._hash_to_block):
            return list(self._hash_to_block)
        newest = list(itertools.islice(reversed(self._hash_to_block), limit))
        return newest[::-1]

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref_count 1), evicting cached prefixes in LRU order if needed."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {n}, have {self.num_free_blocks}")
        out = []
        for _ in range(n):
            block_id, _ = self._lru.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._num_cached -= 1
                self._forget(block)
                self.evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; released ones join the LRU tail-first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._lru[block_id] = None
                self._num_cached += block.block_hash is not None

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], max_blocks: int) -> list[int]:
        """Take a reference on each cached block that matches the prompt's leading full
        blocks (at most `max_blocks`), stopping at the first miss."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        bs = self.block_size
        parent = None
        for i in range(min(max_blocks, len(token_ids) // bs)):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, chunk)
            block_id = self._hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            self._touch(block_id)
            hits.append(block_id)
        return hits

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def register_full_blocks(self, block_ids: list[int], token_ids: list[int],
                             num_registered: int, num_full: int) -> None:
        """Register blocks num_registered..num_full-1 of a sequence under their hashes."""
        if not self.enable_prefix_caching or num_full <= num_registered:
            return
        bs = self.block_size
        parent = None
        if num_registered:
            parent = self.blocks[block_ids[num_registered - 1]].block_hash
            if parent is None:  # a block before it was a duplicate; recompute the chain
                num_registered = 0
        for i in range(num_registered, num_full):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, chunk)
            block = self.blocks[block_ids[i]]
            assert block.ref_count > 0, "only a sequence's own (held) blocks are registered"
            if block.block_hash is not None:
                continue
            if parent in self._hash_to_block:
                continue  # the same content is cached in another block already
            block.block_hash = parent
            block.token_ids = chunk
            self._hash_to_block[parent] = block.block_id
            self.hash_version += 1

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._lru[block_id]
            self._num_cached -= block.block_hash is not None
        block.ref_count += 1

    def _forget(self, block: Block) -> None:
        if self._hash_to_block.get(block.block_hash) == block.block_id:
            del self._hash_to_block[block.block_hash]
            self.hash_version += 1
        block.block_hash = None
        block.token_ids = None
