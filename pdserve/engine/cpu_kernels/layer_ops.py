"""The Python side of layer_ops.c as typed torch ops: `pdserve::add_rms_norm`,
`pdserve::rope_` and `pdserve::silu_mul`, the C paths of pdserve.engine.layers.norm, .rotary
and .activation (whose references they are tested against).

Each op's schema comes from its type hints (library.typed_op), so the dispatcher checks
every argument's type at the call; the op's body then checks devices, dtypes, shapes and
strides (and the RoPE kernel every position against its tables) before the ctypes call,
so nothing reaches C that could make it read or write outside the tensors given. Fake
implementations run the same checks on metadata alone, so torch.compile traces the ops
without running them.
"""

from __future__ import annotations

import torch

from pdserve.engine.cpu_kernels.library import (
    DTYPE_CODES,
    load,
    register_fake,
    require,
    typed_op,
)


def _check(**tensors: torch.Tensor | None) -> int:
    """The shared dtype's code; ValueError unless all are CPU tensors of one supported dtype
    whose last dimension is contiguous."""
    dtype = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cpu" or t.dtype not in DTYPE_CODES:
            raise ValueError(f"{name} must be a float32 or bfloat16 CPU tensor, got {t.dtype} "
                             f"on {t.device}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{name} is {t.dtype}, the others {dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        dtype = t.dtype
    return DTYPE_CODES[dtype]


def _check_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None,
                        weight: torch.Tensor) -> int:
    require(x=x, weight=weight)
    dt = _check(x=x, delta=delta, weight=weight)
    if x.dim() != 2 or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"x must be [T, H] and weight [H], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if delta is not None and (delta.shape != x.shape or not delta.is_contiguous()):
        raise ValueError(f"delta must be a contiguous {tuple(x.shape)}, got "
                         f"{tuple(delta.shape)}")
    return dt


# x is written only when delta is given; declared mutated always (the schema is static)
@typed_op("add_rms_norm", mutates_args=("x",))
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += delta in place (unless None), then weight * x / sqrt(mean(x^2) + eps) as a new
    contiguous tensor. x [T, H] (rows may be strided), delta [T, H] contiguous, weight [H]."""
    dt = _check_add_rms_norm(x, delta, weight)
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype)
    if t:
        load().lo_add_rms_norm(x.data_ptr(), x.stride(0), delta.data_ptr() if delta is not None
                               else None, weight.data_ptr(), out.data_ptr(), t, h, eps, dt,
                               torch.get_num_threads())
    return out


@register_fake("add_rms_norm")
def _(x, delta, weight, eps):
    _check_add_rms_norm(x, delta, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check_rope(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> int:
    require(qk=qk, positions=positions, cos=cos, sin=sin)
    dt = _check(qk=qk, cos=cos, sin=sin)
    if qk.dim() != 3 or (qk.shape[1] > 1 and qk.stride(1) != qk.shape[2]):
        raise ValueError(f"qk must be [T, heads, D] with packed heads, got shape "
                         f"{tuple(qk.shape)} strides {qk.stride()}")
    t, heads, d = qk.shape
    if d % 2 or d > 1024:
        raise ValueError(f"head_dim must be even and at most 1024, got {d}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or not (
            cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos and sin must be contiguous [max_position, {d}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if (positions.dtype != torch.int64 or positions.shape != (t,)
            or not positions.is_contiguous()):
        raise ValueError(f"positions must be a contiguous int64 [{t}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if positions.device.type != "cpu":
        raise ValueError(f"positions must be a CPU tensor, got {positions.device}")
    return dt


@typed_op("rope_", mutates_args=("qk",))
def _rope(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> None:
    dt = _check_rope(qk, positions, cos, sin)
    t, heads, d = qk.shape
    if t:
        bad = load().lo_rope(qk.data_ptr(), qk.stride(0), positions.data_ptr(), cos.data_ptr(),
                             sin.data_ptr(), cos.shape[0], t, heads, d, dt,
                             torch.get_num_threads())
        if bad >= 0:
            raise ValueError(f"positions[{bad}] = {int(positions[bad])} is outside the RoPE "
                             f"tables' 0..{cos.shape[0] - 1}")


@register_fake("rope_")
def _(qk, positions, cos, sin):
    _check_rope(qk, positions, cos, sin)


def rope_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
          ) -> torch.Tensor:
    """Rotate-half RoPE in place on qk [T, heads, D] (heads packed, any row stride) at
    positions [T] (int64) from tables cos/sin [max_position, D]; returns qk."""
    _rope(qk, positions, cos, sin)
    return qk


def _check_silu_mul(gate_up: torch.Tensor) -> int:
    require(gate_up=gate_up)
    dt = _check(gate_up=gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be a contiguous [T, 2I], got {tuple(gate_up.shape)}")
    return dt


@typed_op("silu_mul")
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2I], contiguous."""
    dt = _check_silu_mul(gate_up)
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=gate_up.dtype)
    if t:
        load().lo_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, i, dt,
                           torch.get_num_threads())
    return out


@register_fake("silu_mul")
def _(gate_up):
    _check_silu_mul(gate_up)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
