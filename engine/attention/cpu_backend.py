"""The `cpu` attention backend: decodes through the paged C kernel, everything else as the
`torch` backend does it.

Decode attention reads each sequence's K/V blocks in place through its block table
(engine/cpu_kernels/paged_decode.c) instead of gathering them into a padded batch for
SDPA. Prefill chunks and the KV store reuse the torch references unchanged.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from engine.attention.torch_backend import prefill_attention_reference, store_kv_reference
from engine.cpu_kernels.paged_decode import load, paged_decode_attention


@register_backend
class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        load()  # build now: a missing compiler fails at engine start, not mid-step
        self._planned_for: AttentionMetadata | None = None
        self._prefill_starts: list[int] = []

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return paged_decode_attention(query, k_cache, v_cache, meta.seq_lens,
                                          meta.block_tables, scale)
        # contiguous, so the kernel writes the decode rows in place
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if nd:
            paged_decode_attention(query[:nd], k_cache, v_cache, meta.seq_lens[:nd],
                                   meta.block_tables[:nd], scale, out=out[:nd])
        if self._planned_for is not meta:  # once per step, shared by all layers
            self._prefill_starts = list(accumulate(meta.query_lens_cpu[nd:], initial=0))
            self._planned_for = meta
        out[nd:] = prefill_attention_reference(
            query[nd:], k_cache, v_cache, self._prefill_starts, meta.seq_lens_cpu[nd:],
            meta.block_tables[nd:], scale)
        return out
