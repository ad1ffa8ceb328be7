"""Prefill attention: varlen query chunks over their sequences' paged KV cache.

FlashAttention-2 (Dao, 2023) tiling with an online softmax, reading K/V through block
tables as PagedAttention (Kwon et al., SOSP 2023) lays them out. Sequence i's chunk is
query rows [cu_seqlens[i], cu_seqlens[i+1]) (relative to cu_seqlens[0], so a slice of a
larger batch's offsets can be passed as is); its context is seq_lens[i] tokens, of which
the last `chunk length` are the chunk itself, already stored by the model. A query at
absolute position p sees keys 0..p: the whole cached prefix, and itself causally.

One program per (sequence, BLOCK_M query rows, query head). Its key loop has two phases:
tiles every row of the block sees (no mask at all), then the causal diagonal (masked).

The torch reference beside it is `engine.attention.torch_backend.prefill_attention_reference`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels import (
    check_device,
    check_index,
    check_kv_cache,
    check_last_dim_contiguous,
    check_seq_lens_and_blocks,
    dot_flags,
    paged_offsets,
)

DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_N = 64
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite, see paged_decode_attention


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, tile_start, qpos, k_cache_ptr, v_cache_ptr, table_row, kv_head, offs_d,
    d_mask, stride_cb, stride_cs, stride_ch, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """One online-softmax step over keys [tile_start, tile_start + BLOCK_N)."""
    kpos = tile_start + tl.arange(0, BLOCK_N)
    if MASKED:
        # Rows past the chunk have qpos past seq_len - 1, so this also bounds the keys.
        seq_end = tl.max(qpos, axis=0) + 1
        kpos_mask = kpos < seq_end
    else:
        kpos_mask = kpos >= 0  # all true: the tile lies inside every row's context
    kv_off = paged_offsets(table_row, kpos, kpos_mask, kv_head, offs_d, stride_cb, stride_cs,
                           stride_ch, BLOCK_SIZE)
    if MASKED:
        kv_mask = kpos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
    if MASKED:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,  # [Tq, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [Tq, Hq, D]
    cu_seqlens_ptr,  # [P+1]
    seq_lens_ptr,  # [P]
    block_tables_ptr,  # [P, max_blocks]
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    base = tl.load(cu_seqlens_ptr)
    q_start = tl.load(cu_seqlens_ptr + seq) - base
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - base - q_start
    if m_block * BLOCK_M >= q_len:
        return  # the grid is sized for the longest chunk
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    qpos = prefix + offs_m  # absolute positions; rows past the chunk are never stored

    kv_head = head // GROUP
    table_row = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: keys 0..first_pos are visible to every row of this block.
    first_pos = prefix + m_block * BLOCK_M
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile_start, qpos, k_cache_ptr, v_cache_ptr, table_row, kv_head,
            offs_d, d_mask, stride_cb, stride_cs, stride_ch, qk_scale, BLOCK_SIZE, BLOCK_N,
            False, DOT_PRECISION, UPCAST_DOT)
    # Phase 2: the diagonal, up to the last valid row's position.
    last_pos = prefix + tl.minimum(q_len, (m_block + 1) * BLOCK_M) - 1
    for tile_start in range(full_end, last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile_start, tl.where(m_mask, qpos, last_pos), k_cache_ptr,
            v_cache_ptr, table_row, kv_head, offs_d, d_mask, stride_cb, stride_cs, stride_ch,
            qk_scale, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, UPCAST_DOT)

    out = acc / l_i[:, None]
    o_off = rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    *,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of query [Tq, Hq, D] chunks over their cached prefix and themselves.

    cu_seqlens [P+1] (chunk offsets into query, relative to cu_seqlens[0]); seq_lens [P]
    context length after the chunk; block_tables [P, max_blocks]. `max_query_len` (a host
    int) sizes the grid without a sync. `validate=False` skips the device-value checks.
    """
    num_blocks, block_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [Tq, Hq, {head_dim}], got {tuple(query.shape)}")
    num_tokens, num_heads = query.shape[0], query.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of the cache's kv "
                         f"heads ({kv_heads})")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be >= 16 (tl.dot), got {head_dim}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [P+1], got {tuple(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.shape[0] - 1
    check_index("cu_seqlens", cu_seqlens, (num_seqs + 1,))
    check_index("seq_lens", seq_lens, (num_seqs,))
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.dim() != 2 \
            or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32/int64 [{num_seqs}, max_blocks] with "
                         f"contiguous rows, got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {query.dtype} {tuple(query.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    check_last_dim_contiguous(query=query, out=out)
    check_device(query, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, out)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    if num_seqs == 0 or num_tokens == 0:
        return out
    if validate:
        q_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        if bool((q_lens < 1).any()) or int(cu_seqlens[-1] - cu_seqlens[0]) != num_tokens:
            raise ValueError(f"cu_seqlens must increase strictly and span the {num_tokens} "
                             f"query tokens, got {cu_seqlens.tolist()}")
        check_seq_lens_and_blocks(seq_lens, block_tables, num_blocks, block_size,
                                  min_len=q_lens)
    if max_query_len is None:
        max_query_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q_ptr=query,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        out_ptr=out,
        cu_seqlens_ptr=cu_seqlens,
        seq_lens_ptr=seq_lens,
        block_tables_ptr=block_tables,
        qk_scale=scale * math.log2(math.e),
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_cb=k_cache.stride(0),
        stride_cs=k_cache.stride(1),
        stride_ch=k_cache.stride(2),
        stride_bt=block_tables.stride(0),
        GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=num_warps,
        num_stages=num_stages,
        **dot_flags(k_cache.dtype),
    )
    return out
