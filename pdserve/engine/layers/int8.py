"""int8 projections: a weight as int8 with a float32 scale for each GROUP consecutive
weights of a row (symmetric, round to nearest), and the few rows of x a decode step
multiplies it by quantized the same way, so the dot products are exact int32 sums
(llama.cpp's Q8_0 x Q8_0 does this with groups of 32). What it buys is bytes: a batch-1
decode step on the CPU streams every weight once and waits on memory, and int8 with its
scales is 0.53x bfloat16's bytes. `int8_linear_reference` is the arithmetic the C kernels
(pdserve::gemv_linear_int8, the decode stack) implement, in torch. Batches past a few rows
run oneDNN on the de-quantized weights with unquantized x.

Quality (`python -m pdserve.bench.int8_quality`, SmolLM2-135M over 2,048 tokens of this
repository's prose at 0b365e0; docs/benchmarks.md section 6, session 11): perplexity 25.06 in
float32 and bfloat16; int8 weights alone 25.10 with a scale per 64, 25.18 with one per row;
int8 weights and x, both per 64, 25.27 (the next token agrees with float32's at 94.7 % of
positions, bfloat16's at 97.3 %). The scales add 6 % to int8's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QMAX = 127  # symmetric: -127..127, so a group's scale maps its largest |w| to 127
GROUP = 64  # weights per scale along a row (gemv.c's Q8_GROUP)


def num_groups(k: int) -> int:
    return -(-k // GROUP)


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor  # int8 [N, K], contiguous
    scale: torch.Tensor  # float32 [N, ceil(K / GROUP)], contiguous

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight these stand for, [N, K] in dtype, contiguous."""
        k = self.q.shape[1]
        per_weight = self.scale.repeat_interleave(GROUP, dim=1)[:, :k]
        return (self.q.float() * per_weight).to(dtype).contiguous()

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


def _groups(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t [R, K] as float32 groups [R, G, GROUP] (zero past K), each group's largest |t|
    [R, G], and its scale amax / 127 (1 for an all-zero group, whose values are all 0)."""
    r, k = t.shape
    g = num_groups(k)
    padded = torch.zeros(r, g * GROUP, dtype=torch.float32)
    padded[:, :k] = t.detach().float()
    groups = padded.view(r, g, GROUP)
    amax = groups.abs().amax(dim=2)
    return groups, amax, torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the int8 kernels quantize it: (xq int8 [M, G * GROUP], zero past K;
    sx float32 [M, G]) with, per group, xq = round(x * (127 / amax)) (the quotient divided
    in float64, then float32, as gemv.c does) and sx = amax / 127 (1 for an all-zero
    group)."""
    groups, amax, sx = _groups(x)
    inv = torch.where(amax > 0, QMAX / amax.double(), torch.zeros_like(amax.double())).float()
    xq = torch.round(groups * inv[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return xq.flatten(1), sx


def int8_linear_reference(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [M, K] @ W^T as the int8 kernels compute it, in float64: the sum over groups of
    sx * sw * (xq . q), each group's dot product exact."""
    n, k = w.q.shape
    g = num_groups(k)
    xq, sx = quantize_activations(x)
    q = torch.zeros(n, g * GROUP, dtype=torch.float64)
    q[:, :k] = w.q.double()
    dots = torch.einsum("mgk,ngk->mng", xq.double().view(-1, g, GROUP), q.view(n, g, GROUP))
    return (dots * sx.double()[:, None, :] * w.scale.double()[None, :, :]).sum(dim=2)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """w [N, K] (any float dtype) as int8 and a float32 scale per GROUP of each row; an
    all-zero group gets scale 1 (its q is all zero either way)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int8 takes a float [N, K] weight, got {w.dtype} "
                         f"{tuple(w.shape)}")
    groups, _, scale = _groups(w)
    q = torch.round(groups / scale[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q=q.flatten(1)[:, :w.shape[1]].contiguous(), scale=scale.contiguous())


def int8_linear(base: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                weights: dict[int, Int8Weight]) -> Callable[[torch.Tensor, torch.Tensor],
                                                            torch.Tensor]:
    """`base` (the CPU ops' linear) for a model with int8 weights: x @ W^T through
    pdserve::gemv_linear_int8 where W is one of `weights` (keyed by the id of the
    de-quantized tensor the model holds) and x has at most GEMV_MAX_ROWS rows, as the decode
    stack computes it; `base` on the de-quantized tensor otherwise."""
    from pdserve.engine.cpu_kernels import gemv
    from pdserve.engine.layers.linear import GEMV_MAX_ROWS

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        qw = weights.get(id(weight))
        if qw is not None and x.shape[0] <= GEMV_MAX_ROWS:
            return gemv.gemv_linear_int8(x, qw.q, qw.scale)
        return base(x, weight)

    return linear
