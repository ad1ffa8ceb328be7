"""x @ W.T for the model's projections: F.linear, oneDNN's matmul, or on the CPU the C
kernels: the GEMV for a few rows, and for decode batches the AMX tiles or bfloat16 panels
(AVX512-BF16, or AVX2) or AVX-512 or AVX2 panels (float32) over a packed copy of each
weight; the panels take prefill chunks too."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Up to this many rows x @ W.T streams the weights (pdserve::gemv_linear); above it the
# work is a GEMM and oneDNN's blocked kernels win (crossover measured with
# `python -m pdserve.bench.cpu_linear`, docs/benchmarks.md section 6).
GEMV_MAX_ROWS = 4
# From there up to this many rows a projection runs on its packed copy (`batch_packed`)
# where the CPU takes it: bfloat16 on AMX tiles (pdserve::amx_linear, 1.2-1.6x oneDNN's
# matmul over a whole step's projections at 8-64 rows; at 128 rows and more oneDNN's
# blocking wins) or, without AMX, on AVX512-BF16 panels (pdserve::bf16_panels_linear, as
# fast as oneDNN per call on a Zen 4, and one kernel with the decode stack's batched
# form), float32 on AVX-512 or AVX2 panels (pdserve::f32_panels_linear, as fast
# as oneDNN there on a Xeon, 1.08-1.17x on a Zen 3, and one kernel with the decode stack's
# batched form) (docs/benchmarks.md section 6).
BATCH_MAX_ROWS = 64
# The AVX512-BF16 panels also win past it, at prefill sizes: a step's projections against
# oneDNN on its blocked copy, on a Zen 4, 1.06x at 128 rows, 1.10x at 256, 1.12x at 512,
# 1.04x at 1024 (`python -m pdserve.bench.cpu_linear`, docs/benchmarks.md section 6,
# session 20), so they take every row count above the GEMV's. So does their AVX2 form,
# where oneDNN has no bfloat16 at all (F.linear: ~20 GFLOP/s on two Zen 3 cores, the
# panels 146-181 at 16-2048 rows; session 29). So do the float32 panels: 1.02-1.03x oneDNN
# per call past 64 rows on a Zen 4 (session 20); on a Zen 3 a whole float32 prefill, three
# runs alternated, 194-204 ms against 219-227 at 128 tokens and 745-773 against 798-824 at
# 512 (session 29; unmeasured on a Xeon). oneDNN then keeps no blocked copy of those
# weights. Only the AMX tiles (oneDNN's blocking wins from 128 rows) stop at
# BATCH_MAX_ROWS.
# oneDNN's blocked copy of a weight is made for a batch size, but serves any (measured:
# a copy made for M rows ran M + 7 rows as fast); 128 is between a decode batch and a
# prefill chunk.
PACK_ROWS = 128


@functools.cache
def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's matmul runs this dtype on this CPU: float32 wherever torch has
    oneDNN; bfloat16 and float16 only with the instructions torch's oneDNN asks for them
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU, AMD's Zen 3 say, has neither),
    where it otherwise fails to create the primitive."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN's matmul (F.linear for a dtype it does not run here,
    `onednn_takes`). On the CPU `F.linear` in float32 goes to MKL's sgemm, which re-packs
    the weight on every call: 1.2-2.5x slower at decode batch sizes (up to 4x for the LM
    head), measured in docs/benchmarks.md section 1."""
    if not onednn_takes(weight.dtype):
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def blocked_onednn_linear() -> Linear:
    """oneDNN's matmul on a blocked copy of each weight, made at its first call and kept
    while the weight lives (F.linear for a dtype oneDNN does not run here). The blocked
    layout is what oneDNN would otherwise re-block on every call: 1.2-2.1x on the
    projections at M = 16-64 (float32 75 -> 92-146 GFLOP/s at 16 rows, bfloat16 115 -> 243),
    1.05-1.15x at prefill sizes (docs/benchmarks.md section 6). It doubles the projections'
    memory on the CPU."""
    # keyed by id, dropped by a finalizer when the weight goes (a WeakKeyDictionary would
    # compare two tensors with ==)
    packed: dict[int, torch.Tensor] = {}

    def blocked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not onednn_takes(weight.dtype):
            return F.linear(x, weight)
        blocked = packed.get(id(weight))
        if blocked is None:
            blocked = packed[id(weight)] = torch.ops.mkldnn._reorder_linear_weight(weight,
                                                                                   PACK_ROWS)
            weakref.finalize(weight, packed.pop, id(weight), None)
        return torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")

    return blocked_linear


