"""Chained hashes of full KV blocks: block i's hash covers every token up to its end.

The hash is stable across processes (blake2b, not Python's `hash`) because the gateway
computes it too, to route a prompt to the prefill worker that already caches its prefix.
This module imports nothing heavy so the gateway can use it without torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent is None else parent))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little") >> 1  # fits in a signed int64 / proto uint64


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids` (at most `limit` of them)."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[int] = []
    parent = None
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
