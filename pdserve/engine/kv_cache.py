"""The paged KV cache: its layout (the transfer contract) and the tensors that hold it.

Layout, defined once here and nowhere else:

    per layer:  K, V : [num_blocks, block_size, num_kv_heads, head_dim]   (contiguous)
    slot s  =  block_id * block_size + offset_in_block

All layers live in one tensor `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`
so that a layer's K (or V) is a contiguous view and one block of one layer is a contiguous
`block_size * kv_heads * head_dim` run of elements — what the KV-transfer wire format ships.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of a paged KV cache; equal specs are required on both transfer ends."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        dtype_from_name(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V)."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block_all_layers(self) -> int:
        return 2 * self.num_layers * self.block_bytes

    @staticmethod
    def blocks_for_budget(
        budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: str,
    ) -> int:
        per_block = KVCacheSpec(num_layers, 1, block_size, num_kv_heads, head_dim, dtype)
        n = budget_bytes // per_block.bytes_per_block_all_layers
        if n < 1:
            raise ValueError(
                f"kv cache budget of {budget_bytes} bytes holds no block "
                f"({per_block.bytes_per_block_all_layers} bytes each)"
            )
        return int(n)


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
