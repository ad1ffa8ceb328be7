"""Weight-only int8: a projection's weight as int8 with a float32 scale for each GROUP
consecutive weights of a row (symmetric, round to nearest; llama.cpp's Q8_0 groups by 32).
What it buys is bytes: a batch-1 decode step on the CPU streams every weight once and
waits on memory, so 0.53x of bfloat16's bytes is about half its time
(pdserve::gemv_linear_int8, the decode stack). Larger batches run oneDNN on the
de-quantized weights, so every path computes with the same weights up to the model dtype's
rounding.

Why groups of 64 and not one scale per row (`python -m pdserve.bench.int8_quality`,
SmolLM2-135M over 2,048 tokens of this repository's prose): perplexity 25.057 in float32,
25.058 in bfloat16, 25.097 with a scale per 64 weights, 25.183 with one per row; the
next-token choice agrees with float32's at 97.3 % of positions in bfloat16, 97.7 % with a
scale per 64, 95.6 % with one per row. The scales add 6 % to int8's bytes.
"""

from __future__ import annotations

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


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """w [N, K] (any float dtype) as int8 and a float32 scale per GROUP of each row; an
    all-zero group gets scale 1 (its q is all zero either way)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int8 takes a float [N, K] weight, got {w.dtype} "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    g = num_groups(k)
    padded = torch.zeros(n, g * GROUP, dtype=torch.float32)
    padded[:, :k] = w.detach().float()
    groups = padded.view(n, g, GROUP)
    amax = groups.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(groups / scale[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q=q.view(n, g * GROUP)[:, :k].contiguous(), scale=scale.contiguous())
