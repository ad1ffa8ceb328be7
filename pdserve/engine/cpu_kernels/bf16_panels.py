"""The Python side of bf16_panels.c: `pdserve::bf16_pack` (a bfloat16 weight [N, K] into
k-paired panels of 32 columns, once) and `pdserve::bf16_panels_linear` (x @ W^T over them
for batched rows), plus `panels_available()`: whether this build has the kernel
(AVX512-BF16, or the AVX2 form where the build has no AVX-512). What runs a bfloat16 batch
where the CPU has no AMX tiles (amx_linear.py otherwise); tested against F.linear.

The ops check devices, dtypes, shapes and strides before the ctypes call, so nothing
reaches C that could read or write outside the tensors given.
"""

from __future__ import annotations

import functools

import torch

from pdserve.engine.cpu_kernels import packed_checks
from pdserve.engine.cpu_kernels.library import load, register_fake, typed_op

PANEL = 32  # a weight's N must divide by 32
K_STEP = 2  # and its K by 2 (vdpbf16ps takes k in pairs)


@functools.cache
def panels_available() -> bool:
    """True when the library was built with a kernel (AVX512-BF16, or AVX2 and FMA without
    AVX-512)."""
    return bool(load().bp_available())


def packable(weight: torch.Tensor) -> bool:
    """Whether bf16_pack takes this weight (bfloat16 [N, K], N % 32 == 0, K even)."""
    return packed_checks.packable(weight, torch.bfloat16, PANEL, K_STEP)


@typed_op("bf16_pack")
def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [N * K] bfloat16 in k-paired panels (bf16_panels.c)."""
    packed_checks.check_pack(weight, torch.bfloat16, PANEL, K_STEP)
    out = torch.empty(weight.numel(), dtype=torch.bfloat16)
    load().bp_pack(weight.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr())
    return out


@register_fake("bf16_pack")
def _(weight):
    packed_checks.check_pack(weight, torch.bfloat16, PANEL, K_STEP)
    return weight.new_empty(weight.numel())


def _check_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> None:
    packed_checks.check_linear(x, packed, n, torch.bfloat16, PANEL, K_STEP, "bf16_pack")


@typed_op("bf16_panels_linear")
def bf16_panels_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bfloat16 @ W^T -> [M, n] bfloat16, W packed by bf16_pack. RuntimeError
    where this build lacks the kernel (panels_available() says); MemoryError where the AVX2
    form gets no memory for its float32 copy of x's rows."""
    _check_linear(x, packed, n)
    out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
    if x.shape[0]:
        rc = load().bp_linear(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), n,
                              x.shape[1], out.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("bf16_panels_linear: no memory for the widened rows of x")
        if rc:
            raise RuntimeError("bf16_panels_linear: this build lacks the kernel")
    return out


@register_fake("bf16_panels_linear")
def _(x, packed, n):
    _check_linear(x, packed, n)
    return x.new_empty((x.shape[0], n))
