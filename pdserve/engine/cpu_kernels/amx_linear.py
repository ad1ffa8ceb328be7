"""The Python side of amx_linear.c: `pdserve::amx_pack` (a bfloat16 weight [N, K] into the
AMX tiles' layout, once) and `pdserve::amx_linear` (x @ W^T on the tiles for batched decode
steps), plus `amx_available()`: whether this build and machine have the tiles (and the
kernel lets this process use them). The C path of pdserve.engine.layers.linear between the
GEMV's few rows and oneDNN's large ones; tested against F.linear.

The ops check devices, dtypes, shapes and strides before the ctypes call, so nothing
reaches C that could read or write outside the tensors given.
"""

from __future__ import annotations

import functools

import torch

from pdserve.engine.cpu_kernels.library import load, register_fake, require, typed_op

K_STEP, N_BLOCK = 32, 16  # a weight's K must divide by 32 and its N by 16


@functools.cache
def amx_available() -> bool:
    """True when the library was built with AMX and this process may use the tiles."""
    return bool(load().al_available())


def packable(weight: torch.Tensor) -> bool:
    """Whether amx_pack takes this weight (bfloat16 [N, K], N % 16 == K % 32 == 0)."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.shape[0] % N_BLOCK == 0 and weight.shape[1] % K_STEP == 0
            and weight.shape[0] > 0 and weight.shape[1] > 0)


def _check_pack(weight: torch.Tensor) -> None:
    require(weight=weight)
    if not packable(weight) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous bfloat16 CPU [N, K] with N % {N_BLOCK} "
                         f"== 0 and K % {K_STEP} == 0, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")


@typed_op("amx_pack")
def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [N * K] bfloat16 in the tiles' layout (amx_linear.c)."""
    _check_pack(weight)
    out = torch.empty(weight.numel(), dtype=torch.bfloat16)
    load().al_pack(weight.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr())
    return out


@register_fake("amx_pack")
def _(weight):
    _check_pack(weight)
    return weight.new_empty(weight.numel())


def _check_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> None:
    require(x=x, packed=packed)
    if x.device.type != "cpu" or packed.device.type != "cpu":
        raise ValueError(f"x and packed must be CPU tensors, got {x.device} and "
                         f"{packed.device}")
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16:
        raise ValueError(f"x and packed must be bfloat16, got {x.dtype} and {packed.dtype}")
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [M, K] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    k = x.shape[1]
    if (n <= 0 or k <= 0 or n % N_BLOCK or k % K_STEP or packed.dim() != 1
            or packed.numel() != n * k or not packed.is_contiguous()):
        raise ValueError(f"packed must be amx_pack of a [{n}, {k}] weight (N % {N_BLOCK} == 0, "
                         f"K % {K_STEP} == 0), got {packed.numel()} elements")


@typed_op("amx_linear")
def amx_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bfloat16 @ W^T -> [M, n] bfloat16, W packed by amx_pack; accumulated in
    float32. RuntimeError where the tiles are unavailable (amx_available() says)."""
    _check_linear(x, packed, n)
    out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
    if x.shape[0]:
        if load().al_linear(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), n,
                            x.shape[1], out.data_ptr(), torch.get_num_threads()):
            raise RuntimeError("amx_linear: AMX tiles unavailable here, or no memory for the "
                               "padded rows")
    return out


@register_fake("amx_linear")
def _(x, packed, n):
    _check_linear(x, packed, n)
    return x.new_empty((x.shape[0], n))
