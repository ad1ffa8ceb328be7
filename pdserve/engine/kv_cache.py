"""The paged KV cache: the tensors that hold it, laid out as `kv_spec.KVCacheSpec` says
(the spec itself is torch-free, in `kv_spec`, so the gateway can use it).

Layout, defined once here and nowhere else:

    per layer:  K, V : [num_blocks, block_size, num_kv_heads, head_dim]   (contiguous)
    slot s  =  block_id * block_size + offset_in_block

All layers live in one tensor `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`
so that a layer's K (or V) is a contiguous view and one block of one layer is a contiguous
`block_size * kv_heads * head_dim` run of elements — what the KV-transfer wire format ships.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv_spec import KVCacheSpec, check_dtype_name

__all__ = ["PagedKVCache", "dtype_from_name", "dtype_name", "parse_bytes"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[check_dtype_name(name)]


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


class PagedKVCache:
    """The tensors of a paged KV cache laid out as `KVCacheSpec` says."""

    def __init__(self, spec: KVCacheSpec, device: str | torch.device = "cpu") -> None:
        self.spec = spec
        self.data = torch.zeros(
            (spec.num_layers, 2, spec.num_blocks, spec.block_size, spec.num_kv_heads,
             spec.head_dim),
            dtype=spec.torch_dtype,
            device=device,
        )

    def key(self, layer: int) -> torch.Tensor:
        # [num_blocks, block_size, kv_heads, head_dim]
        return self.data[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def layer_caches(self, first: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of layers first .. first + count - 1: where a chunk of several layers goes."""
        if first < 0 or first + count > self.spec.num_layers:
            raise IndexError(f"layers {first}..{first + count - 1} outside the cache's "
                             f"{self.spec.num_layers}")
        return [(self.key(i), self.value(i)) for i in range(first, first + count)]


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MiB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse a byte size from {text!r} (try '2GiB' or '512MiB')")
    return int(float(num) * _UNITS[unit])
