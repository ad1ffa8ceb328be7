"""The `cpu` attention backend: the paged C kernel for decodes and short prefill chunks,
the torch reference for the rest.

The kernel (engine/cpu_kernels/paged_decode.c) reads each sequence's K/V blocks in place
through its block table instead of gathering them into a padded batch for SDPA. A prefill
chunk is run through it too, one row per query token with that token's causal context,
when its context is short enough that re-reading the (cache-resident) K/V per token is
still cheaper than SDPA: see ROWWISE_PREFILL_MAX_CONTEXT.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, register_backend
from engine.attention.torch_backend import DecodeThenPrefillBackend
from engine.cpu_kernels.library import load
from engine.cpu_kernels.paged_decode import paged_decode_attention

# The longest context (prefix + chunk) for which a step's prefill chunks go through the
# kernel row-wise. Per layer, 2 threads, against the SDPA reference (docs/benchmarks.md
# section 1): bfloat16 1.2-3x faster up to 4k tokens of context (its SDPA runs at ~60
# GFLOP/s); float32 2-3.6x faster up to 128, 1.35x at 512, slower from 1k on.
ROWWISE_PREFILL_MAX_CONTEXT = {torch.float32: 512, torch.bfloat16: 4096}


@register_backend
class CpuAttentionBackend(DecodeThenPrefillBackend):
    name = "cpu"

    def __init__(self) -> None:
        load()  # build now: a missing compiler fails at engine start, not mid-step
        super().__init__()
        self._lens = torch.empty(0, dtype=torch.int32)
        self._tables = torch.empty(0, 0, dtype=torch.int32)

    def _plan(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> int:
        nd = meta.num_decodes
        self._lens, self._tables = meta.seq_lens, meta.block_tables
        limit = ROWWISE_PREFILL_MAX_CONTEXT.get(k_cache.dtype, 0)
        if nd == meta.num_seqs or max(meta.seq_lens_cpu[nd:]) > limit:
            return nd
        # all of the step row-wise: the token at offset j of a chunk of length q that ends
        # at context length L attends to the first L - q + 1 + j keys
        qlens = torch.tensor(meta.query_lens_cpu)
        seq = torch.repeat_interleave(torch.arange(meta.num_seqs), qlens)
        offset = torch.arange(seq.shape[0]) - meta.query_start_loc[seq]
        self._lens = (meta.seq_lens[seq] - qlens[seq] + 1 + offset).to(torch.int32)
        self._tables = meta.block_tables[seq]
        return meta.num_seqs

    def _decode(self, query, k_cache, v_cache, meta, scale, out=None):
        n = query.shape[0]
        return paged_decode_attention(query, k_cache, v_cache, self._lens[:n],
                                      self._tables[:n], scale, out=out)
