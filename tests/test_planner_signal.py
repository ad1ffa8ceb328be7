"""The planner's TPOT signal through a real gateway and decode worker (tiny random-weight
model, 127.0.0.1): it is the SLO's TPOT — a request's (last token - first token) /
(tokens - 1), the gateway's `pdserve:request_time_per_output_token_seconds` once it has
finished — averaged over the requests that finished in the window and those still
streaming with at least `LIVE_TPOT_TOKENS` tokens, so

- a young stream whose first gap is long (KV transfer, admission) does not read as high
  TPOT while its later tokens are still coming, and
- a stream that has been slow for `LIVE_TPOT_TOKENS` tokens presses the decode tier before
  it finishes (finished requests alone showed a slowdown a whole output later).

The gaps are made on the engine thread itself: a step listener holds or slows the steps
that produce the request's tokens, so the gateway sees them whatever the machine's speed."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from test_gateway_support import Cluster

from pdserve.client import PdserveClient
from pdserve.gateway.planner import LIVE_TPOT_TOKENS, PlannerConfig, PlannerMode

TPOT_SLO_S = 0.05
FIRST_GAP_S = 0.6  # the held step: 12x the SLO, so 6 gaps with it average above the SLO
HOLD_AT = 8  # the 8th token's step is held too: 7 tokens (6 gaps) seen, request unfinished
MAX_TOKENS = 32
TICK_S = 0.05


class Gate:
    """Holds the engine thread (a step listener) once the request has `at` tokens, until
    released: what the step made reaches the gateway only after the release."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reached = threading.Event()
        self.release = threading.Event()


class Holds:
    def __init__(self, *gates: Gate) -> None:
        self.gates = list(gates)
        self.tokens = 0

    def __call__(self, deltas) -> None:  # on the engine thread
        self.tokens += sum(len(d.new_token_ids) for d in deltas)
        while self.gates and self.tokens >= self.gates[0].at:
            g = self.gates.pop(0)
            g.reached.set()
            assert g.release.wait(60), "the test never released the engine"


def _metrics(c: Cluster) -> dict[str, float]:
    with urllib.request.urlopen(c.gateway.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            role = s.labels.get("role")
            out[s.name + (f"[{role}]" if role else "")] = s.value
    return out


async def _generate(address: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    async with PdserveClient(address) as client:
        ids: list[int] = []
        async for ch in client.generate(token_ids=list(range(100, 140)), max_tokens=max_tokens,
                                        temperature=0, ignore_eos=True, timeout=60):
            ids.extend(ch.token_ids)
        return ids


def test_long_first_gap_does_not_read_as_high_tpot(tiny_model_dir):
    # decode pressure is TPOT / SLO alone: KV usage never counts at this kv_high, and
    # nothing moves (no sustain is that long)
    planner = PlannerConfig(mode=PlannerMode.SLO, ttft_slo_s=1e3, tpot_slo_s=TPOT_SLO_S,
                            kv_high=1e9, sustain_s=1e6, interval_s=TICK_S, window_s=600)
    c = Cluster(tiny_model_dir, planner=planner, heartbeat_timeout_s=10)
    first_gap, later = Gate(2), Gate(HOLD_AT)
    try:
        d = c.add_worker("decode")  # no prefill worker: the request runs colocated on it
        d.aengine.step_listeners.append(Holds(first_gap, later))
        c.wait_for(lambda: "pdserve:planner_pressure[decode]" in _metrics(c))
        request = asyncio.run_coroutine_threadsafe(_generate(c.gateway.grpc_address),
                                                   c.lt.loop)
        assert first_gap.reached.wait(30)
        time.sleep(FIRST_GAP_S)
        first_gap.release.set()
        assert later.reached.wait(30)
        # tokens 1..7 are at the gateway: 6 gaps, the first of them the long one
        itl = "pdserve:inter_token_latency_seconds"
        c.wait_for(lambda: _metrics(c)[itl + "_count"] == HOLD_AT - 2)
        time.sleep(10 * TICK_S)  # the planner ticks with the stream still open
        m = _metrics(c)
        # the streamed gaps' mean is over the SLO (what the signal used to be) ...
        assert m[itl + "_sum"] / m[itl + "_count"] >= TPOT_SLO_S
        # ... but no request has finished, so no TPOT is known and decode is not pressed
        assert m["pdserve:request_time_per_output_token_seconds_count"] == 0
        assert m["pdserve:planner_pressure[decode]"] < 1.0, m
        later.release.set()
        assert len(request.result(60)) == MAX_TOKENS

        # once it finished, the signal is that request's own TPOT, as /metrics has it
        tpot = "pdserve:request_time_per_output_token_seconds"
        c.wait_for(lambda: _metrics(c)["pdserve:planner_pressure[decode]"] > 1e-6)
        m = _metrics(c)
        assert m[tpot + "_count"] == 1
        expected = m[tpot + "_sum"] / TPOT_SLO_S
        assert abs(m["pdserve:planner_pressure[decode]"] - expected) <= 1e-6 * expected, m
        assert c.gateway.planner.num_switches == 0
        c.assert_no_leaks()
    finally:
        first_gap.release.set()
        later.release.set()
        c.close()


class SlowSteps(Holds):
    """Holds like `Holds`, and makes every step take at least `step_s` beforehand."""

    def __init__(self, step_s: float, *gates: Gate) -> None:
        super().__init__(*gates)
        self.step_s = step_s

    def __call__(self, deltas) -> None:  # on the engine thread
        time.sleep(self.step_s)
        super().__call__(deltas)


def test_a_slow_stream_presses_decode_before_it_finishes(tiny_model_dir):
    planner = PlannerConfig(mode=PlannerMode.SLO, ttft_slo_s=1e3, tpot_slo_s=TPOT_SLO_S,
                            kv_high=1e9, sustain_s=1e6, interval_s=TICK_S, window_s=600)
    c = Cluster(tiny_model_dir, planner=planner, heartbeat_timeout_s=10)
    seen = LIVE_TPOT_TOKENS + 2
    hold = Gate(seen + 1)  # held with `seen` tokens at the gateway and the request open
    try:
        d = c.add_worker("decode")
        d.aengine.step_listeners.append(SlowSteps(2 * TPOT_SLO_S, hold))
        c.wait_for(lambda: "pdserve:planner_pressure[decode]" in _metrics(c))
        request = asyncio.run_coroutine_threadsafe(
            _generate(c.gateway.grpc_address, max_tokens=seen + 8), c.lt.loop)
        assert hold.reached.wait(60)
        itl = "pdserve:inter_token_latency_seconds"
        c.wait_for(lambda: _metrics(c)[itl + "_count"] >= seen - 1)
        time.sleep(10 * TICK_S)
        m = _metrics(c)
        # nothing has finished, and every gap was twice the SLO: decode is pressed by the
        # open stream's own TPOT so far
        assert m["pdserve:request_time_per_output_token_seconds_count"] == 0
        assert m["pdserve:planner_pressure[decode]"] >= 1.5, m
        hold.release.set()
        assert len(request.result(60)) == seen + 8
        assert c.gateway.planner.num_switches == 0
        c.assert_no_leaks()
    finally:
        hold.release.set()
        c.close()
