"""The `cpu` attention backend: the paged C kernels, which read each sequence's K/V blocks
in place through its block table instead of gathering them for SDPA.

Decodes go through the decode kernel (engine/cpu_kernels/paged_decode.c). Prefill chunks
go through the prefill kernel (paged_prefill.c, query tiles against K/V tiles), except in
steps where every chunk's context is short: there the decode kernel takes them too, one row
per query token with that token's causal context, which costs less than setting up tiles
(see ROWWISE_PREFILL_MAX_CONTEXT). Head dims the prefill kernel does not take (not a
multiple of 16) fall back to the torch reference.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, register_backend
from engine.attention.torch_backend import DecodeThenPrefillBackend
from engine.cpu_kernels.library import load
from engine.cpu_kernels.paged_decode import paged_decode_attention
from engine.cpu_kernels.paged_prefill import paged_prefill_attention, supports_head_dim

# The longest context (prefix + chunk) for which a step's prefill chunks go through the
# decode kernel row-wise rather than the prefill kernel. Per layer, 2 threads, SmolLM2's
# heads (docs/benchmarks.md section 1): row-wise is ahead up to ~256 tokens in float32 and
# ~1-2k in bfloat16 (the decode kernel's q.k is vdpbf16ps there), the prefill kernel from
# then on (float32 at 512: 3.2 vs 3.8 ms; at 2k + 2k of prefix: 117 vs 188 ms).
ROWWISE_PREFILL_MAX_CONTEXT = {torch.float32: 256, torch.bfloat16: 2048}


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

    def _prefill(self, query, k_cache, v_cache, meta, first_seq, scale, out):
        if not supports_head_dim(query.shape[-1]):
            super()._prefill(query, k_cache, v_cache, meta, first_seq, scale, out)
            return
        paged_prefill_attention(query, k_cache, v_cache, meta.query_lens_cpu[first_seq:],
                                meta.seq_lens_cpu[first_seq:], meta.block_tables[first_seq:],
                                scale, out=out)
