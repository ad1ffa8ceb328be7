"""The `cpu` attention backend: the paged C kernels, which read each sequence's K/V blocks
in place through its block table instead of gathering them for SDPA.

Decodes go through the decode kernel (engine/cpu_kernels/paged_decode.c), prefill chunks
through the prefill kernel (paged_prefill.c: tiles of query tokens against tiles of
keys). Head dims the prefill kernel does not take (not a multiple of 16) fall back to the
torch reference for the prefill chunks.
"""

from __future__ import annotations

from pdserve.engine.attention.torch_backend import DecodeThenPrefillBackend
from pdserve.engine.cpu_kernels.library import load
from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention
from pdserve.engine.cpu_kernels.paged_prefill import paged_prefill_attention, supports_head_dim


class CpuAttentionBackend(DecodeThenPrefillBackend):
    name = "cpu"

    def __init__(self) -> None:
        load()  # build now: a missing compiler fails at engine start, not mid-step
        super().__init__()

    def _decode(self, query, k_cache, v_cache, meta, scale, out=None):
        nd = query.shape[0]
        return paged_decode_attention(query, k_cache, v_cache, meta.seq_lens[:nd],
                                      meta.block_tables[:nd], scale, out=out)

    def _prefill(self, query, k_cache, v_cache, meta, scale, out):
        if not supports_head_dim(query.shape[-1]):
            super()._prefill(query, k_cache, v_cache, meta, scale, out)
            return
        nd = meta.num_decodes
        paged_prefill_attention(query, k_cache, v_cache, meta.query_lens_cpu[nd:],
                                meta.seq_lens_cpu[nd:], meta.block_tables[nd:], scale, out=out)
