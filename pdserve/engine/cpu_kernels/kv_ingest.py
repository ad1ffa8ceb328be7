"""The Python side of kv_ingest.c as a typed torch op: `pdserve::ingest_kv_blocks`, the
one-pass path of `pdserve.engine.kv_blocks.ingest_blocks` (whose two-pass path, a CRC-32C
of the bytes and then `copy_blocks`, is its reference in the tests).

The op's body checks devices, dtypes, shapes, contiguity and every block id against the
caches' rows before the ctypes call, so nothing reaches C that could make it write outside
the cache rows named.
"""

from __future__ import annotations

import torch

from pdserve.engine.cpu_kernels.crc_copy import check_path, path_code
from pdserve.engine.cpu_kernels.library import load, register_fake, require, typed_op


def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor, path: str) -> None:
    require(k_cache=k_cache, v_cache=v_cache, block_ids=block_ids, k=k, v=v)
    check_path(path)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 1:
            raise ValueError(f"{name} must be a contiguous CPU tensor, got shape "
                             f"{tuple(t.shape)} strides {t.stride()} on {t.device}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} differs from "
                         f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}")
    n = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.dtype != k_cache.dtype or t.shape != (n, *k_cache.shape[1:]):
            raise ValueError(f"{name} must be [{n}, {', '.join(map(str, k_cache.shape[1:]))}] "
                             f"{k_cache.dtype}, got {tuple(t.shape)} {t.dtype}")
    if (block_ids.dtype != torch.int64 or block_ids.shape != (n,)
            or not block_ids.is_contiguous() or block_ids.device.type != "cpu"):
        raise ValueError(f"block_ids must be a contiguous int64 CPU [{n}], got "
                         f"{block_ids.dtype} {tuple(block_ids.shape)} on {block_ids.device}")


@typed_op("ingest_kv_blocks", mutates_args=("k_cache", "v_cache"))
def ingest_kv_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, crc: int = 0, path: str = "auto") -> int:
    """k_cache[block_ids[i]] = k[i] and v_cache[block_ids[i]] = v[i] for every i; returns the
    CRC-32C of k's bytes followed by v's, taken as they are copied, continued from `crc`
    (the CRC-32C of the bytes before them, as for the later layers of a multi-layer chunk).

    k_cache, v_cache: one layer's `[num_blocks, ...]`, contiguous; k, v: `[n, ...]` of the
    same block shape and dtype, contiguous; block_ids: int64 `[n]`, each in [0, num_blocks).
    path: the CRC-32C implementation, as `pdserve::copy_crc32c`'s ("auto": the fastest).
    """
    _check(k_cache, v_cache, block_ids, k, v, path)
    code = path_code(path)
    n = k.shape[0]
    if not 0 <= crc < 1 << 32:
        raise ValueError(f"crc must be a uint32, got {crc}")
    if n == 0:
        return crc
    lo, hi = int(block_ids.min()), int(block_ids.max())
    if lo < 0 or hi >= k_cache.shape[0]:
        raise ValueError(f"block_ids: {lo if lo < 0 else hi} outside [0, {k_cache.shape[0]})")
    block_bytes = k[0].numel() * k.element_size()
    return int(load().ki_ingest_blocks(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
                                       v_cache.data_ptr(), block_ids.data_ptr(), n,
                                       block_bytes, code, crc))


@register_fake("ingest_kv_blocks")
def _(k_cache, v_cache, block_ids, k, v, crc=0, path="auto"):
    _check(k_cache, v_cache, block_ids, k, v, path)
    return 0