def cpu_linear() -> Linear:
    """The C GEMV for decode-sized inputs (the plain [N, K] rows), oneDNN on blocked weights
    for the rest; raises KernelBuildError when the C kernels cannot be built."""
    from pdserve.engine.cpu_kernels.gemv import gemv_linear
    from pdserve.engine.cpu_kernels.library import DTYPE_CODES, load

    load()
    gemm = blocked_onednn_linear()
    batched = packed_linear()

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS and x.dtype in DTYPE_CODES:
            return gemv_linear(x, weight)
        y = batched(x, weight)
        return gemm(x, weight) if y is None else y

    return linear


def packed_linear() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """x @ W.T over `batch_packed(weight)`: AMX tiles or bfloat16 panels for bfloat16,
    AVX-512 or AVX2 panels for float32; None where the weight has no packed copy (its dtype,
    its shape, or this CPU or build lacks the kernel) or x has more rows than its kernel
    wins at (`_batch_kernel`)."""

    def batched_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        entry = _packed(weight)
        if entry is None or x.dtype != weight.dtype or x.shape[1] != weight.shape[1]:
            return None
        packed, kernel = entry
        if x.shape[0] > kernel.max_rows:
            return None
        return kernel.linear(x if x.stride(-1) == 1 else x.contiguous(), packed,
                             weight.shape[0])

    return batched_linear


@dataclass(frozen=True)
class BatchKernel:
    """A batched kernel: how it packs a weight, its x @ W.T over the packed copy, and the
    most rows it takes (more go to oneDNN)."""
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    max_rows: float


def _batch_kernel(weight: torch.Tensor) -> BatchKernel | None:
    """The batched kernel that takes this weight on this CPU and build, or None. bfloat16:
    AMX tiles on a CPU with them, else bfloat16 panels (AVX512-BF16, or the AVX2 form where
    the build has no AVX-512); chosen by the machine alone, as the decode stack's batched
    form chooses which layout to read (a weight the tiles cannot take gets no packed copy
    there, not panels). float32: panels. The panels take every row count, the tiles up to
    BATCH_MAX_ROWS."""
    from pdserve.engine.cpu_kernels import amx_linear, bf16_panels, f32_panels

    if weight.dtype == torch.bfloat16 and amx_linear.amx_available():
        if amx_linear.packable(weight):
            return BatchKernel(amx_linear.amx_pack, amx_linear.amx_linear, BATCH_MAX_ROWS)
        return None
    if bf16_panels.packable(weight) and bf16_panels.panels_available():
        return BatchKernel(bf16_panels.bf16_pack, bf16_panels.bf16_panels_linear, math.inf)
    if f32_panels.packable(weight) and f32_panels.panels_available():
        return BatchKernel(f32_panels.f32_pack, f32_panels.f32_panels_linear, math.inf)
    return None


# weight id -> (its packed copy, the kernel that reads it), None where no kernel takes it;
# dropped with the weight
_packs: dict[int, tuple[torch.Tensor, BatchKernel] | None] = {}


def _packed(weight: torch.Tensor) -> tuple[torch.Tensor, BatchKernel] | None:
    key = id(weight)
    if key not in _packs:  # first use only: every batched projection call comes here
        kernel = _batch_kernel(weight)
        _packs[key] = None if kernel is None else (kernel.pack(weight.contiguous()), kernel)
        weakref.finalize(weight, _packs.pop, key, None)
    return _packs[key]


def batch_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a weight the batched kernels read (a bfloat16 weight in the AMX
    tiles' layout where the CPU has them, else in bfloat16 panels where the build has
    them; a float32 one in AVX-512 or AVX2 panels where the build has them), made at its
    first use and kept while the weight lives (like oneDNN's blocked copy: one more copy of
    the projections in memory), shared by the layer loop and the decode stack; None when no
    kernel here takes it."""
    entry = _packed(weight)
    return None if entry is None else entry[0]


def prepack_cpu_copies(linear: Linear, weights: list[torch.Tensor]) -> None:
    """Make the copies `cpu_linear` keeps of these weights now: oneDNN's blocked copy where
    a product of BATCH_MAX_ROWS + 1 zero rows reaches oneDNN (not under the panels, which
    take every batch) and the batched kernels' (`batch_packed`)."""
    with torch.inference_mode():
        for w in weights:
            linear(torch.zeros(BATCH_MAX_ROWS + 1, w.shape[1], dtype=w.dtype), w)
            batch_packed(w)


def pick_linear(device: torch.device, impl: str = "torch") -> Linear:
    """impl "cpu": `cpu_linear`. Otherwise oneDNN on the CPU where torch has it, elsewhere
    F.linear (cuBLAS on CUDA)."""
    if device.type == "cpu" and impl == "cpu":
        return cpu_linear()
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        return onednn_linear
    return F.linear
