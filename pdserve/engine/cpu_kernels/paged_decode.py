"""The Python side of paged_decode.c: the typed op `pdserve::paged_decode_attention`.

Every argument is checked before the kernel runs (its types by the op's schema at the
call, the rest here, and per-sequence lengths and block ids by the library's own
`pd_validate` pass, which reads only the int32 tables) so that the kernel never reads
outside the tensors it is given. The fake implementation checks what metadata can tell.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.engine.cpu_kernels.library import (
    DTYPE_CODES,
    load,
    register_fake,
    require,
    typed_op,
)

MAX_HEAD_DIM = 256


def shape_errors(query, k_cache, v_cache, seq_lens, block_tables, out, num_seqs=None):
    """Why these tensors cannot be passed to a paged kernel, or None; seq_lens and
    block_tables have one row per sequence (num_seqs, default: one per query row).
    Conditions first and messages only on failure: this runs for every layer of every
    step."""
    require(query=query, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens,
            block_tables=block_tables)
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("seq_lens", seq_lens), ("block_tables", block_tables), ("out", out)):
        if t is not None and t.device.type != "cpu":
            return f"{name} must be on the CPU, got {t.device}"
    if query.dim() != 3:
        return f"query must be [B, Hq, D], got shape {tuple(query.shape)}"
    if query.dtype not in DTYPE_CODES:
        return f"query dtype must be float32 or bfloat16, got {query.dtype}"
    if k_cache.dim() != 4:
        return f"k_cache must be [N, block_size, Hkv, D], got shape {tuple(k_cache.shape)}"
    if k_cache.dtype not in DTYPE_CODES:
        return f"k_cache dtype must be float32 or bfloat16, got {k_cache.dtype}"
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        return (f"v_cache must match k_cache ({tuple(k_cache.shape)}, {k_cache.dtype}), got "
                f"{tuple(v_cache.shape)}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "k_cache and v_cache must be contiguous"
    t, hq, d = query.shape
    b = t if num_seqs is None else num_seqs
    hkv, dk = k_cache.shape[2:]
    if dk != d:
        return f"query head_dim {d} != k_cache head_dim {dk}"
    if not 0 < d <= MAX_HEAD_DIM:
        return f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}"
    if hkv == 0 or hq % hkv:
        return f"query heads ({hq}) must be a multiple of k_cache KV heads ({hkv})"
    qs = query.stride()
    if (d > 1 and qs[2] != 1) or (hq > 1 and qs[1] != d):
        return f"query must have contiguous heads and dims, got strides {qs}"
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (b,) or not seq_lens.is_contiguous():
        return (f"seq_lens must be a contiguous int32 [{b}], got {seq_lens.dtype} "
                f"{tuple(seq_lens.shape)}")
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2
            or block_tables.shape[0] != b
            or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1)):
        return (f"block_tables must be int32 [{b}, max_blocks] with contiguous rows, got "
                f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if out is not None and (out.shape != (t, hq, d) or out.dtype != query.dtype
                            or not out.is_contiguous()):
        return (f"out must be a contiguous {query.dtype} [{t}, {hq}, {d}], got {out.dtype} "
                f"{tuple(out.shape)}")
    return None


def check_tables(seq_lens: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor
                 ) -> None:
    """ValueError unless every length fits its table row and every block id it reaches is
    inside the cache (read in C: only the int32 tables)."""
    num_blocks, block_size = k_cache.shape[:2]
    row, value = ctypes.c_int(), ctypes.c_int64()
    bad = load().pd_validate(seq_lens.data_ptr(), block_tables.data_ptr(),
                             block_tables.stride(0), seq_lens.shape[0], block_tables.shape[1],
                             block_size, num_blocks, ctypes.byref(row), ctypes.byref(value))
    if bad == 1:
        raise ValueError(f"seq_lens[{row.value}] = {value.value} must be in 1.."
                         f"{block_tables.shape[1] * block_size} (max_blocks * block_size)")
    if bad == 2:
        raise ValueError(f"block_tables row {row.value} uses block id {value.value}, outside "
                         f"the cache's 0..{num_blocks - 1}")


@typed_op("paged_decode_attention", mutates_args=("out",))
def _paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]; heads and dims packed, any batch stride
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor,  # [B, Hq, D] contiguous, query's dtype
) -> None:
    require(out=out)
    err = shape_errors(query, k_cache, v_cache, seq_lens, block_tables, out)
    if err:
        raise ValueError(err)
    b, hq, d = query.shape
    if b == 0:
        return
    lib = load()
    check_tables(seq_lens, block_tables, k_cache)
    block_size, hkv = k_cache.shape[1:3]
    rc = lib.pd_decode(query.data_ptr(), query.stride(0), k_cache.data_ptr(),
                       v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                       seq_lens.data_ptr(), out.data_ptr(), b, hq, hkv, d, block_size,
                       float(scale), DTYPE_CODES[query.dtype], DTYPE_CODES[k_cache.dtype],
                       torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged decode kernel could not allocate its scratch memory")


@register_fake("paged_decode_attention")
def _(query, k_cache, v_cache, seq_lens, block_tables, scale, out):
    require(out=out)
    err = shape_errors(query, k_cache, v_cache, seq_lens, block_tables, out)
    if err:
        raise ValueError(err)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q·K[:seq_len]) · V[:seq_len] per sequence and query head; query head
    h reads KV head h // (Hq // Hkv). Returns `out` (allocated when not given). Shapes: the
    op `pdserve::paged_decode_attention` above."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    _paged_decode_attention(query, k_cache, v_cache, seq_lens, block_tables, float(scale), out)
    return out
