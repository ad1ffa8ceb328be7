"""Store the K/V of a flat batch of new tokens into the paged KV cache.

The write half of PagedAttention (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023): token i goes to cache slot
`slot_mapping[i] = block_id * block_size + offset_in_block`; -1 means "do not store"
(e.g. a token whose KV already sits in a shared prefix block).

One program per token copies all its KV heads, casting to the cache dtype on the way.
The torch reference beside it is `pdserve.engine.attention.torch_backend.store_kv_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.common import (
    INDEX_DTYPES,
    check_device,
    check_kv_cache,
    check_last_dim_contiguous,
)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T]
    num_slots,  # num_blocks * block_size; may exceed 2**31
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # The launcher rejects slots >= num_slots; the mask keeps a skipped check from ever
    # turning into an out-of-bounds write.
    valid = (slot >= 0) & (slot < num_slots)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # tl.where, not `mask & valid`: the interpreter turns scalar-bool & block-bool into an
    # int32 block that its loads reject.
    mask = tl.where(valid, mask, False)

    src_k = tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
           + offs_h[:, None].to(tl.int64) * stride_ch + offs_d[None, :])
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    validate: bool = True,
) -> None:
    """Write key[i]/value[i] ([T, Hkv, D]) to slot slot_mapping[i] of the caches; -1 skips.

    `validate=False` skips the slot range check (a device sync); out-of-range slots are
    then silently dropped by the kernel rather than written out of bounds.
    """
    num_blocks, block_size, kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if key.dim() != 3 or tuple(key.shape[1:]) != (kv_heads, head_dim):
        raise ValueError(f"key must be [T, {kv_heads}, {head_dim}] to match the cache, got "
                         f"{tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if not key.dtype.is_floating_point or value.dtype != key.dtype:
        raise ValueError(f"key/value must share a floating dtype, got {key.dtype} and "
                         f"{value.dtype}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [{key.shape[0]}] (one slot per token), got "
                         f"{tuple(slot_mapping.shape)}")
    check_last_dim_contiguous(key=key, value=value)
    check_device(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    num_slots = num_blocks * block_size
    if num_tokens == 0:
        return
    if validate:
        bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"slot_mapping[{i}] = {int(slot_mapping[i])} is out of range: "
                             f"slots are -1 (skip) or in [0, {num_slots})")
    _store_kv_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        num_slots=num_slots,
        stride_kt=key.stride(0),
        stride_kh=key.stride(1),
        stride_vt=value.stride(0),
        stride_vh=value.stride(1),
        stride_cb=k_cache.stride(0),
        stride_cs=k_cache.stride(1),
        stride_ch=k_cache.stride(2),
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if kv_heads * head_dim >= 1024 else 1,
    )
