"""Loading the compiled CPU kernels once per process, declaring their C signatures, and
registering their Python launchers as typed torch ops.

`load()` builds the library on first use (pdserve.engine.cpu_kernels.build) and keeps it; a
build or load failure is kept too and raised again on every later call, without retrying.

`typed_op` makes a launcher the op `pdserve::<name>`: its schema is inferred from the
launcher's type hints (`torch.library.infer_schema`, as `torch.library.custom_op` does), so
the dispatcher checks every argument's type at the call and torch.compile sees the op
(each has a fake implementation beside it). It registers the launcher directly as the op's
kernel instead of going through `custom_op`: custom_op's Python dispatch costs ~30 us a
call, measured here (pdserve::add_rms_norm at [4, 576]: 15 us unwrapped, 52 us through
custom_op, 21 us registered directly) and a CPU decode step makes ~6 such calls per layer.
The kernel is registered for every device (CompositeExplicitAutograd), so a CUDA tensor
reaches the launcher's own check and its clear error, not a missing-kernel one.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdserve.engine.cpu_kernels.build import KernelBuildError, build

# The dtype codes every kernel takes (0 = float32, 1 = bfloat16, the upper half of one).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

log = logging.getLogger(__name__)

_LIB = torch.library.Library("pdserve", "DEF")  # the ops' namespace, kept for the process
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: KernelBuildError | None = None


def load() -> ctypes.CDLL:
    """The compiled library; raises KernelBuildError when it cannot be built or loaded."""
    global _lib, _error
    if _lib is not None:  # every layer of every step comes here
        return _lib
    with _lock:
        if _lib is None and _error is None:
            try:
                lib = ctypes.CDLL(str(build()))
            except OSError as e:
                _error = KernelBuildError(f"could not load the CPU kernels: {e}")
            except KernelBuildError as e:
                _error = e
            else:
                _declare(lib)
                _lib = lib
        if _error is not None:
            raise _error
        return _lib


def op_or_none(module: str, name: str, what: str, instead: str) -> Callable[..., Any] | None:
    """The launcher `name` of `pdserve.engine.cpu_kernels.<module>` once the library loads;
    None, with a warning ("<what> is unavailable (why); <instead>"), when it cannot be
    imported, built or loaded. For callers with a Python fallback; they cache the answer,
    so each warns once."""
    try:
        op = getattr(importlib.import_module(f"pdserve.engine.cpu_kernels.{module}"), name)
        load()
    except (RuntimeError, ImportError, OSError) as e:  # no compiler, say
        # one line: a compiler's stderr can run to pages; its first line names the problem
        log.warning("%s is unavailable (%s); %s", what,
                    (str(e).splitlines() or [repr(e)])[0], instead)
        return None
    return op


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    # paged_decode.c
    lib.pd_validate.argtypes = [p, p, i64, i32, i32, i32, i64, ctypes.POINTER(i32),
                                ctypes.POINTER(i64)]
    lib.pd_validate.restype = i32
    lib.pd_splits.argtypes = [p, i32, i32]  # the tests' view of the split rule
    lib.pd_splits.restype = i32
    lib.pd_decode.argtypes = [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32,
                              i32, i32]
    lib.pd_decode.restype = i32
    # paged_prefill.c
    lib.pf_prefill.argtypes = [p, i64, p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, f32, i32,
                               i32, i32]
    lib.pf_prefill.restype = i32
    # layer_ops.c
    lib.lo_add_rms_norm.argtypes = [p, i64, p, p, p, i64, i32, f32, i32, i32]
    lib.lo_add_rms_norm.restype = None
    lib.lo_rope.argtypes = [p, i64, p, p, p, i64, i64, i32, i32, i32, i32]
    lib.lo_rope.restype = i64
    lib.lo_silu_mul.argtypes = [p, p, i64, i32, i32, i32]
    lib.lo_silu_mul.restype = None
    # gemv.c
    lib.gv_linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32, i32]
    lib.gv_linear.restype = i32
    # decode_stack.c
    lib.ds_decode_layers.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, p, p, i64, p, p,
                                     i64, i64, i32]
    lib.ds_decode_layers.restype = i32
    lib.ds_test_stall.argtypes = [i32, i32]
    lib.ds_test_stall.restype = None
    lib.ds_redone.argtypes = []
    lib.ds_redone.restype = ctypes.c_int64
    # q4_blocks.c
    lib.blocks_linear.argtypes = [p, p, i32, p, i64, i64, i64, i32, i32]
    lib.blocks_linear.restype = None
    lib.blocks_dequant.argtypes = [p, i32, i64, i64, p]
    lib.blocks_dequant.restype = None
    lib.blocks_fast.argtypes = [i32]
    lib.blocks_fast.restype = i32
    # crc_copy.c
    lib.cc_copy_crc32c.argtypes = [p, p, i64, ctypes.c_uint32, i32]
    lib.cc_copy_crc32c.restype = ctypes.c_uint32
    lib.cc_paths.argtypes = []
    lib.cc_paths.restype = i32
    # kv_ingest.c
    lib.ki_ingest_blocks.argtypes = [p, p, p, p, p, i64, i64, i32, ctypes.c_uint32]
    lib.ki_ingest_blocks.restype = ctypes.c_uint32
    # sampling_noise.c
    lib.sn_exponential_noise.argtypes = [p, i64, i64, p, i32]
    lib.sn_exponential_noise.restype = None
    lib.sn_exponential_race.argtypes = [p, p, i64, i64, p, i32]
    lib.sn_exponential_race.restype = None
    # sampling_filter.c
    lib.sf_filtered_race.argtypes = [p, i64, i64, p, p, p, p, p, p, p, p, i32]
    lib.sf_filtered_race.restype = i32
    lib.sf_work_per_thread.argtypes = [i64]
    lib.sf_work_per_thread.restype = i64
    # amx_linear.c
    lib.al_available.argtypes = []
    lib.al_available.restype = i32
    lib.al_pack.argtypes = [p, i64, i64, p]
    lib.al_pack.restype = None
    lib.al_linear.argtypes = [p, i64, i64, p, i64, i64, p, i32]
    lib.al_linear.restype = i32
    # f32_panels.c
    lib.fp_available.argtypes = []
    lib.fp_available.restype = i32
    lib.fp_pack.argtypes = [p, i64, i64, p]
    lib.fp_pack.restype = None
    lib.fp_linear.argtypes = [p, i64, i64, p, i64, i64, p, i32]
    lib.fp_linear.restype = i32
    # bf16_panels.c
    lib.bp_available.argtypes = []
    lib.bp_available.restype = i32
    lib.bp_pack.argtypes = [p, i64, i64, p]
    lib.bp_pack.restype = None
    lib.bp_linear.argtypes = [p, i64, i64, p, i64, i64, p, i32]
    lib.bp_linear.restype = i32
    # argmax.c
    lib.am_argmax_rows.argtypes = [p, i64, i64, i64, p, i32]
    lib.am_argmax_rows.restype = None
    # team_affinity.c
    lib.ta_pin_team.argtypes = [i32, i32, p, i32]
    lib.ta_pin_team.restype = i32


def typed_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable[[Callable], object]:
    """Decorator: register the typed launcher as `torch.ops.pdserve.<name>` and return that
    op (an OpOverload: called like the launcher, schema checked first)."""
    def register(fn: Callable) -> object:
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return getattr(torch.ops.pdserve, name).default
    return register


def register_fake(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the fake (metadata-only) implementation of `pdserve::<name>`."""
    return torch.library.register_fake(f"pdserve::{name}", lib=_LIB)


def require(**tensors: torch.Tensor | None) -> None:
    """ValueError naming the first argument that is None: a `Tensor` in an op's schema
    accepts None at the call (an undefined tensor), so each op checks its own."""
    for name, t in tensors.items():
        if t is None:
            raise ValueError(f"{name} must be a tensor, got None")
