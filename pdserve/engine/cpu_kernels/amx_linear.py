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

from pdserve.engine.cpu_kernels import packed_checks
from pdserve.engine.cpu_kernels.library import load, register_fake, typed_op

K_STEP, N_BLOCK = 32, 16  # a weight's K must divide by 32 and its N by 16


@functools.cache
def amx_available() -> bool:
    """True when the library was built with AMX and this process may use the tiles."""
    return bool(load().al_available())


def packable(weight: torch.Tensor) -> bool:
    """Whether amx_pack takes this weight (bfloat16 [N, K], N % 16 == K % 32 == 0)."""
    return packed_checks.packable(weight, torch.bfloat16, N_BLOCK, K_STEP)


def _check_pack(weight: torch.Tensor) -> None:
    packed_checks.check_pack(weight, torch.bfloat16, N_BLOCK, K_STEP)


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
    packed_checks.check_linear(x, packed, n, torch.bfloat16, N_BLOCK, K_STEP, "amx_pack")


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
