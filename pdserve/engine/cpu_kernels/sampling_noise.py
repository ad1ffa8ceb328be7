"""The Python side of sampling_noise.c as a typed torch op: `pdserve::exponential_noise`,
the CPU path of `pdserve.engine.sampling_noise.exponential_noise` (whose torch formula is
its reference in the tests).

The op checks the keys' device, dtype, shape and range before the ctypes call; it allocates
the output itself, so nothing reaches C that could write outside it.
"""

from __future__ import annotations

import torch

from pdserve.engine.cpu_kernels.library import load, register_fake, require, typed_op


def _check(keys: torch.Tensor, vocab: int) -> None:
    require(keys=keys)
    if (keys.device.type != "cpu" or keys.dtype != torch.int64 or keys.dim() != 1
            or not keys.is_contiguous()):
        raise ValueError(f"keys must be a contiguous int64 CPU [B], got {keys.dtype} "
                         f"{tuple(keys.shape)} on {keys.device}")
    if vocab < 0:
        raise ValueError(f"vocab must be >= 0, got {vocab}")


@typed_op("exponential_noise")
def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] 32-bit stream keys (`sampling_noise.row_keys`) -> [B, vocab] float32 Exp(1)
    noise, the stream `pdserve.engine.sampling_noise` defines."""
    _check(keys, vocab)
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32)
    if keys.numel():
        lo, hi = int(keys.min()), int(keys.max())
        if lo < 0 or hi >= 1 << 32:
            raise ValueError(f"keys must be in [0, 2**32), got {lo if lo < 0 else hi}")
    if out.numel():
        load().sn_exponential_noise(keys.data_ptr(), keys.shape[0], vocab, out.data_ptr(),
                                    torch.get_num_threads())
    return out


@register_fake("exponential_noise")
def _(keys, vocab):
    _check(keys, vocab)
    return keys.new_empty((keys.shape[0], vocab), dtype=torch.float32)
