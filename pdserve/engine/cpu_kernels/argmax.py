"""The Python side of argmax.c: the typed op `pdserve::argmax_rows`, greedy decoding's
argmax on the CPU (torch.argmax(-1)'s answer, NaN rows included; torch's own is its
reference in the tests)."""

from __future__ import annotations

import torch

from pdserve.engine.cpu_kernels.library import load, register_fake, require, typed_op


def _check(x: torch.Tensor) -> None:
    require(x=x)
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2
            or x.stride(1) != 1 or (x.shape[0] and not x.shape[1])):
        raise ValueError(f"x must be a float32 CPU [R, V] with V >= 1 and rows contiguous, "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")


@typed_op("argmax_rows")
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 -> [R] int64: each row's first index of its largest value (of its
    first NaN where it has one), as x.argmax(-1)."""
    _check(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if out.numel():
        load().am_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                              out.data_ptr(), torch.get_num_threads())
    return out


@register_fake("argmax_rows")
def _(x):
    _check(x)
    return x.new_empty(x.shape[0], dtype=torch.int64)
