"""The paged KV cache's layout as a value: shape, dtype name and byte sizes — the transfer
contract two workers compare, and what the gateway's registry and router read. Torch-free
(the gateway imports it); the tensors that follow this layout are `kv_cache.PagedKVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# bytes per element of each KV dtype the engine supports
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_dtype_name(name: str) -> str:
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    return name


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
        check_dtype_name(self.dtype)

    @property
    def torch_dtype(self) -> Any:
        """The torch dtype (imports torch: for worker processes only)."""
        from pdserve.engine.kv_cache import dtype_from_name

        return dtype_from_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V)."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

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
