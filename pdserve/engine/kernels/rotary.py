"""Rotary position embedding (RoPE), in place, on the Q and K heads of a fused qkv row.

The qkv projection writes each token's row as [Q heads | K heads | V heads], head_dim D
each. RoPE (Su et al., "RoFormer", 2021) in the rotate-half layout of Llama / transformers
rotates the first Hq + Hkv heads of the row:

    out = x * cos[pos] + rotate_half(x) * sin[pos],   rotate_half(x) = [-x2, x1]

with x1, x2 the two halves of a head and cos/sin tables [max_position, D] that the model
builds once (`pdserve.engine.llama.LlamaModel._init_rope`). Eager torch spends a gather, two
multiplies, a concat and an add, each a full pass over Q and K; this kernel reads each
element once and writes it back where it was, V untouched. One program per (token, group of
heads) loads that token's cos/sin row once for all its heads.

Math is float32 and each output is rounded to the model dtype once, as the C op does. The
eager reference rounds three times (each product, then their sum), so in 16-bit dtypes the
two differ by up to about an ulp of each product and of the sum: tests/test_kernels_fused.py
bounds that error instead of asserting bit-equality (which an earlier version, emulating
each eager rounding, claimed and an H200 disproved). In float32 the interpreter is exact;
compiled, ptxas may contract a product into the sum's FMA (an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.common import (
    CACHE_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_last_dim_contiguous,
)
from pdserve.engine.layers.rotary import apply_rope

# Heads one program rotates: the cos/sin row is loaded once per program, so more heads per
# program means fewer reloads; 16 keeps a D=128 tile at 16 x 64 x 2 halves, no spills.
MAX_BLOCK_HEADS = 16


@triton.jit
def _rotary_kernel(
    qkv_ptr,  # [T, >= (Hq + Hkv) * D], heads packed along the row
    cos_ptr,  # [max_position, D]
    sin_ptr,  # [max_position, D]
    positions_ptr,  # [T]
    max_position,
    stride_t,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,  # Hq + Hkv: the heads that rotate
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    offs = tl.arange(0, BLOCK_HALF)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    # The launcher rejects bad positions; without that check (validate=False) such a row
    # is left as it is rather than rotated by whatever lies outside the tables.
    valid = (pos >= 0) & (pos < max_position)
    # tl.where, not `&` with a scalar: the interpreter's loads reject the int block `&` gives.
    col_ok = tl.where(valid, offs < HALF, False)
    mask = (heads[:, None] < NUM_HEADS) & col_ok[None, :]

    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    # Both halves of each table, not one: llama.py's tables repeat their first half, but
    # the reference formula does not assume it, and neither does this.
    c1 = tl.load(cos_row + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + HALF + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + HALF + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    ptrs = qkv_ptr + tok * stride_t + heads[:, None].to(tl.int64) * (2 * HALF) + offs[None, :]
    dtype = qkv_ptr.dtype.element_ty
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    # float32 throughout, one rounding to the model dtype at the store
    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2
    tl.store(ptrs, o1.to(dtype), mask=mask)
    tl.store(ptrs + HALF, o2.to(dtype), mask=mask)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's rotate-half RoPE (pdserve.engine.layers.rotary): x [..., D], cos/sin
    broadcastable to it."""
    return apply_rope(x, cos, sin)


def rotary_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """What `rotary_embedding` leaves in qkv, as a new tensor; qkv itself is not changed."""
    t = qkv.shape[0]
    qk_width = (num_q_heads + num_kv_heads) * head_dim
    qk = qkv[:, :qk_width].reshape(t, num_q_heads + num_kv_heads, head_dim)
    rotated = rope_reference(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    out = qkv.clone()
    out[:, :qk_width] = rotated.reshape(t, qk_width)
    return out


def rotary_embedding(
    *,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    validate: bool = True,
    block_heads: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Rotate the Q and K heads of qkv [T, (Hq + 2 Hkv) * D] in place; V is left alone.
    (num_kv_heads=0 rotates every head of a [T, Hq * D] view: the layer op's qk.)

    Row t uses cos[positions[t]] / sin[positions[t]] ([max_position, D] tables of qkv's
    dtype). qkv may be a row-strided view (only its last dim must be dense).
    `validate=False` skips the positions range check (a device sync); a row whose position
    is out of range is then left unrotated instead of read out of bounds.
    """
    for name, n, lo in (("num_q_heads", num_q_heads, 1), ("num_kv_heads", num_kv_heads, 0),
                        ("head_dim", head_dim, 1)):
        if not isinstance(n, int) or n < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {n!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotate-half pairs its halves), got "
                         f"{head_dim}")
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [T, {width}] ((Hq + 2 Hkv) * D = ({num_q_heads} + 2 * "
                         f"{num_kv_heads}) * {head_dim}), got {tuple(qkv.shape)}")
    if qkv.dtype not in CACHE_DTYPES:
        raise ValueError(f"qkv dtype must be one of {CACHE_DTYPES}, got {qkv.dtype}")
    if cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos must be [max_position, {head_dim}], got {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin shape {tuple(sin.shape)} != cos shape {tuple(cos.shape)}")
    # Same dtype as qkv: eager `qk * cos` with float32 tables would promote and round
    # differently from the kernel's model-dtype steps.
    if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError(f"cos/sin dtypes must match qkv's {qkv.dtype}, got {cos.dtype} and "
                         f"{sin.dtype}")
    if positions.dtype not in INDEX_DTYPES:
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    num_tokens = qkv.shape[0]
    if positions.dim() != 1 or positions.shape[0] != num_tokens:
        raise ValueError(f"positions must be [{num_tokens}] (one per qkv row), got "
                         f"{tuple(positions.shape)}")
    check_last_dim_contiguous(qkv=qkv, cos=cos, sin=sin)
    check_device(qkv, cos, sin, positions)
    if num_tokens == 0:
        return
    max_position = cos.shape[0]
    if validate:
        bad = (positions < 0) | (positions >= max_position)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"positions[{i}] = {int(positions[i])} is outside the rotary "
                             f"tables' [0, {max_position})")
    num_heads = num_q_heads + num_kv_heads
    block_heads = block_heads or min(MAX_BLOCK_HEADS, triton.next_power_of_2(num_heads))
    block_half = triton.next_power_of_2(head_dim // 2)
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_heads))](
        qkv_ptr=qkv,
        cos_ptr=cos,
        sin_ptr=sin,
        positions_ptr=positions,
        max_position=max_position,
        stride_t=qkv.stride(0),
        stride_cos=cos.stride(0),
        stride_sin=sin.stride(0),
        NUM_HEADS=num_heads,
        HALF=head_dim // 2,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        # two [heads, half] tiles: ~8 elements per thread each
        num_warps=num_warps or max(1, min(8, block_heads * block_half // 256)),
    )
