"""The Python side of f32_panels.c: `pdserve::f32_pack` (a float32 weight [N, K] into
panels of 32 columns, once) and `pdserve::f32_panels_linear` (x @ W^T over them for
batched decode steps), plus `panels_available()`: whether this build has the kernel
(AVX-512, or AVX2 with FMA). The float32 counterpart of amx_linear.py, between the GEMV's
few rows and oneDNN's large ones; tested against F.linear.

The ops check devices, dtypes, shapes and strides before the ctypes call, so nothing
reaches C that could read or write outside the tensors given.
"""

from __future__ import annotations

import functools

import torch

from pdserve.engine.cpu_kernels import packed_checks
from pdserve.engine.cpu_kernels.library import load, register_fake, typed_op

PANEL = 32  # a weight's N must divide by 32


@functools.cache
def panels_available() -> bool:
    """True when the library was built with a kernel (AVX-512, or AVX2 with FMA)."""
    return bool(load().fp_available())


def packable(weight: torch.Tensor) -> bool:
    """Whether f32_pack takes this weight (float32 [N, K], N % 32 == 0)."""
    return packed_checks.packable(weight, torch.float32, PANEL, 1)


def _check_pack(weight: torch.Tensor) -> None:
    packed_checks.check_pack(weight, torch.float32, PANEL, 1)


@typed_op("f32_pack")
def f32_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [N * K] float32 in panels (f32_panels.c)."""
    _check_pack(weight)
    out = torch.empty(weight.numel(), dtype=torch.float32)
    load().fp_pack(weight.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr())
    return out


@register_fake("f32_pack")
def _(weight):
    _check_pack(weight)
    return weight.new_empty(weight.numel())


def _check_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> None:
    packed_checks.check_linear(x, packed, n, torch.float32, PANEL, 1, "f32_pack")


@typed_op("f32_panels_linear")
def f32_panels_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, n] float32, W packed by f32_pack. RuntimeError where
    this build lacks the kernel (panels_available() says)."""
    _check_linear(x, packed, n)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    if x.shape[0]:
        if load().fp_linear(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), n,
                            x.shape[1], out.data_ptr(), torch.get_num_threads()):
            raise RuntimeError("f32_panels_linear: this build lacks the kernel")
    return out


@register_fake("f32_panels_linear")
def _(x, packed, n):
    _check_linear(x, packed, n)
    return x.new_empty((x.shape[0], n))
