"""Decode attention: one query token per sequence over its paged KV cache.

PagedAttention (Kwon et al., SOSP 2023) reads each sequence's keys through its block
table; the softmax is the online (streaming) one of FlashAttention (Dao et al., NeurIPS
2022), so a sequence's context is walked once in tiles of TILE_N tokens, gathered
token-by-token from whichever blocks hold them (any block size works).

GQA: one program per (sequence, KV head) loads each K/V tile once for all GROUP query
heads that share it, as the rows of a [BLOCK_G, D] query tile (rows past GROUP masked).

Split-K, after Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023): when batch * kv_heads
programs cannot fill the GPU, each sequence's context is cut into partitions of
`partition_size` tokens, one program each; they write an unnormalised partial output with
its running max and sum, and `_reduce_kernel` merges them. `use_split_k` is the heuristic;
the launcher's `split_k` argument forces either path.

The torch reference beside it is
`pdserve.engine.attention.torch_backend.decode_attention_reference`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.common import (
    check_device,
    check_index,
    check_kv_cache,
    check_last_dim_contiguous,
    check_seq_lens_and_blocks,
    dot_flags,
    paged_offsets,
)

DEFAULT_PARTITION_SIZE = 512
DEFAULT_TILE_N = 64
# A finite "minus infinity" for running maxima: an all-masked tile then gives
# exp2(m_old - m_new) = 1 instead of exp2(-inf + inf) = nan.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, Hq, D], or the fp32 partials [B, Hq, P, D] when SPLIT
    part_max_ptr,  # [B, Hq, P] fp32 (SPLIT only)
    part_sum_ptr,  # [B, Hq, P] fp32 (SPLIT only)
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_op,  # partition stride of the partials (SPLIT only)
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    num_parts,  # P (SPLIT only)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT:
        start = part * PARTITION_SIZE
        end = tl.minimum(start + PARTITION_SIZE, seq_len)
    else:
        start = 0
        end = seq_len

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # the query heads of this KV head
    q_off = seq * stride_qb + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        pos_mask = pos < end
        kv_off = paged_offsets(table_row, pos, pos_mask, kv_head, offs_d, stride_cb, stride_cs,
                               stride_ch, BLOCK_SIZE)
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [TILE_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, TILE_N]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        o_off = (seq * stride_ob + heads[:, None].to(tl.int64) * stride_oh
                 + part * stride_op + offs_d[None, :])
        tl.store(out_ptr + o_off, acc, mask=out_mask)
        ml_off = (seq * tl.num_programs(1) * GROUP + heads) * num_parts + part
        tl.store(part_max_ptr + ml_off, m_i, mask=g_mask)
        tl.store(part_sum_ptr + ml_off, l_i, mask=g_mask)
    else:
        o_off = seq * stride_ob + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
        out = acc / l_i[:, None]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr,  # [B, Hq, P, D] fp32, unnormalised
    part_max_ptr,  # [B, Hq, P] fp32, base-2 running max of each partition
    part_sum_ptr,  # [B, Hq, P] fp32, softmax denominator of each partition
    seq_lens_ptr,
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    num_parts,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, PARTITION_SIZE)  # partitions past the context hold nothing
    row = (seq * tl.num_programs(1) + head) * num_parts
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    # Pass 1: the global max over the used partitions.
    m_all = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, used, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        m = tl.load(part_max_ptr + row + offs_p, mask=offs_p < used, other=float("-inf"))
        m_all = tl.maximum(m_all, m)
    m_max = tl.max(m_all, axis=0)

    # Pass 2: rescale each partial to that max and sum.
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, used, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < used
        m = tl.load(part_max_ptr + row + offs_p, mask=p_mask, other=float("-inf"))
        l_p = tl.load(part_sum_ptr + row + offs_p, mask=p_mask, other=0.0)
        w = tl.exp2(m - m_max)
        o = tl.load(part_out_ptr + (row + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        denom += w * l_p
    out = acc / tl.sum(denom, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


_SM_COUNTS: dict[int, int] = {}


def device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100's count; only the heuristic's tests see this on the CPU
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def use_split_k(
    *,
    batch_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = 132,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> bool:
    """Split-K pays when the unsplit grid leaves SMs idle and contexts give >= 4 partitions.

    The unsplit grid has batch * kv_heads programs, each walking a whole context; below
    two per SM, long contexts leave most of the GPU's bandwidth unused. Splitting costs
    the fp32 partials and a second launch, which two or three partitions do not repay.
    On an H200 (32/8 heads, 132 SMs): 64 programs x 4096 tokens ran 2.1x faster split and
    SmolLM2's 192 x 2048 1.13x, but 256 x 1024 (2 partitions) 1.3x slower and 512 x 2048
    1.5x slower.
    """
    return max_seq_len >= 4 * partition_size and batch_size * num_kv_heads < 2 * num_sms


def paged_decode_attention(
    *,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    split_k: bool | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    tile_n: int = DEFAULT_TILE_N,
    num_warps: int = 4,
    validate: bool = True,
) -> torch.Tensor:
    """Attention of query [B, Hq, D] over each sequence's first seq_lens[b] cached tokens.

    `max_seq_len` (a host int, e.g. max of AttentionMetadata.seq_lens_cpu) sizes the split
    grid without a device sync; `split_k=None` asks `use_split_k`. `validate=False` skips
    the seq_lens / block id checks (a device sync) for callers that did them already.
    """
    num_blocks, block_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [B, Hq, {head_dim}], got {tuple(query.shape)}")
    batch, num_heads = query.shape[0], query.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of the cache's kv "
                         f"heads ({kv_heads})")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be >= 16 (tl.dot), got {head_dim}")
    check_index("seq_lens", seq_lens, (batch,))
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.dim() != 2 \
            or block_tables.shape[0] < batch:
        raise ValueError(f"block_tables must be int32/int64 [>= {batch}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    block_tables = block_tables[:batch]
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides "
                         f"{tuple(block_tables.stride())}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {query.dtype} {tuple(query.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    check_last_dim_contiguous(query=query, out=out)
    check_device(query, k_cache, v_cache, seq_lens, block_tables, out)
    if tile_n < 16 or tile_n & (tile_n - 1) or partition_size % tile_n:
        raise ValueError(f"tile_n must be a power of two >= 16 dividing partition_size, got "
                         f"tile_n={tile_n}, partition_size={partition_size}")
    if batch == 0:
        return out
    if validate:
        check_seq_lens_and_blocks(seq_lens, block_tables, num_blocks, block_size)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if split_k is None:
        split_k = use_split_k(batch_size=batch, num_kv_heads=kv_heads, max_seq_len=max_seq_len,
                              num_sms=device_sm_count(query.device), partition_size=partition_size)

    group = num_heads // kv_heads
    common = dict(
        q_ptr=query,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        qk_scale=scale * math.log2(math.e),
        stride_qb=query.stride(0),
        stride_qh=query.stride(1),
        stride_cb=k_cache.stride(0),
        stride_cs=k_cache.stride(1),
        stride_ch=k_cache.stride(2),
        stride_bt=block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        # tl.dot needs >= 16 rows; rows past GROUP are masked.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        TILE_N=tile_n,
        PARTITION_SIZE=partition_size,
        num_warps=num_warps,
        **dot_flags(k_cache.dtype),
    )
    if not split_k:
        _decode_kernel[(batch, kv_heads, 1)](
            out_ptr=out, part_max_ptr=out, part_sum_ptr=out,  # partial buffers unused
            stride_ob=out.stride(0), stride_oh=out.stride(1), stride_op=0, num_parts=1,
            SPLIT=False, **common,
        )
        return out

    num_parts = triton.cdiv(max_seq_len, partition_size)
    part_out = torch.empty((batch, num_heads, num_parts, head_dim), dtype=torch.float32,
                           device=query.device)
    part_max = torch.empty((batch, num_heads, num_parts), dtype=torch.float32,
                           device=query.device)
    part_sum = torch.empty_like(part_max)
    _decode_kernel[(batch, kv_heads, num_parts)](
        out_ptr=part_out, part_max_ptr=part_max, part_sum_ptr=part_sum,
        stride_ob=part_out.stride(0), stride_oh=part_out.stride(1),
        stride_op=part_out.stride(2), num_parts=num_parts, SPLIT=True, **common,
    )
    _reduce_kernel[(batch, num_heads)](
        part_out_ptr=part_out,
        part_max_ptr=part_max,
        part_sum_ptr=part_sum,
        seq_lens_ptr=seq_lens,
        out_ptr=out,
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        num_parts=num_parts,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_P=min(16, triton.next_power_of_2(num_parts)),
        PARTITION_SIZE=partition_size,
        num_warps=4,
    )
    return out
