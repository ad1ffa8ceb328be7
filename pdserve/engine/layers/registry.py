"""Which implementation runs: the per-device bundle of layer ops, and attention backends by
name.

Both tables name their entries as "module:attribute" strings or as factories inside the
layer files, resolved only when chosen, so importing this module imports no backend, no C
library and no Triton. Backends and kernels never import this module (nor the model):
the dependency points one way, registry -> layer files -> fast paths.

A fast path that cannot start (no C compiler, no Triton) is a one-line warning naming the
fallback, logged once per process, and the eager torch ops or the `torch` attention
backend run instead; asked for by name, the same failure is raised.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.layers import activation, linear, norm, rotary
from pdserve.engine.layers.attention import AttentionBackend

log = logging.getLogger(__name__)

# the layer-op implementation each device type gets by default; anything else: "torch"
DEVICE_IMPLS = {"cpu": "cpu", "cuda": "triton"}
ATTENTION_BACKENDS = {
    "torch": "pdserve.engine.attention.torch_backend:TorchAttentionBackend",
    "cpu": "pdserve.engine.attention.cpu_backend:CpuAttentionBackend",
    "triton": "pdserve.engine.attention.triton_backend:TritonAttentionBackend",
}
# what a fast path raises when it cannot start: a failed C build (KernelBuildError is a
# RuntimeError), a missing or misconfigured triton
_UNAVAILABLE = (RuntimeError, ImportError, OSError)
_warned: set[str] = set()


@dataclass(frozen=True)
class LayerOps:
    """The element-wise ops and the projection of a decoder layer, one implementation each
    (signatures and semantics: the references in norm.py, rotary.py, activation.py,
    linear.py)."""

    name: str  # "torch", "cpu" or "triton"
    add_rms_norm: norm.AddRmsNorm
    rope_tables: Any  # rotary.Rope.tables
    rope: Any  # rotary.Rope.rope
    silu_mul: activation.SiluMul
    linear: linear.Linear


def build_layer_ops(impl: str, device: torch.device | str) -> LayerOps:
    """The bundle of implementation `impl`; raises what its fast paths raise when they
    cannot start."""
    device = torch.device(device)
    if impl not in norm.IMPLS:
        raise ValueError(f"layer ops must be one of {sorted(norm.IMPLS)}, got {impl!r}")
    rope = rotary.IMPLS[impl]()
    return LayerOps(name=impl, add_rms_norm=norm.IMPLS[impl](), rope_tables=rope.tables,
                    rope=rope.rope, silu_mul=activation.IMPLS[impl](),
                    linear=linear.pick_linear(device, impl))


def layer_ops(device: torch.device | str) -> LayerOps:
    """The fused ops for this device (C on the CPU, Triton on CUDA), else the eager ones."""
    device = torch.device(device)
    impl = DEVICE_IMPLS.get(device.type, "torch")
    if impl != "torch":
        try:
            return build_layer_ops(impl, device)
        except _UNAVAILABLE as e:
            _warn_once(f"{impl} layer ops", "the eager torch layer ops", e)
    return build_layer_ops("torch", device)


def available_backends() -> list[str]:
    """The attention backends whose modules import here (triton needs the triton package)."""
    names = []
    for name, target in ATTENTION_BACKENDS.items():
        try:
            importlib.import_module(target.partition(":")[0])
        except ImportError:
            continue
        names.append(name)
    return sorted(names)


def get_backend(name: str, device: str | torch.device = "cpu") -> AttentionBackend:
    """`auto` picks triton on CUDA, cpu on the CPU when its C kernels build, else torch."""
    if name == "auto":
        kind = torch.device(device).type
        if kind == "cpu":
            try:
                return _resolve(ATTENTION_BACKENDS["cpu"])()
            except _UNAVAILABLE as e:
                _warn_once("cpu attention kernels", "the `torch` attention backend", e)
        name = "triton" if kind == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of "
                         f"{['auto', *sorted(ATTENTION_BACKENDS)]}, got {name!r}")
    return _resolve(ATTENTION_BACKENDS[name])()


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _warn_once(what: str, fallback: str, error: BaseException) -> None:
    if what in _warned:
        return
    _warned.add(what)
    # one line: a compiler's stderr can run to pages; its first line names the problem
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    log.warning("%s unavailable (%s); using %s", what, first, fallback)
