"""RMSNorm, and the residual add fused in front of it: the reference and its fast paths.

`rms_norm` is the one reference of the norm (transformers' LlamaRMSNorm rounding: float32
statistics, the normalised row cast back to the model dtype before the weight multiply);
`add_rms_norm` is the step the model takes (`x += delta; h = rms_norm(x)`, the residual
stream updated in place). The C op (pdserve.engine.cpu_kernels.layer_ops) and the Triton
kernel (pdserve.engine.kernels.rms_norm) do the same in one pass over memory; `IMPLS` maps
each implementation's name to a factory that imports it only when called.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AddRmsNorm = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, float], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed in float32 like the reference implementation, then cast back
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += delta in place (the residual stream; None: no add), then RMSNorm(x) as a new
    tensor. x [T, H], delta [T, H], weight [H]."""
    if delta is not None:
        x.add_(delta)
    return rms_norm(x, weight, eps)


def _cpu() -> AddRmsNorm:
    from pdserve.engine.cpu_kernels import layer_ops, library

    library.load()  # build now: a missing compiler shows at model load, not mid-step
    return layer_ops.add_rms_norm


def _triton() -> AddRmsNorm:
    from pdserve.engine.kernels.rms_norm import add_rms_norm as kernel

    def add_rms_norm_triton(x, delta, weight, eps):
        # the kernel's `residual` is the stream it adds into: the model's x
        if delta is None:
            return kernel(x=x, weight=weight, eps=eps)
        return kernel(x=delta, weight=weight, eps=eps, residual=x)

    return add_rms_norm_triton


IMPLS: dict[str, Callable[[], AddRmsNorm]] = {
    "torch": lambda: add_rms_norm,
    "cpu": _cpu,
    "triton": _triton,
}
