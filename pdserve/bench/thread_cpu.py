"""CPU time by thread, read from /proc: what each process, and each named thread of it,
spent between two readings (schedstat's nanoseconds; /proc/PID/stat counts 10 ms ticks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThreadCPU:
    pid: int
    tid: int
    name: str  # the kernel's name (comm)
    cpu_s: float


def threads_cpu(pid: int) -> list[ThreadCPU]:
    """Every live thread of `pid` with its CPU time so far; [] once the process is gone."""
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        out.append(ThreadCPU(pid, int(task.name), name, ns / 1e9))
    return out


def process_cpu_s(pid: int) -> float:
    """CPU time of every live thread of `pid`, in seconds."""
    return sum(t.cpu_s for t in threads_cpu(pid))


def cpu_between(before: list[ThreadCPU], after: list[ThreadCPU]) -> list[ThreadCPU]:
    """Each thread's CPU seconds from `before` to `after` (a thread started meanwhile counts
    from zero; one that ended is missing: its time is lost)."""
    start = {(t.pid, t.tid): t.cpu_s for t in before}
    return [ThreadCPU(t.pid, t.tid, t.name, t.cpu_s - start.get((t.pid, t.tid), 0.0))
            for t in after]
