"""What the Triton launchers share: the interpreter switch, argument checks that turn bad
input into a clear ValueError before anything is launched, and the one place a (sequence
position -> cache element) offset is computed, in int64: `block_ids` (the block table
lookup, split out so a kernel can issue it a tile ahead of its K/V loads) and
`paged_row_offsets`, composed by `paged_offsets`.

On a machine without a GPU the kernels run under the Triton interpreter, which is chosen
when a kernel is *decorated*: `TRITON_INTERPRET=1` must be in the environment before these
modules are imported (importing triton or torch earlier is fine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _probe() -> None:
    pass


def interpreted() -> bool:
    """True when this process's kernels were decorated in interpreter mode."""
    # Asking a kernel object itself is exact; the env var may have changed since import.
    return type(_probe).__name__ == "InterpretedFunction"


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and one the decorated kernels can run on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    dev = next(iter(devices))
    if dev.type == "cpu" and not interpreted():
        raise RuntimeError(
            "Triton kernels got CPU tensors but were compiled for a GPU: set "
            "TRITON_INTERPRET=1 in the environment before pdserve.engine.kernels is imported "
            "to run them under the Triton interpreter"
        )


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    # Kernels index every dim by stride but load head_dim as one vector: it must be dense.
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dim, got strides "
                             f"{tuple(t.stride())}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The paged layout of `pdserve.engine.kv_cache`: (num_blocks, block_size, kv_heads, dim)."""
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache/v_cache dtypes must match and be one of {CACHE_DTYPES}, "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    # One set of strides is passed for both caches.
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache strides {v_cache.stride()} != k_cache strides "
                         f"{k_cache.stride()}")
    check_last_dim_contiguous(k_cache=k_cache)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, kv_heads, head_dim


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_seq_lens_and_blocks(
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: int,
    block_size: int,
    min_len: torch.Tensor | int = 1,
) -> None:
    """seq_lens in [min_len, table capacity]; every block id a sequence uses in range.

    Reads device values, so it syncs: the backend runs it once per step, not per layer.
    """
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables must be [{seq_lens.shape[0]}, max_blocks], got "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.long()
    bad = (lens < min_len) | (lens > capacity)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        lo = min_len if isinstance(min_len, int) else int(min_len[i])
        raise ValueError(f"seq_lens[{i}] = {int(lens[i])} is outside [{lo}, {capacity}] "
                         f"(its block table row holds {block_tables.shape[1]} blocks of "
                         f"{block_size})")
    used_blocks = (lens + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = cols.unsqueeze(0) < used_blocks.unsqueeze(1)
    ids = block_tables.long()
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block id {int(ids[row, col])} at block_tables[{row}, {col}] is out "
                         f"of range for a cache of {num_blocks} blocks")


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """Constexpr flags for `tl.dot` in the attention kernels."""
    # The interpreter's dot multiplies bf16 as raw integer bits (garbage) and fp16 in
    # fp16; upcasting reproduces the GPU's exact-product, fp32-accumulate dot.
    upcast = interpreted() and dtype != torch.float32
    return {
        # fp32 caches are the parity path: tf32 would cost ~3 decimal digits. For 16-bit
        # inputs the precision flag does not apply.
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32",
        "UPCAST_DOT": upcast,
    }


@triton.jit
def block_ids(
    block_table_row_ptr,  # this sequence's row of block_tables
    pos,  # [N] token positions within the sequence
    pos_mask,  # [N] positions that exist; others get block 0, read harmlessly or masked
    BLOCK_SIZE: tl.constexpr,
):
    """[N] block id holding each position (a load: kernels fetch it one tile ahead)."""
    return tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0)


@triton.jit
def paged_row_offsets(
    block_id,  # [N] from `block_ids`
    pos,  # [N] the same positions
    head,  # kv head index (scalar)
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
):
    """[N] int64 element offsets of the first head_dim element of each position's K/V."""
    # int64 before any multiply: block_id * stride_block passes 2**31 for big caches.
    return (block_id.to(tl.int64) * stride_block
            + (pos % BLOCK_SIZE).to(tl.int64) * stride_slot
            + head.to(tl.int64) * stride_head)


@triton.jit
def paged_offsets(
    block_table_row_ptr,  # this sequence's row of block_tables
    pos,  # [N] token positions within the sequence
    pos_mask,  # [N] positions that exist; others read block 0 harmlessly
    head,  # kv head index (scalar)
    offs_d,  # [D] element offsets within head_dim
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
):
    """[N, D] int64 element offsets of K/V for `pos` of one sequence in the paged cache."""
    block_id = block_ids(block_table_row_ptr, pos, pos_mask, BLOCK_SIZE)
    row = paged_row_offsets(block_id, pos, head, stride_block, stride_slot, stride_head,
                            BLOCK_SIZE)
    return row[:, None] + offs_d[None, :]
