"""x @ W.T for the model's projections: F.linear, oneDNN's matmul, or the C GEMV for the
few rows of a decode step on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Up to this many rows x @ W.T streams the weights (pdserve::gemv_linear); above it the
# work is a GEMM and oneDNN's blocked kernels win (crossover measured with
# `python -m pdserve.bench.cpu_linear`, docs/benchmarks.md section 6).
GEMV_MAX_ROWS = 4


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's matmul. On the CPU `F.linear` in float32 goes to MKL's
    sgemm, which re-packs the weight on every call: 1.2-2.5x slower at decode batch sizes
    (up to 4x for the LM head), measured in docs/benchmarks.md section 1."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def cpu_linear() -> Linear:
    """The C GEMV for decode-sized inputs, oneDNN for the rest; raises KernelBuildError
    when the C kernels cannot be built."""
    from pdserve.engine.cpu_kernels.gemv import gemv_linear
    from pdserve.engine.cpu_kernels.library import DTYPE_CODES, load

    load()
    fallback = onednn_linear if torch.backends.mkldnn.is_available() else F.linear

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS and x.dtype in DTYPE_CODES:
            return gemv_linear(x, weight)
        return fallback(x, weight)

    return linear


def pick_linear(device: torch.device, impl: str = "torch") -> Linear:
    """impl "cpu": `cpu_linear`. Otherwise oneDNN on the CPU where torch has it, elsewhere
    F.linear (cuBLAS on CUDA)."""
    if device.type == "cpu" and impl == "cpu":
        return cpu_linear()
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        return onednn_linear
    return F.linear
