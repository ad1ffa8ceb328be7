"""The Python side of team_affinity.c: `pin_team`, which puts the calling thread on one core
and the OpenMP team it opens (its kernels' and torch's) on the others."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from pdserve.engine.cpu_kernels.library import load


def pin_team(cores: Sequence[int]) -> int:
    """Pin the calling thread to cores[0] and the other threads of its team of len(cores)
    to cores[1:]; returns the team's size. Raises OSError where a thread could not be pinned
    (the whole team is then left on all of `cores`), ValueError for fewer than two distinct
    cores."""
    if len(cores) < 2 or len(set(cores)) != len(cores) or min(cores) < 0:
        raise ValueError(f"cores: need two or more distinct cores, got {list(cores)}")
    lib = load()
    rest = (ctypes.c_int * (len(cores) - 1))(*cores[1:])
    size = lib.ta_pin_team(len(cores), cores[0], rest, len(rest))
    if size < 0:
        every = (ctypes.c_int * len(cores))(*cores)
        lib.ta_pin_team(len(cores), -1, every, len(every))
        raise OSError(f"could not pin the engine's threads to cores {list(cores)}")
    return size
