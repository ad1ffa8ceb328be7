"""The planner's decisions (gateway/planner.py), driven with synthetic signals: a step change
in load moves exactly one worker, noise around a threshold moves none, and the limits
(dwell, last worker of a tier, switchable only, one switch in flight) hold."""

from __future__ import annotations

import pytest

from pdserve.gateway.planner import (
    Planner,
    PlannerConfig,
    PlannerMode,
    Signals,
    WindowedMean,
)
from pdserve.gateway.registry import Load, Role, Worker

CFG = PlannerConfig(mode=PlannerMode.QUEUE, queue_high=2.0, kv_high=0.8, low=0.5,
                    sustain_s=5.0, dwell_s=30.0, switch_timeout_s=90.0)


def _worker(wid: str, role: Role, queue: int = 0, free: int = 100, running: int = 0,
            switchable: bool = True) -> Worker:
    return Worker(wid, role, f"10.0.0.{wid[-1]}:1", "m", None,
                  Load(num_running=running, free_blocks=free, total_blocks=100,
                       queue_depth=queue), last_seen=0.0, switchable=switchable)


class Cluster:
    """Workers whose role follows the planner's switches after `drain_s`, as real ones do."""

    def __init__(self, roles: dict[str, Role], drain_s: float = 3.0) -> None:
        self.roles = dict(roles)
        self.drain_s = drain_s
        self.moving: dict[str, tuple[Role, float]] = {}

    def signals(self, now: float, queue: float, kv_used: float, **kw) -> Signals:
        for wid, (to, at) in list(self.moving.items()):
            if now >= at:
                self.roles[wid] = to
                del self.moving[wid]
        live = {r: [w for w, rr in self.roles.items() if rr is r and w not in self.moving]
                for r in Role}
        prefill = tuple(_worker(w, Role.PREFILL, queue=round(queue)) for w in live[Role.PREFILL])
        decode = tuple(_worker(w, Role.DECODE, free=round(100 * (1 - kv_used)), **kw)
                       for w in live[Role.DECODE])
        return Signals(now, prefill, decode)

    def run(self, planner: Planner, loads, start: float = 0.0) -> list[tuple[float, str, Role]]:
        """loads: (queue per prefill worker, decode KV usage) per second."""
        switches = []
        for i, (queue, kv) in enumerate(loads):
            now = start + i
            d = planner.observe(self.signals(now, queue, kv))
            if d.switch is not None:
                switches.append((now, d.switch.worker_id, d.switch.to))
                self.moving[d.switch.worker_id] = (d.switch.to, now + self.drain_s)
        return switches


def test_step_change_moves_exactly_one_worker_no_flap():
    cluster = Cluster({"w1": Role.PREFILL, "w2": Role.DECODE, "w3": Role.DECODE})
    planner = Planner(CFG)
    quiet = [(0, 0.2)] * 20
    burst = [(8, 0.2)] * 100  # prefill queues 4x the threshold, decode idle: for 100 s
    switches = cluster.run(planner, quiet + burst)
    # pressure from t=20, sustained 5 s: one switch at t=25, from decode to prefill
    assert len(switches) == 1
    t, wid, to = switches[0]
    assert (t, to) == (25, Role.PREFILL)
    assert wid in ("w2", "w3")
    assert cluster.roles == {"w1": Role.PREFILL, wid: Role.PREFILL,
                             ({"w2", "w3"} - {wid}).pop(): Role.DECODE}
    assert planner.num_switches == 1


def test_step_back_moves_one_back_after_dwell():
    cluster = Cluster({"w1": Role.PREFILL, "w2": Role.PREFILL, "w3": Role.DECODE})
    planner = Planner(CFG)
    # decode KV full, prefill idle: one prefill worker moves to decode; then prefill
    # pressure, decode idle: one moves back, but not before the dwell time
    loads = [(0, 0.95)] * 30 + [(8, 0.1)] * 60
    switches = cluster.run(planner, loads)
    assert [(t, to) for t, _, to in switches] == [(5, Role.DECODE), (38, Role.PREFILL)]


def test_noise_around_threshold_moves_nothing():
    cluster = Cluster({"w1": Role.PREFILL, "w2": Role.DECODE, "w3": Role.DECODE})
    planner = Planner(CFG)
    # queue per prefill worker around the threshold of 2 (pressure 0.5 .. 1.5), never
    # above it for 5 s in a row
    pattern = [1, 3, 3, 2, 2, 1, 3, 2, 3, 3, 1, 2, 3, 3, 3, 3, 1, 2]
    loads = [(pattern[i % len(pattern)], 0.2) for i in range(300)]
    assert cluster.run(planner, loads) == []
    # and the decode side: KV usage flickering across 0.8
    kv = [0.7, 0.85, 0.9, 0.75, 0.95, 0.82, 0.6, 0.9]
    assert cluster.run(planner, [(0, kv[i % len(kv)]) for i in range(300)], start=300) == []


def test_hysteresis_gap_both_tiers_busy_moves_nothing():
    cluster = Cluster({"w1": Role.PREFILL, "w2": Role.DECODE, "w3": Role.DECODE})
    planner = Planner(CFG)
    # prefill pressure 2, decode pressure 0.75: above `low`, so moving would starve decode
    assert cluster.run(planner, [(4, 0.6)] * 100) == []
    d = planner.observe(cluster.signals(100, 4, 0.6))
    assert d.desired == d.actual == {Role.PREFILL: 1, Role.DECODE: 2}
    assert d.pressure[Role.PREFILL] == pytest.approx(2.0)
    assert d.pressure[Role.DECODE] == pytest.approx(0.75)


