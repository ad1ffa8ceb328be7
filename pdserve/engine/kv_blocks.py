"""Copying whole KV blocks in and out of one layer's K (or V) tensor `[num_blocks, ...]`:
the KV connector's save (copy-out) and load (copy-in) sides, and the in-memory sink; and
`ingest_blocks`, the load side's copy of received KV checked against its CRC-32C.

On the CPU, torch's `index_select`, `index_copy_` and `index_put_` move a block's elements
one at a time: measured on the 2-core dev machine, ~0.1-0.16 ms per MiB against ~0.03-0.06
for a plain copy, on the decode worker's one core (or the prefill worker's compute thread).
So a run of consecutive ascending block ids (what a fresh pool hands out) is copied as one
slice, and any other order goes through numpy's fancy indexing over the blocks seen as rows
of bytes, which copies each block as one run whatever the dtype (bfloat16 included): ~0.14
ms per MiB for a descending run against ~0.19 with `index_copy_`, ~0.11 for a slice (cold
caches, one core). Tensors on other devices use torch's ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
from crc32c import crc32c as crc32c_of


def _rows(t: torch.Tensor) -> np.ndarray | None:
    """t as a uint8 numpy view `[num_blocks, bytes per block]` sharing its memory, or None
    where there is none (not on the CPU, not contiguous, empty)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


def _check_ids(block_ids: Sequence[int], num_blocks: int) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.intp)
    # numpy would wrap negative ids around: refuse them rather than write the wrong block
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise IndexError(f"block ids {list(block_ids)[:8]} outside [0, {num_blocks})")
    return ids


def _run(block_ids: Sequence[int], num_blocks: int) -> slice | None:
    """The slice of blocks when block_ids is first, first + 1, ..., else None."""
    n = len(block_ids)
    if n == 0:
        return None
    first = int(block_ids[0])
    if list(block_ids) != list(range(first, first + n)):
        return None
    if first < 0 or first + n > num_blocks:
        raise IndexError(f"block ids {first}..{first + n - 1} outside [0, {num_blocks})")
    return slice(first, first + n)


def gather_blocks(src: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """A new contiguous tensor `[len(block_ids), ...]` of src's blocks, on src's device."""
    run = _run(block_ids, src.shape[0])
    if run is not None:
        return src[run].clone()
    ids = _check_ids(block_ids, src.shape[0])
    rows = _rows(src)
    if rows is None or ids.size == 0:
        index = torch.as_tensor(ids, dtype=torch.long, device=src.device)
        return src.index_select(0, index)
    out = torch.from_numpy(rows[ids])  # fancy indexing returns a fresh C-contiguous copy
    return out.view(src.dtype).view(len(ids), *src.shape[1:])


def copy_blocks(dst: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor) -> None:
    """dst[block_ids[i]] = src[i] for every i; block_ids must be distinct.

    dst: `[num_blocks, ...]`; src: `[len(block_ids), ...]` of dst's dtype, any device.
    """
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or \
            src.shape[0] != len(block_ids):
        raise ValueError(f"cannot copy {tuple(src.shape)} {src.dtype} into blocks "
                         f"{list(block_ids)[:8]} of {tuple(dst.shape)} {dst.dtype}")
    src = src.to(dst.device)
    run = _run(block_ids, dst.shape[0])
    if run is not None:
        dst[run].copy_(src)
        return
    ids = _check_ids(block_ids, dst.shape[0])
    rows = _rows(dst)
    if rows is None or ids.size == 0:
        index = torch.as_tensor(ids, dtype=torch.long, device=dst.device)
        dst.index_copy_(0, index, src)
        return
    rows[ids] = src.reshape(len(ids), -1).view(torch.uint8).numpy()


class ChecksumMismatch(ValueError):
    """Received KV whose bytes do not have the CRC-32C its sender stated."""

    def __init__(self, got: int, want: int) -> None:
        super().__init__(f"crc32c: payload checksum mismatch ({got:#010x}, the chunk says "
                         f"{want:#010x})")


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@functools.cache
def _fused_op() -> Callable[..., int] | None:
    """The C op, imported on first use; None (warned once) when it cannot start."""
    from pdserve.engine.cpu_kernels.library import op_or_none

    return op_or_none("kv_ingest", "ingest_kv_blocks", "KV ingest: the C copy with CRC-32C",
                      "received KV is checked, then copied")


def ingest_blocks(layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  block_ids: Sequence[int] | np.ndarray, k: torch.Tensor, v: torch.Tensor,
                  crc32c: int, *, exclusive: bool) -> None:
    """For each layer l: layers[l][0][block_ids[i]] = k[l][i] and layers[l][1][block_ids[i]]
    = v[l][i] for every i, provided the CRC-32C of the bytes k[0], v[0], k[1], v[1], ... in
    that order (a chunk's payload) is `crc32c`; raises ChecksumMismatch otherwise.

    layers: the (K, V) caches `[num_blocks, ...]` of each layer the chunk covers; k, v:
    `[len(layers), n, ...]` on the CPU (views into one payload will do).
    exclusive: the blocks belong to the writer alone (no other sequence holds or can read
    them, none is in the prefix cache), so they may take the bytes before the verdict —
    one pass, copying and checksumming together in C, and on a mismatch the blocks hold
    bytes their owner must discard. Otherwise, and wherever the C op cannot run (another
    device, a layout it does not take, no compiler), the bytes are checked first and a
    mismatch leaves every block untouched.
    """
    if len(layers) != k.shape[0] or k.shape != v.shape:
        raise ValueError(f"{len(layers)} layers of caches for k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    fused = _fused_op() if exclusive else None
    if fused is not None and all(_fusable(kd, vd, k[i], v[i])
                                 for i, (kd, vd) in enumerate(layers)):
        # from numpy: a quarter of torch.tensor(list)'s cost for a 4k prompt's 256 ids,
        # and this runs once per received chunk on the engine thread
        ids = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64))
        got = 0
        for i, (k_dst, v_dst) in enumerate(layers):
            got = fused(k_dst, v_dst, ids, k[i], v[i], crc=got)
    else:
        got = 0
        for i in range(len(layers)):
            got = crc32c_of(_bytes_of(v[i].contiguous()),
                            crc32c_of(_bytes_of(k[i].contiguous()), got))
        if got == crc32c:
            for i, (k_dst, v_dst) in enumerate(layers):
                copy_blocks(k_dst, block_ids, k[i])
                copy_blocks(v_dst, block_ids, v[i])
    if got != crc32c:
        raise ChecksumMismatch(got, crc32c)


def _fusable(k_dst: torch.Tensor, v_dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor
             ) -> bool:
    """The C op takes these: contiguous CPU tensors of the caches' dtype."""
    return (k_dst.device.type == v_dst.device.type == k.device.type == v.device.type == "cpu"
            and k_dst.is_contiguous() and v_dst.is_contiguous() and k.is_contiguous()
            and v.is_contiguous() and k.dtype == k_dst.dtype and v.dtype == v_dst.dtype)
