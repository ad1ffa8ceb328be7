"""The attention-backend interface and its registry.

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

import logging
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


_REGISTRY: dict[str, type[AttentionBackend]] = {}
_cpu_fallback_logged = False


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    _import_builtin()
    return sorted(_REGISTRY)


def get_backend(name: str, device: str | torch.device = "cpu") -> AttentionBackend:
    """`auto` picks triton on CUDA, cpu on the CPU when its C kernel builds, else torch."""
    global _cpu_fallback_logged
    _import_builtin()
    if name == "auto":
        kind = torch.device(device).type
        name = "triton" if kind == "cuda" else "torch"
        if kind == "cpu":
            try:
                return _REGISTRY["cpu"]()
            except RuntimeError as e:  # no compiler, or the build failed
                if not _cpu_fallback_logged:
                    _cpu_fallback_logged = True
                    logging.getLogger(__name__).warning(
                        "cpu attention kernel unavailable, using torch: %s", e)
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {['auto', *sorted(_REGISTRY)]}, "
                         f"got {name!r}")
    return _REGISTRY[name]()


def _import_builtin() -> None:
    # Imported lazily so that `pdserve.engine.attention` never pays for triton unless asked.
    import pdserve.engine.attention.cpu_backend  # noqa: F401
    import pdserve.engine.attention.torch_backend  # noqa: F401

    try:
        import pdserve.engine.attention.triton_backend  # noqa: F401
    except ImportError:
        pass
