"""Every garbage collection a process makes, timed: put this folder on PYTHONPATH as
`sitecustomize.py` (PYTHONPATH=DIR pdserve up ...), and at exit each process writes
gc.PID.txt beside this file: collections and time per generation, and each generation-2
collection's time of day. Session 35: the same counts with two and three 1,500-token
streams, so none while serving."""

import atexit
import gc
import os
import sys
import time

_started = [0.0]
_stats = {g: [0, 0.0, 0.0] for g in (0, 1, 2)}
_full: list[tuple[float, float, int]] = []


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _started[0]
    s = _stats[info["generation"]]
    s[0] += 1
    s[1] += took
    s[2] = max(s[2], took)
    if info["generation"] == 2:
        _full.append((time.time(), took, info.get("collected", 0)))


def _write() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, f"gc.{os.getpid()}.txt"), "w") as f:
        f.write(" ".join(sys.argv[:3]) + f"\nobjects {len(gc.get_objects())}\n")
        for g, (n, total, most) in _stats.items():
            f.write(f"gen{g} n={n} total={total * 1e3:.1f}ms max={most * 1e3:.2f}ms\n")
        for at, took, collected in _full:
            f.write(f"gen2 at {time.strftime('%H:%M:%S', time.localtime(at))} "
                    f"{took * 1e3:.1f}ms collected {collected}\n")


gc.callbacks.append(_timed)
atexit.register(_write)
