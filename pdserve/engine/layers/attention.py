"""The attention-backend interface: what every backend does per layer, and the per-step
batch layout it reads. Backends (pdserve.engine.attention.*) implement it; the registry
(pdserve.engine.layers.registry) picks one by name.

A forward step runs over one flat, unpadded batch of T tokens from B sequences. The first
`num_decodes` sequences are decodes (exactly one query token each, tokens [0, num_decodes));
the rest are prefill chunks. For every layer the model calls, in this order:

    backend.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = backend.forward(query, k_cache, v_cache, meta, scale)

so attention reads every key — cached prefix and the chunk's own — from the paged cache.
Each query token at absolute position p of its sequence attends to keys 0..p of that
sequence (causal over prefix + chunk).

Shapes:  query [T, num_heads, head_dim]; key/value [T, num_kv_heads, head_dim];
         k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] (pdserve.engine.kv_cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout, built once by the model runner and shared by all layers."""

    num_decodes: int  # the first num_decodes sequences have query_len == 1
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (prefix + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token; -1 = skip
    max_query_len: int
    max_seq_len: int
    # host copies so backends never sync on a device tensor to plan work
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and computes attention over it."""

    name: str = ""

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write key[i]/value[i] to slot slot_mapping[i] of the caches; -1 skips."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of every query token over its sequence's cached keys; [T, Hq, D]."""
