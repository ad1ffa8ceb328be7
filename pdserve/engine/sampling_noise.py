"""The seed stream: the exponential noise a sampled token is drawn with, defined once.

A draw is the exponential race: argmax(p / E) with E[v] ~ Exp(1) i.i.d. per vocab entry is
an exact sample from p. E comes from a counter-based hash of (row seed, output position,
vocab index) in 32-bit integer arithmetic, so the same seed gives the same tokens on any
device (CPU or CUDA), at any batch size and batch position, with no generator state and no
host sync (the graph-captured decode step can compute it). Rows without a seed get a fresh
random seed per step from the host (`row_seed`), through the same function.

Both the device sampler and the per-row reference sampler draw with `exponential_race`.
On the CPU the noise and the race are C (cpu_kernels/sampling_noise.c: the race hashes the
noise in the pass that compares, writing nothing of size [B, vocab]); the torch formulas
below are their references and the path on other devices. For 64 sampled rows of a 49k
vocabulary on two cores the formulas took ~67 ms for the noise and ~21 ms more for the
race's temporaries, more than the decode step they sample for.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: every product of a 32-bit value stays inside int64
_GOLDEN = 0x9E3779B9
NOISE_MIN = 2.0**-25  # the noise where u rounds to 1 (noise_from_keys)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    x = (((x >> 16) ^ x) * _MUL) & _MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds in [0, 2**63) and output positions -> [B] 32-bit stream keys."""
    k = _mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32)
    k = _mix32(k)
    return _mix32(k ^ (positions & _MASK32))


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds, [B] positions -> [B, vocab] float32 Exp(1) noise on the seeds' device."""
    keys = row_keys(seeds.long(), positions.long())  # [B]
    ops = _cpu_ops() if keys.device.type == "cpu" else None
    if ops is not None:
        return ops.noise(keys.contiguous(), vocab)
    return noise_from_keys(keys, vocab)


def exponential_race(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """[B, V] float32 logits, [B] seeds, [B] positions -> [B] int64 tokens, each an exact
    draw from its row's softmax: argmax(softmax(logits) / E) with E the rows' noise."""
    keys = row_keys(seeds.long(), positions.long())
    ops = _cpu_ops() if logits.device.type == "cpu" else None
    if ops is not None:
        return ops.race(logits.float().contiguous(), keys.contiguous())
    return race_from_keys(logits, keys)


def noise_from_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The torch formula: [B] stream keys -> [B, vocab] float32 Exp(1) noise."""
    idx = torch.arange(vocab, dtype=torch.long, device=keys.device) * _GOLDEN  # < 2**50
    bits = _mix32((keys[:, None] + idx[None, :]) & _MASK32)  # [B, V]
    # 24 bits -> a uniform inside (0, 1) (b + 0.5 rounds to float32 above 2**23)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # the top b's u rounds to 1: its noise is -log(1 - 2**-25) ~ 2**-25, not 0 (a zero
    # noise made a filtered token's score 0 / 0, a NaN argmax picks)
    return (-torch.log(u)).clamp_min(NOISE_MIN)


def race_from_keys(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The torch formula of the race: [B, V] logits, [B] stream keys -> [B] tokens."""
    noise = noise_from_keys(keys, logits.shape[-1]).to(logits.device)
    return (logits.float().softmax(-1) / noise).argmax(-1)


def row_seed(seed: int | None) -> int:
    """The seed a row draws with this step: its own, else a fresh random one."""
    return seed if seed is not None else random.getrandbits(63)


@dataclass(frozen=True)
class CpuSamplingOps:
    noise: Callable[[torch.Tensor, int], torch.Tensor]  # pdserve::exponential_noise
    race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # pdserve::exponential_race


_NOT_LOADED = object()
_cpu: object = _NOT_LOADED


def _cpu_ops() -> CpuSamplingOps | None:
    """The C noise and race, or None (warned once) where the C kernels cannot be built:
    then the torch formulas run."""
    global _cpu
    if _cpu is _NOT_LOADED:
        from pdserve.engine.cpu_kernels.library import op_or_none

        noise = op_or_none("sampling_noise", "exponential_noise", "the C sampling kernels",
                           "sampling draws with torch")
        _cpu = None
        if noise is not None:  # the same module and library: the race loads with it
            from pdserve.engine.cpu_kernels.sampling_noise import exponential_race as race

            _cpu = CpuSamplingOps(noise, race)
    return _cpu  # type: ignore[return-value]
