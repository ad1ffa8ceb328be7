"""The `triton` attention backend: the kernels of `pdserve.engine.kernels` behind AttentionBackend.

Per step, the first `meta.num_decodes` sequences go to the paged decode kernel (split-K
chosen by its heuristic) and the prefill chunks to the varlen prefill kernel. Block ids
and slots are validated (a device sync) once per step — the first layer to see a new
AttentionMetadata / slot_mapping — not once per layer; later layers rely on the kernels'
masking, which never writes out of bounds.

On a CPU device the kernels must run under the Triton interpreter. The kernel modules are
imported on first use, so when nothing has imported them yet this backend turns the
interpreter on itself; if they were already compiled for a GPU it raises a clear error.
"""

from __future__ import annotations

import os
import sys

import torch
import triton  # noqa: F401  (an ImportError here: the registry lists no triton backend)

from pdserve.engine.layers.attention import AttentionBackend, AttentionMetadata


def _load_kernels(device: torch.device):
    if device.type == "cpu" and "pdserve.engine.kernels.common" not in sys.modules:
        # Interpreter mode is fixed when a kernel is decorated, i.e. at this import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from pdserve.engine.kernels.common import interpreted
    from pdserve.engine.kernels.paged_decode_attention import paged_decode_attention
    from pdserve.engine.kernels.prefill_attention import prefill_attention
    from pdserve.engine.kernels.store_kv import store_kv

    if device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "the triton attention backend on a CPU device needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before pdserve.engine.kernels is first imported "
            "(or use attention_backend='torch')"
        )
    return store_kv, paged_decode_attention, prefill_attention


def _capturing(t: torch.Tensor) -> bool:
    # A check is a device sync, which a CUDA graph capture forbids; a captured decode step
    # reads block ids the scheduler wrote into the runner's buffers (the kernels mask).
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self._kernels = None
        # What was validated last, compared by identity: the runner builds new tensors every
        # step, so each step is checked once. (No version counter: inference-mode tensors
        # have none.) A buffer reused in place would skip the check; the kernels' masking
        # still keeps every access in bounds.
        self._checked_slots: torch.Tensor | None = None
        self._checked_meta: AttentionMetadata | None = None

    def _get_kernels(self, device: torch.device):
        if self._kernels is None:
            self._kernels = _load_kernels(device)
        return self._kernels

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv, _, _ = self._get_kernels(key.device)
        store_kv(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                 slot_mapping=slot_mapping,
                 validate=slot_mapping is not self._checked_slots and not _capturing(key))
        self._checked_slots = slot_mapping

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, decode, prefill = self._get_kernels(query.device)
        validate = meta is not self._checked_meta and not _capturing(query)
        nd = meta.num_decodes
        # the kernels take the query in the cache's dtype (a float32 model may keep its KV
        # cache in bfloat16: kv_cache_dtype)
        model_dtype, query = query.dtype, query.to(k_cache.dtype)
        out = torch.empty_like(query)
        if nd:
            decode(query=query[:nd], k_cache=k_cache, v_cache=v_cache,
                   seq_lens=meta.seq_lens[:nd], block_tables=meta.block_tables[:nd],
                   scale=scale, max_seq_len=max(meta.seq_lens_cpu[:nd]), out=out[:nd],
                   validate=validate)
        if nd < meta.num_seqs:
            # query_start_loc[nd:] starts at nd; the prefill kernel reads offsets relative
            # to its first entry, so the slice needs no rebasing.
            prefill(query=query[nd:], k_cache=k_cache, v_cache=v_cache,
                    cu_seqlens=meta.query_start_loc[nd:], seq_lens=meta.seq_lens[nd:],
                    block_tables=meta.block_tables[nd:], scale=scale,
                    max_query_len=max(meta.query_lens_cpu[nd:]), out=out[nd:],
                    validate=validate)
        self._checked_meta = meta
        return out.to(model_dtype)
