"""The kernel's name of a thread (what `top -H`, `ps -L` and /proc/PID/task/TID/comm show).

Python's thread names stay inside the interpreter; the kernel's is the process's for every
thread. The engine thread names itself so that operators and `bench.served_overhead` can
tell its CPU from the event loop's: threads it starts afterwards (OpenMP's team for its
kernels) inherit the name.
"""

from __future__ import annotations

import ctypes

# the engine thread's (pdserve.engine.async_engine); OpenMP's team for its kernels, started
# by it, inherits the name
ENGINE_THREAD_NAME = "pdserve-engine"

_PR_SET_NAME = 15
_MAX = 15  # the kernel keeps 15 bytes and a NUL


def name_this_thread(name: str) -> bool:
    """Set the calling thread's kernel name (cut to 15 bytes); False where it cannot be."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return False
    return prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_MAX]), 0, 0, 0) == 0
