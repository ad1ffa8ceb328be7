"""SiLU(gate) * up, the Llama MLP's activation over the fused gate_up projection: the
reference and its fast paths (the C op on the CPU, a Triton kernel on CUDA), each one pass
over the [T, 2I] rows instead of eager torch's slice, silu and multiply."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SiluMul = Callable[[torch.Tensor], torch.Tensor]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up] -> [T, I]."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def _cpu() -> SiluMul:
    from pdserve.engine.cpu_kernels import layer_ops, library

    library.load()  # build now: a missing compiler shows at model load, not mid-step
    return layer_ops.silu_mul


def _triton() -> SiluMul:
    from pdserve.engine.kernels.silu_mul import silu_mul as kernel

    return kernel


IMPLS: dict[str, Callable[[], SiluMul]] = {
    "torch": lambda: silu_mul,
    "cpu": _cpu,
    "triton": _triton,
}
