"""The `cpu` attention backend: decodes through the paged C kernel, everything else as the
`torch` backend does it.

Decode attention reads each sequence's K/V blocks in place through its block table
(engine/cpu_kernels/paged_decode.c) instead of gathering them into a padded batch for
SDPA. Prefill chunks and the KV store reuse the torch references unchanged.
"""

from __future__ import annotations

from engine.attention.backend import register_backend
from engine.attention.torch_backend import DecodeThenPrefillBackend
from engine.cpu_kernels.paged_decode import load, paged_decode_attention


@register_backend
class CpuAttentionBackend(DecodeThenPrefillBackend):
    name = "cpu"

    def __init__(self) -> None:
        load()  # build now: a missing compiler fails at engine start, not mid-step
        super().__init__()

    def _decode(self, query, k_cache, v_cache, meta, scale, out=None):
        nd = query.shape[0]
        return paged_decode_attention(query, k_cache, v_cache, meta.seq_lens[:nd],
                                      meta.block_tables[:nd], scale, out=out)
