"""The Python side of paged_prefill.c: the typed op `pdserve::paged_prefill_attention`.

Argument types are checked by the op's schema at the call, shapes and dtypes here, lengths
and block ids by the library's `pd_validate` (shared with the decode kernel), so the kernel
never reads outside the tensors given. The fake implementation checks what metadata can
tell.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from pdserve.engine.cpu_kernels.library import (
    DTYPE_CODES,
    load,
    register_fake,
    require,
    typed_op,
)
from pdserve.engine.cpu_kernels.paged_decode import check_tables, shape_errors


def supports_head_dim(head_dim: int) -> bool:
    """The kernel's vector loops take head dims in multiples of 16, up to 512."""
    return head_dim % 16 == 0 and 0 < head_dim <= 512


def _check(query, k_cache, v_cache, query_lens, seq_lens, block_tables, out
           ) -> torch.Tensor:
    """seq_lens as an int32 tensor, after every check that needs no cache data."""
    require(out=out)
    p = len(query_lens)
    if len(seq_lens) != p:
        raise ValueError(f"seq_lens has {len(seq_lens)} entries, query_lens {p}")
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    err = shape_errors(query, k_cache, v_cache, lens, block_tables, out, num_seqs=p)
    if err:
        raise ValueError(err)
    t, hq, d = query.shape
    if not supports_head_dim(d):
        raise ValueError(f"head_dim must be a multiple of 16 up to 512, got {d}")
    if sum(query_lens) != t:
        raise ValueError(f"query_lens sum to {sum(query_lens)}, not the {t} query rows")
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if not 0 < q <= s:
            raise ValueError(f"chunk {i}: query length {q} must be in 1..seq_len ({s})")
    return lens


@typed_op("paged_prefill_attention", mutates_args=("out",))
def _paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]; heads and dims packed, any token stride
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    v_cache: torch.Tensor,
    query_lens: list[int],  # [P]: chunk p is the next query_lens[p] query rows
    seq_lens: list[int],  # [P]: context length after each chunk
    block_tables: torch.Tensor,  # [P, max_blocks] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] contiguous, query's dtype
) -> None:
    lens = _check(query, k_cache, v_cache, query_lens, seq_lens, block_tables, out)
    t, hq, d = query.shape
    if t == 0:
        return
    lib = load()
    check_tables(lens, block_tables, k_cache)
    starts = torch.tensor(list(accumulate(query_lens, initial=0)), dtype=torch.int32)
    block_size, hkv = k_cache.shape[1:3]
    rc = lib.pf_prefill(query.data_ptr(), query.stride(0), k_cache.data_ptr(),
                        v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                        starts.data_ptr(), lens.data_ptr(), out.data_ptr(), len(query_lens),
                        hq, hkv, d, block_size, float(scale), DTYPE_CODES[query.dtype],
                        DTYPE_CODES[k_cache.dtype], torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged prefill kernel could not allocate its scratch memory")


@register_fake("paged_prefill_attention")
def _(query, k_cache, v_cache, query_lens, seq_lens, block_tables, scale, out):
    _check(query, k_cache, v_cache, query_lens, seq_lens, block_tables, out)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each chunk's query tokens attend to their sequence's cached prefix and causally to
    the chunk itself (token j of a chunk of q ending at length L sees keys 0..L-q+j);
    query head h reads KV head h // (Hq // Hkv). Returns `out` (allocated when not given).
    Shapes: the op `pdserve::paged_prefill_attention` above."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    _paged_prefill_attention(query, k_cache, v_cache, list(query_lens), list(seq_lens),
                             block_tables, float(scale), out)
    return out
