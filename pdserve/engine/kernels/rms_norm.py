"""Fused residual add + RMSNorm over a flat batch of rows.

The Llama block ends each half with `x = x + sublayer_out; h = rms_norm(x, w, eps)`. Done
by torch that is two kernels and two extra trips through memory (the sum is written, then
read back for the statistics, then read again to normalise). Here one program loads a row
of `x` and of the residual stream, writes their sum back into the residual buffer (the
next layer adds to it in place) and writes the normalised row: each byte moves once.
Without a residual (the first layer's input norm, the final norm) the same kernel is a
plain RMSNorm (constexpr HAS_RESIDUAL).

The arithmetic follows `pdserve.engine.layers.norm.rms_norm` (the one reference, and
transformers' LlamaRMSNorm) rounding step by rounding step, so a 16-bit result matches
the eager one to the last bit wherever the float32 statistics agree: the sum is rounded
to the model dtype before the statistics are taken, the normalised row is rounded to the
model dtype before the weight multiply, and that product is rounded again. That reference
is the one the tests and gpu_check compare against; `add_rms_norm_reference` below is only
the add composed with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.common import (
    CACHE_DTYPES,
    check_device,
    check_last_dim_contiguous,
)
from pdserve.engine.layers.norm import rms_norm

# One program holds a whole row in registers: 8192 fp32 values over 8 warps is 32 per
# thread, comfortably spill-free. Llama-70B's hidden size; nothing pdserve serves is wider.
MAX_HIDDEN = 8192
# Elements one program works on when several short rows share it (small hidden sizes):
# keeps per-program work near that of a 4096-wide row instead of launching many tiny ones.
_TARGET_ELEMS = 4096
# Fewer programs than this and the GPU idles (H100/H200 have 132 SMs); packing rows must
# not starve it, so it stops halving the grid there.
_MIN_PROGRAMS = 256


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], read and overwritten with x + residual (HAS_RESIDUAL only)
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    mask = (rows[:, None] < num_rows) & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]  # T * stride passes 2**31 for long prefills at 8192
    dtype = out_ptr.dtype.element_ty

    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + rows64 * stride_r + cols[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the model dtype first, as the eager add's result is: the statistics
        # and the next layer both see the stored value.
        total = (x + r).to(dtype)
        tl.store(r_ptrs, total, mask=mask)
        x = total.to(tl.float32)

    # Masked columns loaded as 0, so they add nothing; divide by the real width.
    mean_sq = tl.sum(x * x, axis=1) / hidden
    rstd = tl.math.rsqrt(mean_sq + eps)
    normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = (normed * w[None, :]).to(dtype)
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], y, mask=mask)


def add_rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(residual + x), residual + x) as llama.py computes them; nothing in place."""
    if residual is None:
        return rms_norm(x, weight, eps), None
    total = residual + x
    return rms_norm(total, weight, eps), total


def rows_per_program(num_rows: int, hidden: int) -> int:
    """Rows one program normalises: a power of two, 1 for hidden sizes of 4096 and up."""
    rows = max(1, _TARGET_ELEMS // triton.next_power_of_2(hidden))
    while rows > 1 and triton.cdiv(num_rows, rows) < _MIN_PROGRAMS:
        rows //= 2
    return rows


def default_num_warps(elems: int) -> int:
    # ~8 elements (one 16-byte vector of a 16-bit dtype) per thread per pass, 1..8 warps.
    return max(1, min(8, elems // 256))


def add_rms_norm(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """RMSNorm of x [T, H] (float32 statistics) -> a new [T, H] tensor of x's dtype.

    With `residual` [T, H]: `residual += x` in place (rounded to its dtype), and the norm is
    of that sum: the `x = x + out; h = rms_norm(x, w, eps)` step of a Llama layer, fused.
    `rows` / `num_warps` override the launch heuristics (gpu_check's sweep).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [T, H] tensor, got shape "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    if x.dtype not in CACHE_DTYPES:
        raise ValueError(f"x dtype must be one of {CACHE_DTYPES}, got {x.dtype}")
    num_tokens, hidden = x.shape
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x hidden size must be in [1, {MAX_HIDDEN}] (one row per program "
                         f"in registers), got {hidden}")
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"weight must be [{hidden}] to match x, got {tuple(weight.shape)}")
    # One dtype throughout: the eager `weight * normed` would promote a float32 weight and
    # return float32, which the kernel (output in x's dtype) would not reproduce.
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    if not (isinstance(eps, (int, float)) and eps >= 0.0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    check_last_dim_contiguous(x=x, weight=weight)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape "
                             f"{tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
        check_last_dim_contiguous(residual=residual)
        check_device(x, weight, residual)
    else:
        check_device(x, weight)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_h = triton.next_power_of_2(hidden)
    rows = rows or rows_per_program(num_tokens, hidden)
    if rows & (rows - 1):
        raise ValueError(f"rows must be a power of two, got {rows}")
    res = residual if residual is not None else x  # never read without HAS_RESIDUAL
    _rms_norm_kernel[(triton.cdiv(num_tokens, rows),)](
        x_ptr=x,
        residual_ptr=res,
        weight_ptr=weight,
        out_ptr=out,
        num_rows=num_tokens,
        hidden=hidden,
        eps=float(eps),
        stride_x=x.stride(0),
        stride_r=res.stride(0),
        stride_o=out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        ROWS=rows,
        num_warps=num_warps or default_num_warps(rows * block_h),
    )
    return out
