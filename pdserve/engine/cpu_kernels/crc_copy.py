"""The Python side of crc_copy.c as a typed torch op: `pdserve::copy_crc32c` copies a
tensor's bytes into a byte tensor and returns their CRC-32C, continued from a running one —
the shared-memory sender's copy of each chunk part into the segment
(`pdserve.kvtransfer.wire.encode_layer_descriptors`). Its reference is a plain copy and the
`crc32c` package's `crc32c(data, value)`.

`path` picks the C implementation: "auto" (the fastest compiled in), or one of
`compiled_paths()` by name, so the tests run each one this build has (the receiver's
`pdserve::ingest_kv_blocks` takes the same argument).
"""

from __future__ import annotations

import functools

import torch

from pdserve.engine.cpu_kernels.library import load, register_fake, require, typed_op

# crc_copy.h's CC_* numbers
PATHS = {"auto": 0, "portable": 1, "sse42": 2, "vpclmul": 3}


@functools.cache
def compiled_paths() -> tuple[str, ...]:
    """The implementations this build has, slowest first ("portable" always)."""
    mask = int(load().cc_paths())
    return tuple(name for name, code in PATHS.items() if code and mask >> code & 1)


def _check(dst: torch.Tensor, src: torch.Tensor, crc: int, path: str) -> None:
    require(dst=dst, src=src)
    for name, t in (("dst", dst), ("src", src)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, got shape "
                             f"{tuple(t.shape)} strides {t.stride()} on {t.device}")
    nbytes = src.numel() * src.element_size()
    if dst.dtype != torch.uint8 or dst.numel() != nbytes:
        raise ValueError(f"dst must be uint8 of src's {nbytes} bytes, got {dst.numel()} "
                         f"{dst.dtype}")
    if not 0 <= crc < 1 << 32:
        raise ValueError(f"crc must be a CRC-32C in [0, 2**32), got {crc}")
    check_path(path)


def check_path(path: str) -> None:
    """ValueError unless path names an implementation (compiled in or not)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}")


def path_code(path: str) -> int:
    """crc_copy.h's number for path; ValueError naming it when this build lacks it."""
    check_path(path)
    if path != "auto" and path not in compiled_paths():
        raise ValueError(f"path {path!r} is not compiled in (this build has "
                         f"{', '.join(compiled_paths())})")
    return PATHS[path]


@typed_op("copy_crc32c", mutates_args=("dst",))
def copy_crc32c(dst: torch.Tensor, src: torch.Tensor, crc: int = 0, path: str = "auto") -> int:
    """dst[:] = src's bytes; returns the CRC-32C of those bytes continued from `crc` (the
    CRC-32C of whatever precedes them, 0 for nothing before).

    dst: uint8, contiguous, exactly src's byte size, not overlapping src; src: any dtype,
    contiguous; both on the CPU. path: "auto" or a name in `compiled_paths()`.
    """
    _check(dst, src, crc, path)
    return int(load().cc_copy_crc32c(dst.data_ptr(), src.data_ptr(), dst.numel(), crc,
                                     path_code(path)))


@register_fake("copy_crc32c")
def _(dst, src, crc=0, path="auto"):
    _check(dst, src, crc, path)
    return 0
