"""Pinning an engine thread's OpenMP team (cpu_kernels/team_affinity.c): the calling thread
on the first core, its team's other threads on the rest, and those same threads in every
later region it opens, its kernels' and torch's; refusals leave the team on all its cores."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve.engine.cpu_kernels.team_affinity import pin_team

CORES = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")


def _threads() -> dict[int, set[int]]:
    """This process's threads and the cores each may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # it ended meanwhile
            pass
    return out


def _in_thread(fn):
    """fn() on a thread of its own (its OpenMP team dies with it): (result, error)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)
    return box.get("result"), box.get("error")


@needs_two
def test_the_caller_takes_the_first_core_and_its_team_the_rest():
    # as many cores as torch's threads, as a worker's engine has
    cores = CORES[:torch.get_num_threads()]
    if len(cores) < 2:
        pytest.skip("torch runs one thread here")
    before = set(_threads())

    def pin_then_compute():
        size = pin_team(cores)
        mine = os.sched_getaffinity(0)
        x = torch.randn(512, 512)
        y = x @ x  # a region of torch's after the pin: its other threads are the pinned ones
        team = {tid: c for tid, c in _threads().items()
                if tid not in before and tid != threading.get_native_id()}
        return size, mine, team, y.shape

    (size, mine, team, shape), error = _in_thread(pin_then_compute)
    assert error is None, error
    assert size == len(cores) and shape == (512, 512)
    assert mine == {cores[0]}
    assert len(team) == len(cores) - 1 and all(c == set(cores[1:]) for c in team.values()), team


def test_bad_core_lists_are_refused():
    with pytest.raises(ValueError, match="two or more distinct"):
        pin_team([CORES[0]])
    with pytest.raises(ValueError, match="two or more distinct"):
        pin_team([CORES[0], CORES[0]])
    with pytest.raises(ValueError, match="two or more distinct"):
        pin_team([CORES[0], -1])


def test_a_core_it_may_not_use_fails_and_leaves_the_team_on_the_others():
    outside = max(CORES) + 4096  # beyond any cpu_set_t: never allowed

    def pin():
        try:
            pin_team([CORES[0], outside])
        except OSError as e:
            return e, os.sched_getaffinity(0)
        return None, os.sched_getaffinity(0)

    (error, mine), unexpected = _in_thread(pin)
    assert unexpected is None, unexpected
    assert isinstance(error, OSError) and "could not pin" in str(error)
    assert mine == {CORES[0]}  # all of the cores asked that it may use


def test_a_worker_pins_only_a_cpu_engine_with_a_thread_per_core(caplog):
    from pdserve.engine.config import EngineConfig
    from pdserve.worker_runtime import pin_cores

    n = len(CORES)
    with caplog.at_level("WARNING", logger="pdserve.worker"):
        assert pin_cores(EngineConfig(model="m", device="cuda")) is None
        assert pin_cores(EngineConfig(model="m", num_threads=n + 1)) is None
    assert "not on the CPU" in caplog.text
    assert f"{n + 1} engine thread(s) on {n} cores" in caplog.text
    if n >= 2:
        assert pin_cores(EngineConfig(model="m", num_threads=n)) == tuple(CORES)
    else:
        assert pin_cores(EngineConfig(model="m", num_threads=1)) is None
        assert "1 core(s)" in caplog.text
