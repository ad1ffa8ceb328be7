"""The planner: how many workers each tier should have, and which worker to move.

Every `interval` the gateway's driver (server.py) hands `Planner.observe` one `Signals`
snapshot — the live workers of each tier with their heartbeat load, and the gateway's own
recent TTFT and TPOT (of the requests that finished recently and of the long-enough
streams still open: `decode_tpot`) — and gets a `Decision`
back: the desired worker count per tier and at most one `Switch` to order
(WorkerControl.SwitchRole). The rules:

  pressure   prefill: queued prefill requests per prefill worker / `queue_high`, and in
             `slo` mode also recent TTFT / the TTFT SLO, unless the decode tier is pressed
             and no prompt waits at the prefill tier (the larger counts);
             decode:  KV-cache usage / `kv_high`, and in `slo` mode also TPOT / TPOT SLO.
  move       a worker to tier X when X's pressure >= 1 while the other tier's is <= `low`
             (the gap between 1 and `low` is the hysteresis band: a move never makes the
             source tier the one that needs a worker back), and that has held for
             `sustain_s` without a break (noise around a threshold never sustains);
  desired    while a move is due, the short tier one worker more and the other one less
             (never below its minimum; a hint for autoscalers), else the actual counts;
  limits     one switch in flight at a time (until the worker re-registers in its new role
             or `switch_timeout_s` passes), at least `dwell_s` between switches, never a
             tier below its minimum — one worker each by default; `min_prefill=0` lets the
             last prefill worker go, since decode workers then prefill colocated — and only
             workers that registered as switchable, the least loaded of them.

Pure bookkeeping: no I/O, time comes in with the signals.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.gateway.registry import Role, Worker


class PlannerMode(enum.Enum):
    OFF = "off"
    QUEUE = "queue"  # prefill queue depth and decode KV usage only
    SLO = "slo"  # and TTFT / TPOT against their SLOs


@dataclass(frozen=True)
class PlannerConfig:
    mode: PlannerMode = PlannerMode.OFF
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    queue_high: float = 2.0  # queued prefill requests per prefill worker that is pressure 1
    kv_high: float = 0.8  # decode KV usage that is pressure 1
    low: float = 0.5  # the other tier's pressure at most this for a move
    sustain_s: float = 5.0  # pressure held this long, unbroken, before a move
    dwell_s: float = 30.0  # at least this long between two switches
    switch_timeout_s: float = 90.0  # a switch not seen done by then is given up on
    interval_s: float = 1.0  # the driver observes this often
    window_s: float = 10.0  # TTFT / TPOT are averaged over this much recent time
    min_prefill: int = 1  # 0: all may leave (decode workers then prefill colocated)
    min_decode: int = 1

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s", "queue_high", "kv_high", "interval_s",
                     "window_s", "switch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.low < 1:
            raise ValueError("low must be in [0, 1): the gap below pressure 1 is the "
                             "hysteresis band")
        for name in ("sustain_s", "dwell_s", "min_prefill"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.min_decode < 1:
            raise ValueError("min_decode must be >= 1: nothing is served without decode")

    def minimum(self, role: Role) -> int:
        return self.min_prefill if role is Role.PREFILL else self.min_decode


@dataclass(frozen=True)
class Signals:
    now: float
    prefill: tuple[Worker, ...]  # live workers per tier (registry.alive)
    decode: tuple[Worker, ...]
    ttft_s: float | None = None  # mean over the recent window; None: no requests
    # mean TPOT, (last token - first token) / (tokens - 1) (the SLO's and /metrics'
    # definition), of the requests finished in the window and of the streams open with at
    # least LIVE_TPOT_TOKENS tokens, so far; None: neither
    tpot_s: float | None = None


@dataclass(frozen=True)
class Switch:
    worker_id: str
    address: str
    to: Role
    reason: str


@dataclass(frozen=True)
class Decision:
    desired: dict[Role, int]
    actual: dict[Role, int]
    pressure: dict[Role, float]
    switch: Switch | None = None


def _other(role: Role) -> Role:
    return Role.DECODE if role is Role.PREFILL else Role.PREFILL


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._want: Role | None = None  # tier short of a worker, as of `_since`
        self._since = 0.0
        self._last_switch = -float("inf")
        self.pending: Switch | None = None  # ordered, not yet seen done
        self._pending_at = 0.0
        self.num_switches = 0

    def pressure(self, s: Signals) -> dict[Role, float]:
        c = self.config
        queued = sum(w.load.queue_depth for w in s.prefill)
        p = queued / max(1, len(s.prefill)) / c.queue_high
        total = sum(w.load.total_blocks for w in s.decode)
        used = total - sum(w.load.free_blocks for w in s.decode)
        d = (used / total if total else 0.0) / c.kv_high
        if c.mode is PlannerMode.SLO:
            if s.tpot_s is not None:
                d = max(d, s.tpot_s / c.tpot_slo_s)
            # behind an overloaded decode tier TTFT stretches too (the reservation, the KV
            # ingest and the first step wait on its batch): with the decode tier pressed
            # and no prompt waiting at the prefill tier (no more calls in flight than
            # workers to run them), TTFT is not the prefill tier's to fix. Read as prefill
            # pressure, it held the move to decode back past the end of the elastic
            # bench's long-output phase (docs/benchmarks.md section 7)
            decode_bound = d >= 1.0 and s.prefill and queued <= len(s.prefill)
            if s.ttft_s is not None and not decode_bound:
                p = max(p, s.ttft_s / c.ttft_slo_s)
        return {Role.PREFILL: p, Role.DECODE: d}

    def observe(self, s: Signals) -> Decision:
        c = self.config
        actual = {Role.PREFILL: len(s.prefill), Role.DECODE: len(s.decode)}
        pressure = self.pressure(s)
        self._settle(s)
        want = next((r for r in (Role.PREFILL, Role.DECODE)
                     if pressure[r] >= 1.0 and pressure[_other(r)] <= c.low), None)
        if want is not self._want:
            self._want, self._since = want, s.now
        desired = dict(actual)
        if want is None or s.now - self._since < c.sustain_s:
            return Decision(desired, actual, pressure)
        source = _other(want)
        desired[want] += 1
        desired[source] = max(c.minimum(source), desired[source] - 1)
        if (c.mode is PlannerMode.OFF or self.pending is not None
                or s.now - self._last_switch < c.dwell_s
                or actual[source] <= c.minimum(source)):
            return Decision(desired, actual, pressure)
        candidates = [w for w in (s.prefill if source is Role.PREFILL else s.decode)
                      if w.switchable and not w.static]
        if not candidates:
            return Decision(desired, actual, pressure)
        w = min(candidates, key=lambda w: (w.load.num_running + w.load.num_waiting
                                           + w.load.queue_depth, w.worker_id))
        reason = (f"{want.value} pressure {pressure[want]:.2f} >= 1 and {source.value} "
                  f"pressure {pressure[source]:.2f} <= {c.low:g} for {s.now - self._since:.0f}s")
        switch = Switch(w.worker_id, w.address, want, reason)
        self.pending, self._pending_at = switch, s.now
        self._last_switch = s.now
        self.num_switches += 1
        return Decision(desired, actual, pressure, switch)

    def _settle(self, s: Signals) -> None:
        """Clear the switch in flight once its worker is live in the new role (or the
        switch timed out); the dwell time counts from that moment."""
        p = self.pending
        if p is None:
            return
        arrived = s.prefill if p.to is Role.PREFILL else s.decode
        if any(w.worker_id == p.worker_id for w in arrived):
            self.pending, self._last_switch = None, s.now
        elif s.now - self._pending_at > self.config.switch_timeout_s:
            self.pending = None

    def abandon(self) -> None:
        """The switch just decided could not be ordered (the RPC failed)."""
        self.pending = None


class WindowedMean:
    """The mean of a cumulative (count, sum) pair — a Prometheus histogram's — over the
    last `window_s`, from snapshots taken as time goes by."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._snaps: deque[tuple[float, float, float]] = deque()

    def add(self, now: float, count: float, total: float) -> float | None:
        """Record a snapshot; the mean over the window ending now, None without samples."""
        n, t = self.totals(now, count, total)
        return t / n if n > 0 else None

    def totals(self, now: float, count: float, total: float) -> tuple[float, float]:
        """Record a snapshot; (count, sum) of the samples in the window ending now."""
        self._snaps.append((now, count, total))
        while len(self._snaps) > 1 and now - self._snaps[1][0] >= self.window_s:
            self._snaps.popleft()
        _, c0, s0 = self._snaps[0]
        return count - c0, total - s0


# a stream counts toward the decode signal from this many tokens: its first gap (KV
# transfer, admission: up to ~0.5 s here) then weighs at most 1/31 of its TPOT so far
LIVE_TPOT_TOKENS = 32


def decode_tpot(finished: tuple[float, float], streaming: Iterable[float]) -> float | None:
    """The decode tier's TPOT signal: the mean over the requests that finished in the
    window (`finished`: their count and TPOT sum) and the ones still streaming (their
    TPOT so far); None with neither."""
    n, total = finished
    for t in streaming:
        n, total = n + 1, total + t
    return total / n if n > 0 else None
