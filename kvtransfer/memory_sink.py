"""`InMemoryKVSink`: a complete `KVSink` over an `pdserve.engine.kv_cache.PagedKVCache`.

Reservations are lists of physical block ids taken from a free list, lowest first. A
reservation is *open* (accepting KV) until it is committed or aborted; aborting frees its
blocks at once, a committed one keeps them until `release`. Its secret is the one given to
`reserve` ("" by default: this sink serves tests and warm-up, never a network peer). Used
by the tests and as the in-process backend for warm-up; it really writes the cache.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque

import torch

from pdserve.engine.kv_blocks import ingest_blocks
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer.sink import KVCommitInfo


class InMemoryKVSink:
    """A paged cache plus a block allocator; thread-safe."""

    def __init__(self, spec: KVCacheSpec, device: str | torch.device = "cpu") -> None:
        self.cache = PagedKVCache(spec, device=device)
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(spec.num_blocks))
        self._open: dict[str, list[int]] = {}
        self._committed: dict[str, list[int]] = {}
        self._secrets: dict[str, str] = {}
        self.commits: dict[str, KVCommitInfo] = {}
        self.aborts: dict[str, str] = {}  # reservation id -> reason
        self._failed: set[str] = set()  # open reservations a checksum failed in

    @property
    def kv_spec(self) -> KVCacheSpec:
        return self.cache.spec

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_reserve(self, num_blocks: int) -> bool:
        return 1 <= num_blocks <= len(self._free)

    def reserve(self, num_blocks: int, reservation_id: str | None = None,
                secret: str = "") -> str:
        """Takes `num_blocks` free blocks; raises RuntimeError when there is no room."""
        with self._lock:
            if not self.can_reserve(num_blocks):
                raise RuntimeError(f"cannot reserve {num_blocks} blocks, {len(self._free)} free")
            rid = reservation_id or uuid.uuid4().hex
            if rid in self._open or rid in self._committed:
                raise ValueError(f"reservation {rid!r} exists")
            self._open[rid] = [self._free.popleft() for _ in range(num_blocks)]
            self._secrets[rid] = secret
            return rid

    def block_table(self, reservation_id: str) -> list[int]:
        """Physical block ids of an open or committed reservation, in logical order."""
        with self._lock:
            table = self._open.get(reservation_id) or self._committed[reservation_id]
            return list(table)

    def release(self, reservation_id: str) -> None:
        """Frees a committed reservation's blocks (its sequence is finished)."""
        with self._lock:
            self._free.extend(self._committed.pop(reservation_id))

    # -- KVSink --------------------------------------------------------------------------

    def reservation_num_blocks(self, reservation_id: str) -> int | None:
        table = self._open.get(reservation_id)
        return None if table is None else len(table)

    def reservation_secret(self, reservation_id: str) -> str | None:
        return self._secrets.get(reservation_id) if reservation_id in self._open else None

    def write_kv(
        self, reservation_id: str, layer: int, block_indices: list[int],
        k: torch.Tensor, v: torch.Tensor, crc32c: int,
    ) -> None:
        with self._lock:
            table = self._open[reservation_id]
            phys = [table[i] for i in block_indices]
            # a reservation's blocks are its alone from the free list until abort or release
            try:
                ingest_blocks(self.cache.layer_caches(layer, k.shape[0]), phys, k, v, crc32c,
                              exclusive=True)
            except ValueError:
                self._failed.add(reservation_id)
                raise

    async def commit_kv(self, reservation_id: str, commit: KVCommitInfo) -> None:
        with self._lock:
            if reservation_id in self._failed:
                raise ValueError("crc32c: a chunk of this reservation failed its checksum")
            self._committed[reservation_id] = self._open.pop(reservation_id)
            self.commits[reservation_id] = commit

    def abort_kv(self, reservation_id: str, reason: str) -> None:
        with self._lock:
            table = self._open.pop(reservation_id, None)
            self._failed.discard(reservation_id)
            if table is None:
                return
            self._free.extend(table)
            self.aborts[reservation_id] = reason
