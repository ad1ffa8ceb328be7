"""What the peers run reads about the host from /proc: foreign CPU load (the guard that waits
for a quiet machine before each system), a process tree, and its peak resident memory.

Foreign CPU is every core's busy time minus this process's own, as a percentage of all
usable cores, over one-second samples. The guard waits until `QUIET_SAMPLES` samples in a
row are at or below the bound, or its timeout passes; either way it returns what it saw, so
a result measured on a busy machine says so.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

QUIET_SAMPLES = 3
_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_times() -> tuple[float, float]:
    """(busy, total) seconds over all cores since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return (total - idle) / _TICKS, total / _TICKS


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def foreign_cpu_pct(interval_s: float = 1.0) -> float:
    """Busy CPU not spent by this process (or its reaped children), % of all cores."""
    busy0, total0 = _cpu_times()
    own0 = _own_cpu()
    time.sleep(interval_s)
    busy1, total1 = _cpu_times()
    own1 = _own_cpu()
    span = total1 - total0
    if span <= 0:
        return 0.0
    return max(0.0, 100.0 * ((busy1 - busy0) - (own1 - own0)) / span)


@dataclass(frozen=True)
class GuardResult:
    quiet: bool  # the bound held for QUIET_SAMPLES samples in a row
    waited_s: float
    foreign_cpu_pct: float  # the last sample
    loadavg: tuple[float, float, float]  # at the end of the wait

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def wait_quiet(bound_pct: float, timeout_s: float, log=None) -> GuardResult:
    """Wait (at most `timeout_s`) until foreign CPU <= `bound_pct` for QUIET_SAMPLES s."""
    t0 = time.monotonic()
    in_row, last, last_log = 0, 0.0, t0
    while True:
        last = foreign_cpu_pct()
        in_row = in_row + 1 if last <= bound_pct else 0
        waited = time.monotonic() - t0
        if in_row >= QUIET_SAMPLES or waited >= timeout_s:
            return GuardResult(in_row >= QUIET_SAMPLES, round(waited, 1), round(last, 1),
                               os.getloadavg())
        if log is not None and time.monotonic() - last_log >= 10:
            log(f"CPU guard: foreign CPU {last:.0f}% > {bound_pct:g}% "
                f"({waited:.0f}/{timeout_s:.0f}s)")
            last_log = time.monotonic()


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it, from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue  # gone between listing and reading
    return total


class PeakRSS:
    """Samples the summed RSS of a process tree twice a second on a daemon thread; `peak`
    is the largest sum seen until `stop`."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, rss_bytes(descendants(self.pid)))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
