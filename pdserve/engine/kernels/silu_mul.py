"""SiLU(gate) * up over the fused gate_up projection, in one pass.

The Llama MLP computes `down(silu(gate(h)) * up(h))`; pdserve fuses gate and up into one
[T, 2I] projection, [gate | up] per row. Eager torch slices, runs silu (a pass writing
[T, I]) and multiplies (another pass reading it back); here one program reads a tile of
gate and of up and writes the product: each byte moves once. Math is float32, rounded to
the model dtype once at the store (eager rounds the silu and the product: the two differ
by about an ulp in 16-bit dtypes). The reference is `pdserve.engine.layers.activation`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.common import CACHE_DTYPES, check_device, check_last_dim_contiguous

# columns per program: 1024 16-bit values of gate and of up are 4 KiB, ~8 per thread
BLOCK_I = 1024


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I], row stride stride_in
    out_ptr,  # [T, I], row stride stride_out
    inter,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # T * 2I passes 2**31 for long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = gate_up_ptr + row * stride_in + cols
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, *, block: int | None = None,
             num_warps: int | None = None) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2I] (rows may be strided) ->
    a new contiguous [T, I] of gate_up's dtype. `block` / `num_warps` override the launch
    (gpu_check's sweep)."""
    if not isinstance(gate_up, torch.Tensor):
        raise ValueError(f"gate_up must be a tensor, got {type(gate_up).__name__}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in CACHE_DTYPES:
        raise ValueError(f"gate_up dtype must be one of {CACHE_DTYPES}, got {gate_up.dtype}")
    check_last_dim_contiguous(gate_up=gate_up)
    check_device(gate_up)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    block = block or min(BLOCK_I, triton.next_power_of_2(inter))
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up_ptr=gate_up,
        out_ptr=out,
        inter=inter,
        stride_in=gate_up.stride(0),
        stride_out=out.stride(0),
        BLOCK=block,
        num_warps=num_warps or max(1, min(8, block // 256)),
    )
    return out
