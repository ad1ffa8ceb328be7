"""Keeps the C allocator from handing message-sized buffers back to the kernel after
each KV chunk.

Every chunk crosses the process in freshly allocated multi-MiB buffers: the sender's
serialized message and gRPC's copy of it; the receiver's gRPC read buffers and the
`bytes` gRPC hands the deserializer. With glibc's defaults the top of the heap is trimmed
once more than 2x the largest recent allocation is free (and non-main arenas are shrunk
with madvise), so the next chunk's buffer is new memory again: one page fault and one
zeroed page per 4 KiB. Profiled on the 2-core dev machine (1 MiB chunks, loopback), that
was ~35 % of the receiver's CPU and ~15 % of the sender's (docs/benchmarks.md, section 2).

`keep_freed_memory()` raises glibc's trim threshold so freed chunks stay mapped for
reuse, and pins the mmap threshold above any chunk size so buffers come from the heap
rather than from a fresh mmap each. Setting either disables glibc's dynamic thresholds,
which is why both are set. The cost is bounded: at most `TRIM_THRESHOLD_BYTES` of free
memory stays resident per arena. It is process-wide, idempotent, and a no-op where the C
library is not glibc; the transfer endpoints (`GrpcKVTransport`, `KVTransferService`) call
it when they are created.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

# mallopt parameter numbers, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Larger than any chunk message (max_chunk_bytes defaults to 1 MiB; 4-16 MiB is the sane
# range) plus its header; glibc caps M_MMAP_THRESHOLD at 32 MiB on 64-bit.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet


def keep_freed_memory() -> bool:
    """Applies the thresholds once per process; True if they are in force."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it (musl has mallopt stubs)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        log.warning("mallopt refused the KV-transfer allocator thresholds")
    return ok
