"""The argument checks shared by the projections over a packed copy of each weight (AMX
tiles for bfloat16, amx_linear.py; AVX-512 or AVX2 panels for float32, f32_panels.py): what
a weight must be to be packed, and what x and the packed copy must be for a product, so that
nothing reaches C that could read or write outside the tensors given."""

from __future__ import annotations

import torch

from pdserve.engine.cpu_kernels.library import require


def packable(weight: torch.Tensor, dtype: torch.dtype, n_block: int, k_step: int) -> bool:
    """Whether weight is a non-empty CPU [N, K] of dtype with N % n_block == K % k_step == 0."""
    return (weight.dtype == dtype and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.shape[0] % n_block == 0 and weight.shape[1] % k_step == 0
            and weight.shape[0] > 0 and weight.shape[1] > 0)


def _rule(n_block: int, k_step: int) -> str:
    return f"N % {n_block} == 0" + (f" and K % {k_step} == 0" if k_step > 1 else "")


def check_pack(weight: torch.Tensor, dtype: torch.dtype, n_block: int, k_step: int) -> None:
    require(weight=weight)
    if not packable(weight, dtype, n_block, k_step) or not weight.is_contiguous():
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"weight must be a contiguous {name} CPU [N, K] with "
                         f"{_rule(n_block, k_step)}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")


def check_linear(x: torch.Tensor, packed: torch.Tensor, n: int, dtype: torch.dtype,
                 n_block: int, k_step: int, pack_op: str) -> None:
    """x [M, K] with contiguous rows and packed (pack_op's output for an [n, K] weight),
    both CPU tensors of dtype."""
    require(x=x, packed=packed)
    if x.device.type != "cpu" or packed.device.type != "cpu":
        raise ValueError(f"x and packed must be CPU tensors, got {x.device} and "
                         f"{packed.device}")
    name = str(dtype).removeprefix("torch.")
    if x.dtype != dtype or packed.dtype != dtype:
        raise ValueError(f"x and packed must be {name}, got {x.dtype} and {packed.dtype}")
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [M, K] with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    k = x.shape[1]
    if (n <= 0 or k <= 0 or n % n_block or k % k_step or packed.dim() != 1
            or packed.numel() != n * k or not packed.is_contiguous()):
        raise ValueError(f"packed must be {pack_op} of a [{n}, {k}] weight "
                         f"({_rule(n_block, k_step)}), got {packed.numel()} elements")