def test_never_empties_a_tier():
    cluster = Cluster({"w1": Role.PREFILL, "w2": Role.DECODE})
    planner = Planner(CFG)
    assert cluster.run(planner, [(8, 0.0)] * 100) == []
    d = planner.observe(cluster.signals(100, 8, 0.0))
    # the planner still says what it wants, and never an empty tier
    assert d.desired == {Role.PREFILL: 2, Role.DECODE: 1}
    assert d.actual == {Role.PREFILL: 1, Role.DECODE: 1}


def test_min_prefill_zero_lets_the_last_prefill_worker_go():
    cfg = PlannerConfig(mode=PlannerMode.QUEUE, min_prefill=0, sustain_s=5.0, dwell_s=30.0)
    cluster = Cluster({"w1": Role.PREFILL, "w2": Role.DECODE})
    # decode KV full, prefill idle: the only prefill worker moves (colocated prefill after)
    switches = cluster.run(Planner(cfg), [(0, 0.95)] * 100)
    assert [(t, w, to) for t, w, to in switches] == [(5, "w1", Role.DECODE)]
    assert cluster.roles == {"w1": Role.DECODE, "w2": Role.DECODE}
    with pytest.raises(ValueError, match="min_decode"):
        PlannerConfig(min_decode=0)


def test_only_switchable_workers_move_least_loaded_first():
    planner = Planner(CFG)
    prefill = (_worker("w1", Role.PREFILL, queue=8),)
    decode = (_worker("w2", Role.DECODE, running=3), _worker("w3", Role.DECODE, running=1),
              _worker("w4", Role.DECODE, switchable=False))
    switch = None
    for t in range(10):
        d = planner.observe(Signals(float(t), prefill, decode))
        switch = switch or d.switch
    assert switch is not None and switch.worker_id == "w3" and switch.to is Role.PREFILL
    assert switch.address == "10.0.0.3:1"
    # the switch is in flight until w3 shows up as prefill: nothing more meanwhile
    assert planner.pending == switch
    draining = decode[:1] + decode[2:]
    for t in range(10, 96):
        assert planner.observe(Signals(float(t), prefill, draining)).switch is None
    # w3 never arrived: after switch_timeout_s (90 s) the planner moves on
    again = planner.observe(Signals(96.0, prefill, draining)).switch
    assert again is not None and again.worker_id == "w2"


def test_abandoned_switch_can_be_retried_after_dwell():
    planner = Planner(CFG)
    prefill = (_worker("w1", Role.PREFILL, queue=8),)
    decode = (_worker("w2", Role.DECODE), _worker("w3", Role.DECODE))
    times = []
    for t in range(80):
        d = planner.observe(Signals(float(t), prefill, decode))
        if d.switch is not None:
            times.append(t)
            planner.abandon()  # the RPC failed
    assert times == [5, 35, 65]


def test_slo_mode_counts_ttft_and_tpot():
    slo = PlannerConfig(mode=PlannerMode.SLO, ttft_slo_s=1.0, tpot_slo_s=0.1)
    queue_only = PlannerConfig(mode=PlannerMode.QUEUE, ttft_slo_s=1.0, tpot_slo_s=0.1)
    s = Signals(0.0, (_worker("w1", Role.PREFILL),), (_worker("w2", Role.DECODE, free=60),),
                ttft_s=3.0, tpot_s=0.05)
    assert Planner(slo).pressure(s) == {Role.PREFILL: 3.0, Role.DECODE: pytest.approx(0.5)}
    assert Planner(queue_only).pressure(s) == {Role.PREFILL: 0.0,
                                               Role.DECODE: pytest.approx(0.5)}


def test_ttft_behind_a_pressed_decode_tier_is_not_prefill_pressure():
    slo = Planner(PlannerConfig(mode=PlannerMode.SLO, ttft_slo_s=1.0, tpot_slo_s=0.1))
    decode = (_worker("d", Role.DECODE),)
    # decode pressed (TPOT 3x its SLO): TTFT counts for prefill only while a prompt waits
    # there (one call running on the one prefill worker is no wait; a second one is)
    for queue, prefill in ((0, 0.0), (1, 0.5), (2, 3.0)):
        s = Signals(0.0, (_worker("p", Role.PREFILL, queue=queue),), decode, ttft_s=3.0,
                    tpot_s=0.3)
        assert slo.pressure(s) == {Role.PREFILL: prefill, Role.DECODE: pytest.approx(3.0)}
    # decode not pressed: a long TTFT is the prefill tier's, queue or not
    s = Signals(0.0, (_worker("p", Role.PREFILL),), decode, ttft_s=3.0, tpot_s=0.05)
    assert slo.pressure(s)[Role.PREFILL] == 3.0
    # no prefill worker: decode workers prefill colocated, and TTFT is the prefill signal
    s = Signals(0.0, (), decode, ttft_s=3.0, tpot_s=0.3)
    assert slo.pressure(s)[Role.PREFILL] == 3.0


def test_config_rejects_a_band_without_gap():
    with pytest.raises(ValueError, match="low"):
        PlannerConfig(low=1.0)
    with pytest.raises(ValueError, match="ttft_slo_s"):
        PlannerConfig(ttft_slo_s=0)


def test_windowed_mean():
    m = WindowedMean(window_s=10)
    assert m.add(0, 0, 0.0) is None
    assert m.add(1, 2, 3.0) == 1.5
    assert m.add(5, 4, 4.0) == 1.0
    assert m.add(12, 4, 4.0) == pytest.approx(0.5)  # base is t=1 (the newest >= 10 s old)
    assert m.add(16, 4, 4.0) is None  # base t=5: nothing since
    assert m.add(17, 6, 10.0) == 3.0
