"""The Python side of gemv.c as the typed torch ops `pdserve::gemv_linear` (x @ W^T for the
few rows of a decode step, streaming the weights once: the C path of
pdserve.engine.layers.linear, tested against F.linear) and `pdserve::gemv_linear_int8` (the
same over weight-only int8 weights, pdserve.engine.layers.int8).

The op's body checks devices, dtypes, shapes and strides before the ctypes call, so
nothing reaches C that could read or write outside the tensors given; a fake
implementation runs the same checks on metadata alone.
"""

from __future__ import annotations

import torch

from pdserve.engine.cpu_kernels.library import (
    DTYPE_CODES,
    load,
    register_fake,
    require,
    typed_op,
)
from pdserve.engine.layers.int8 import GROUP, num_groups


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    require(x=x, weight=weight)
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"x and weight must be CPU tensors, got {x.device} and "
                         f"{weight.device}")
    if x.dtype != weight.dtype or x.dtype not in DTYPE_CODES:
        raise ValueError(f"x and weight must share float32 or bfloat16, got {x.dtype} and "
                         f"{weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if (x.shape[1] > 1 and x.stride(1) != 1) or not weight.is_contiguous():
        raise ValueError("x must be contiguous in its last dimension and weight contiguous")
    return DTYPE_CODES[x.dtype]


@typed_op("gemv_linear")
def gemv_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T as a new contiguous [M, N], accumulated in float32."""
    dt = _check(x, weight)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    if m and n:
        if load().gv_linear(x.data_ptr(), x.stride(0), weight.data_ptr(), None,
                            out.data_ptr(), n, m, n, k, dt, torch.get_num_threads()):
            raise MemoryError(f"gemv_linear: no memory for a float32 copy of x [{m}, {k}]")
    return out


@register_fake("gemv_linear")
def _(x, weight):
    _check(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))


def _check_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> int:
    require(x=x, q=q, scale=scale)
    if {x.device.type, q.device.type, scale.device.type} != {"cpu"}:
        raise ValueError("x, q and scale must be CPU tensors")
    if x.dtype not in DTYPE_CODES or q.dtype != torch.int8 or scale.dtype != torch.float32:
        raise ValueError(f"x must be float32 or bfloat16, q int8 and scale float32, got "
                         f"{x.dtype}, {q.dtype} and {scale.dtype}")
    if (x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1]
            or tuple(scale.shape) != (q.shape[0], num_groups(q.shape[1]))):
        raise ValueError(f"x must be [M, K], q [N, K] and scale [N, ceil(K / {GROUP})], got "
                         f"{tuple(x.shape)}, {tuple(q.shape)} and {tuple(scale.shape)}")
    if (x.shape[1] > 1 and x.stride(1) != 1) or not q.is_contiguous() or not (
            scale.is_contiguous()):
        raise ValueError("x must be contiguous in its last dimension, q and scale contiguous")
    return DTYPE_CODES[x.dtype]


@typed_op("gemv_linear_int8")
def gemv_linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T for the int8 weight W = (q, scale) of pdserve.engine.layers.int8
    (q [N, K], a float32 scale per GROUP of a row), as a new contiguous [M, N] of x's dtype,
    accumulated in float32."""
    dt = _check_int8(x, q, scale)
    (m, k), n = x.shape, q.shape[0]
    out = torch.empty((m, n), dtype=x.dtype)
    if m and n:
        if load().gv_linear(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(),
                            out.data_ptr(), n, m, n, k, dt, torch.get_num_threads()):
            raise MemoryError(f"gemv_linear_int8: no memory for a float32 copy of x [{m}, {k}]")
    return out


@register_fake("gemv_linear_int8")
def _(x, q, scale):
    _check_int8(x, q, scale)
    return x.new_empty((x.shape[0], q.shape[0]))
