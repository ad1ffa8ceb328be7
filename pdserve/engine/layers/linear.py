"""x @ W.T for the model's projections: F.linear, or oneDNN's matmul on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's matmul. On the CPU `F.linear` in float32 goes to MKL's
    sgemm, which re-packs the weight on every call: 1.2-2.5x slower at decode batch sizes
    (up to 4x for the LM head), measured in docs/benchmarks.md section 1."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def pick_linear(device: torch.device) -> Linear:
    """oneDNN on the CPU where torch has it; elsewhere F.linear (cuBLAS on CUDA). The choice
    is by device only: it holds whichever element-wise ops the model falls back to."""
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        return onednn_linear
    return F.linear
