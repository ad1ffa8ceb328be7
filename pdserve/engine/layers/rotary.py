"""Rotary position embedding (RoPE, rotate-half: the Llama / transformers convention), in
place on the Q and K heads of the fused QKV rows: the reference and its fast paths.

The model calls two functions per implementation: `tables(positions, cos, sin)` once per
forward (what `rope` needs for this step's positions, shared by every layer), then
`rope(qk, tables)` per layer on qk [T, heads, D] (heads packed, any row stride: a view of
the QKV rows) and uses what it returns. The reference gathers cos/sin rows up front and
returns a new tensor; the C op and the Triton kernel read the tables by position and
rotate in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., D]; cos/sin broadcast to x."""
    return x * cos + rotate_half(x) * sin


def rope_tables(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D]


def rope(qk: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return apply_rope(qk, *tables)


@dataclass(frozen=True)
class Rope:
    """One implementation: `tables` once per forward, `rope` per layer."""

    tables: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
    rope: Callable[[torch.Tensor, Any], torch.Tensor]


def _by_position(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    return positions, cos, sin


def _cpu() -> Rope:
    from pdserve.engine.cpu_kernels import library
    from pdserve.engine.cpu_kernels.layer_ops import rope_

    library.load()  # build now: a missing compiler shows at model load, not mid-step
    return Rope(_by_position, lambda qk, tables: rope_(qk, *tables))


def _triton() -> Rope:
    from pdserve.engine.kernels.rotary import rotary_embedding

    def rope_triton(qk: torch.Tensor, tables: Any) -> torch.Tensor:
        positions, cos, sin = tables
        t, heads, d = qk.shape
        # every head of qk rotates: its 2-D view holds them all as "Q" heads. Positions
        # come from the runner; validate=False skips a device sync per layer (a bad row
        # would be left unrotated, never read out of bounds).
        rotary_embedding(qkv=qk.view(t, heads * d), cos=cos, sin=sin, positions=positions,
                         num_q_heads=heads, num_kv_heads=0, head_dim=d, validate=False)
        return qk

    return Rope(_by_position, rope_triton)


IMPLS: dict[str, Callable[[], Rope]] = {
    "torch": lambda: Rope(rope_tables, rope),
    "cpu": _cpu,
    "triton": _triton,
}
