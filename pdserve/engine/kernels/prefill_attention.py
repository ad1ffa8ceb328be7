"""Prefill attention: varlen query chunks over their sequences' paged KV cache.

FlashAttention-2 (Dao, 2023) tiling with an online softmax, reading K/V through block
tables as PagedAttention (Kwon et al., SOSP 2023) lays them out. Sequence i's chunk is
query rows [cu_seqlens[i], cu_seqlens[i+1]) (relative to cu_seqlens[0], so a slice of a
larger batch's offsets can be passed as is); its context is seq_lens[i] tokens, of which
the last `chunk length` are the chunk itself, already stored by the model. A query at
absolute position p sees keys 0..p: the whole cached prefix, and itself causally.

One program per (sequence, KV head, BLOCK_Q query positions). GQA packing: the program's
BLOCK_M-row query tile holds all GROUP query heads of its KV head for those positions, row
r being position r // GROUP of head r % GROUP (BLOCK_Q = BLOCK_M // GROUP; rows past
BLOCK_Q * GROUP are padding). Each K/V tile is thus loaded once per KV head rather than
once per query head, and the causal diagonal spans only BLOCK_Q positions.

The grid's last axis walks the query blocks from the last (most keys to see) to the
first, so the longest programs start first and short ones fill the tail.

The key loop has two phases: tiles every row sees (no mask at all), then the causal
diagonal (masked). In both, the block ids of the next tile are loaded one iteration ahead
and carried, so the K/V loads' addresses never wait on a load of the same iteration and
Triton's pipeliner treats them as direct loads, prefetched `num_stages - 1` tiles ahead.

The torch reference beside it is
`pdserve.engine.attention.torch_backend.prefill_attention_reference`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.common import (
    block_ids,
    check_device,
    check_index,
    check_kv_cache,
    check_last_dim_contiguous,
    check_seq_lens_and_blocks,
    dot_flags,
    paged_row_offsets,
)

# Defaults for 16-bit caches, whose dots run on tensor cores.
DEFAULT_BLOCK_M = 128  # query rows per program: (positions x heads of one KV group)
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_STAGES = 3
# fp32 caches take the "ieee" dot, which Triton lowers to FMAs with whole operand rows in
# each thread's registers: at the 16-bit tiles ptxas spills tens of KB per thread on sm_90
# (and head_dim 128 came within 3 KiB of the 227 KiB shared memory limit). These tiles
# compile without spills at head_dim 64 and 128 (scripts/compile_check.py).
FP32_BLOCK_M = 32
FP32_BLOCK_N = 16
FP32_NUM_WARPS = 8
FP32_NUM_STAGES = 2
_MAX_GRID_Z = 65535  # CUDA's limit on gridDim.z
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite, see paged_decode_attention


def default_num_warps(block_m: int, head_dim: int, dtype: torch.dtype | None = None) -> int:
    """Warps so that the fp32 accumulator stays ~64 registers per thread (4..8 warps);
    FP32_NUM_WARPS for fp32 caches (FMA dots: more threads, fewer operand registers each)."""
    if dtype == torch.float32:
        return FP32_NUM_WARPS
    return max(4, min(8, block_m * triton.next_power_of_2(head_dim) // 2048))


def default_config(dtype: torch.dtype) -> dict[str, int]:
    """block_m, block_n, num_stages the launcher uses for a cache dtype when not given."""
    if dtype == torch.float32:
        return {"block_m": FP32_BLOCK_M, "block_n": FP32_BLOCK_N, "num_stages": FP32_NUM_STAGES}
    return {"block_m": DEFAULT_BLOCK_M, "block_n": DEFAULT_BLOCK_N,
            "num_stages": DEFAULT_NUM_STAGES}


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, ids, tile_start, qpos, seq_end, k_cache_ptr, v_cache_ptr, kv_head,
    offs_n, offs_d, stride_cb, stride_cs, stride_ch, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """One online-softmax step over keys [tile_start, tile_start + BLOCK_N); `ids` holds
    their block ids. Unmasked tiles lie inside every row's context: no mask at all."""
    kpos = tile_start + offs_n
    rows = paged_row_offsets(ids, kpos, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
    kv_off = rows[:, None] + offs_d[None, :]
    if MASKED:
        # Keys past the last valid row's position: never seen, and their slots may hold
        # anything (0 * nan in the PV dot), so they load as zeros.
        kv_mask = kpos[:, None] < seq_end
        if not EVEN_D:
            kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_cache_ptr + kv_off)
        v = tl.load(v_cache_ptr + kv_off)
    else:
        d_mask = offs_d[None, :] < HEAD_DIM
        k = tl.load(k_cache_ptr + kv_off, mask=d_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=d_mask, other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N], unscaled
    if MASKED:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    # qk_scale > 0 (the launcher checks), so scaling commutes with max and folds into
    # one multiply-add per element below.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
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
    qk_scale,  # softmax scale * log2(e), > 0
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
    BLOCK_M: tl.constexpr,  # rows of the query tile, a power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query positions per program: BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,  # HEAD_DIM == BLOCK_D: no head_dim masks
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_block = tl.num_programs(2) - 1 - tl.program_id(2)  # longest first
    base = tl.load(cu_seqlens_ptr)
    q_start = tl.load(cu_seqlens_ptr + seq) - base
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - base - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest chunk
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    # Row r: query position q_block * BLOCK_Q + r // GROUP, query head kv_head * GROUP +
    # r % GROUP; a token's GROUP heads are adjacent rows (and adjacent in memory).
    offs_r = tl.arange(0, BLOCK_M)
    offs_q = q_block * BLOCK_Q + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    r_mask = (offs_r < BLOCK_Q * GROUP) & (offs_q < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    if EVEN_D:
        io_mask = r_mask[:, None]
    else:
        io_mask = r_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    row_q = (q_start + offs_q).to(tl.int64)
    q = tl.load(q_ptr + row_q[:, None] * stride_qt + heads[:, None].to(tl.int64) * stride_qh
                + offs_d[None, :], mask=io_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    first_pos = prefix + q_block * BLOCK_Q  # absolute position of the block's first row
    last_pos = prefix + tl.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    # Padding rows take the last valid position: they widen no key range and stay finite.
    qpos = tl.where(r_mask, prefix + offs_q, last_pos)

    table_row = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: keys 0..first_pos are visible to every row of this block.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    ids = block_ids(table_row, offs_n, offs_n < seq_len, BLOCK_SIZE)
    for tile_start in range(0, full_end, BLOCK_N):
        next_pos = tile_start + BLOCK_N + offs_n
        ids_next = block_ids(table_row, next_pos, next_pos < seq_len, BLOCK_SIZE)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, ids, tile_start, qpos, last_pos + 1, k_cache_ptr, v_cache_ptr,
            kv_head, offs_n, offs_d, stride_cb, stride_cs, stride_ch, qk_scale, HEAD_DIM,
            BLOCK_SIZE, False, EVEN_D, DOT_PRECISION, UPCAST_DOT)
        ids = ids_next
    # Phase 2: the diagonal, up to the last valid row's position; `ids` is its first tile's.
    for tile_start in range(full_end, last_pos + 1, BLOCK_N):
        next_pos = tile_start + BLOCK_N + offs_n
        ids_next = block_ids(table_row, next_pos, next_pos < seq_len, BLOCK_SIZE)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, ids, tile_start, qpos, last_pos + 1, k_cache_ptr, v_cache_ptr,
            kv_head, offs_n, offs_d, stride_cb, stride_cs, stride_ch, qk_scale, HEAD_DIM,
            BLOCK_SIZE, True, EVEN_D, DOT_PRECISION, UPCAST_DOT)
        ids = ids_next

    out = acc / l_i[:, None]
    o_off = row_q[:, None] * stride_ot + heads[:, None].to(tl.int64) * stride_oh \
        + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of query [Tq, Hq, D] chunks over their cached prefix and themselves.

    cu_seqlens [P+1] (chunk offsets into query, relative to cu_seqlens[0]); seq_lens [P]
    context length after the chunk; block_tables [P, max_blocks]. `max_query_len` (a host
    int) sizes the grid without a sync. `validate=False` skips the device-value checks.
    `block_m` counts query-tile rows, i.e. positions x the GROUP query heads of a KV head
    (raised to GROUP's next power of two if smaller). None takes `default_config` for the
    cache dtype (smaller tiles for fp32) and `default_num_warps`.
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
    if not scale > 0:  # the kernel takes the row max before scaling
        raise ValueError(f"scale must be > 0, got {scale}")
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
    defaults = default_config(k_cache.dtype)
    block_m = defaults["block_m"] if block_m is None else block_m
    block_n = defaults["block_n"] if block_n is None else block_n
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
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

    group = num_heads // kv_heads
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    if num_warps is None:
        num_warps = default_num_warps(block_m, head_dim, k_cache.dtype)
    grid = (num_seqs, kv_heads, triton.cdiv(max_query_len, block_q))
    if grid[2] > _MAX_GRID_Z:
        raise ValueError(f"max_query_len {max_query_len} needs {grid[2]} query blocks of "
                         f"{block_q} (> {_MAX_GRID_Z}): raise block_m or split the chunk")
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
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        EVEN_D=triton.next_power_of_2(head_dim) == head_dim,
        num_warps=num_warps,
        num_stages=num_stages,
        **dot_flags(k_cache.dtype),
    )
    return out
