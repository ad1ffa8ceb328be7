"""The Python side of sampling_noise.c as typed torch ops: `pdserve::exponential_noise` and
`pdserve::exponential_race`, the CPU paths of `pdserve.engine.sampling_noise`'s
`exponential_noise` and `exponential_race` (whose torch formulas are their references in
the tests).

The ops check the keys' and logits' devices, dtypes, shapes and ranges before the ctypes
call; they allocate their outputs themselves, so nothing reaches C that could read or write
outside the tensors given.
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


def _check_key_range(keys: torch.Tensor) -> None:
    if keys.numel():
        lo, hi = int(keys.min()), int(keys.max())
        if lo < 0 or hi >= 1 << 32:
            raise ValueError(f"keys must be in [0, 2**32), got {lo if lo < 0 else hi}")


@typed_op("exponential_noise")
def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] 32-bit stream keys (`sampling_noise.row_keys`) -> [B, vocab] float32 Exp(1)
    noise, the stream `pdserve.engine.sampling_noise` defines."""
    _check(keys, vocab)
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32)
    _check_key_range(keys)
    if out.numel():
        load().sn_exponential_noise(keys.data_ptr(), keys.shape[0], vocab, out.data_ptr(),
                                    torch.get_num_threads())
    return out


@register_fake("exponential_noise")
def _(keys, vocab):
    _check(keys, vocab)
    return keys.new_empty((keys.shape[0], vocab), dtype=torch.float32)


def _check_race(logits: torch.Tensor, keys: torch.Tensor) -> None:
    require(logits=logits)
    _check(keys, 0)
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or not logits.is_contiguous() or logits.shape[0] != keys.shape[0]
            or (logits.shape[0] and not logits.shape[1])):
        raise ValueError(f"logits must be a contiguous float32 CPU [{keys.shape[0]}, V] with "
                         f"V >= 1, got {logits.dtype} {tuple(logits.shape)} on "
                         f"{logits.device}")


@typed_op("exponential_race")
def exponential_race(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 logits, [B] stream keys -> [B] int64 tokens: argmax over v of
    softmax(logits[r])_v / noise_v, the noise of `exponential_noise(keys, V)` (never
    materialised): an exact draw from each row's softmax."""
    _check_race(logits, keys)
    _check_key_range(keys)
    out = torch.empty(keys.shape[0], dtype=torch.int64)
    if out.numel():
        load().sn_exponential_race(logits.data_ptr(), keys.data_ptr(), logits.shape[0],
                                   logits.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


@register_fake("exponential_race")
def _(logits, keys):
    _check_race(logits, keys)
    return keys.new_empty(keys.shape[0])
