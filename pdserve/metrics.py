"""Prometheus metrics for every tier, named like vLLM's (prefix `pdserve:`) so existing
dashboards and alerts carry over. Each process builds one `TierMetrics` on its own
registry; the labels say the model, the tier (gateway / prefill / decode) and the worker.

Token-level timings (TTFT, inter-token latency, TPOT, e2e) are recorded where the request
is observed end to end: the gateway for disaggregated traffic, the decode worker for what it
streams itself. Gauges are refreshed from engine stats by the owning service.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 34, 2))

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model_name", "tier", "worker")
MIGRATION_REASONS = ("prefill_failover", "decode_migration")


class TierMetrics:
    """Every pdserve metric, bound to one (model, tier, worker)."""

    def __init__(self, model: str, tier: str, worker: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"model_name": model, "tier": tier, "worker": worker}
        r, lb = self.registry, LABELS

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"pdserve:{name}", doc, lb, registry=r,
                             buckets=buckets).labels(**self.labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve:{name}", doc, lb, registry=r).labels(**self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pdserve:{name}", doc, lb, registry=r).labels(**self.labels)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between streamed tokens.",
                        _TOKEN_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.",
                         _TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue_time = hist("request_queue_time_seconds", "Time spent queued.")
        self.prefill_time = hist("request_prefill_time_seconds", "Time spent in prefill.")
        self.decode_time = hist("request_decode_time_seconds", "Time spent in decode.")
        self.kv_transfer_seconds = hist("kv_transfer_seconds",
                                        "KV transfer time not overlapped by prefill compute.")
        self.kv_transfer_bytes = hist("kv_transfer_bytes", "Bytes of KV moved per request.",
                                      _BYTES_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted.")
        self.engine_steps = counter("engine_steps", "Engine steps taken.")
        self.engine_step_seconds = counter(
            "engine_step_seconds", "Wall time of engine steps (schedule to bookkeeping).")
        self.engine_forward_seconds = counter(
            "engine_forward_seconds", "Wall time of the model forwards within engine steps.")
        self.kv_transfer_failures = counter("kv_transfer_failures", "KV transfers that failed.")
        self.kv_received_bytes = counter("kv_received_bytes",
                                         "KV payload bytes received from prefill workers.")
        self.reservations_expired = counter("kv_reservations_expired",
                                            "Reservations freed because KV never committed.")
        self._success = Counter("pdserve:request_success", "Requests finished, by reason.",
                                (*lb, "finished_reason"), registry=r)
        self._mirrored: dict[int, float] = {}  # id(counter) -> total set by set_counter_to
        self._errors = Counter("pdserve:request_errors", "Requests failed, by status code.",
                               (*lb, "code"), registry=r)
        self._migrations = Counter("pdserve:request_migrations",
                                   "Requests moved to another worker after a failure, by "
                                   "move: prefill_failover (another prefill worker, or "
                                   "colocated), decode_migration (a broken token stream "
                                   "re-admitted elsewhere).", (*lb, "reason"), registry=r)
        for reason in MIGRATION_REASONS:  # exposed at 0 before the first move
            self._migrations.labels(**self.labels, reason=reason)

    def success(self, finished_reason: str) -> None:
        self._success.labels(**self.labels, finished_reason=finished_reason).inc()

    def error(self, code: str) -> None:
        self._errors.labels(**self.labels, code=code).inc()

    def migrated(self, reason: str) -> None:
        assert reason in MIGRATION_REASONS, reason
        self._migrations.labels(**self.labels, reason=reason).inc()

    def set_counter_to(self, counter: Counter, value: float) -> None:
        """Move a counter up to an absolute total read from engine stats (never down). The
        total mirrored last is remembered here: a counter fed this way has no other feed."""
        current = self._mirrored.get(id(counter), 0.0)
        if value > current:
            counter.inc(value - current)
            self._mirrored[id(counter)] = value

    def observe_engine(self, s) -> None:
        """Mirror an `pdserve.engine.async_engine.EngineStats` snapshot into gauges and counters."""
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_usage.set(1.0 - s.free_blocks / s.total_blocks)
        self.set_counter_to(self.prompt_tokens, s.prompt_tokens)
        self.set_counter_to(self.generation_tokens, s.generation_tokens)
        self.set_counter_to(self.prefix_queries, s.prefix_queries)
        self.set_counter_to(self.prefix_hits, s.prefix_hits)
        self.set_counter_to(self.preemptions, s.preemptions)
        self.set_counter_to(self.engine_steps, s.steps)
        self.set_counter_to(self.engine_step_seconds, s.step_seconds)
        self.set_counter_to(self.engine_forward_seconds, s.forward_seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class TokenTimer:
    """One streamed request's token timings: TTFT and inter-token latency observed as
    tokens arrive, TPOT (first token to last, per token after the first) at the end."""

    def __init__(self, metrics: TierMetrics, start: float) -> None:
        self.m = metrics
        self.start = start  # time.monotonic() when the request arrived
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0

    def arrived(self, n: int) -> None:
        """n tokens arrived together (workers send every token that is ready in one
        message): one inter-token latency per token after the first, the message's wait
        shared among its tokens — so the histogram counts tokens, not messages."""
        if n == 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.start)
            gaps, gap = n - 1, 0.0  # the rest of the first message came with it
        else:
            gaps, gap = n, (now - self.last) / n
        for _ in range(gaps):
            self.m.itl.observe(gap)
        self.last = now
        self.count += n

    def tpot(self) -> float | None:
        """The request's TPOT as the SLO counts it, over the tokens streamed so far; None
        before its second token."""
        return (self.last - self.first) / (self.count - 1) if self.count > 1 else None

    def observe_tpot(self) -> None:
        t = self.tpot()
        if t is not None:
            self.m.tpot.observe(t)


class PlannerMetrics:
    """The gateway planner's decisions, on a TierMetrics' registry with its labels:
    `pdserve:planner_role_switches_total{to_role}`, desired vs actual workers per tier
    (`pdserve:planner_desired_workers{role}`, `pdserve:planner_actual_workers{role}`), and
    the pressure each tier was judged by (`pdserve:planner_pressure{role}`: 1 is its
    threshold), so a switch's reason can be read back."""

    def __init__(self, metrics: TierMetrics) -> None:
        r, lb, self.labels = metrics.registry, LABELS, metrics.labels
        self.switches = Counter("pdserve:planner_role_switches",
                                "Role switches the planner ordered, by the role moved to.",
                                (*lb, "to_role"), registry=r)
        self.desired = Gauge("pdserve:planner_desired_workers",
                             "Workers the planner wants in a tier.", (*lb, "role"), registry=r)
        self.actual = Gauge("pdserve:planner_actual_workers",
                            "Live workers registered in a tier.", (*lb, "role"), registry=r)
        self.pressure = Gauge("pdserve:planner_pressure",
                              "A tier's pressure at the planner's last tick (1: threshold).",
                              (*lb, "role"), registry=r)
        for role in ("prefill", "decode"):  # exposed at 0 before the first switch
            self.switches.labels(**self.labels, to_role=role)

    def switched(self, to_role: str) -> None:
        self.switches.labels(**self.labels, to_role=to_role).inc()

    def workers(self, role: str, desired: int, actual: int, pressure: float) -> None:
        self.desired.labels(**self.labels, role=role).set(desired)
        self.actual.labels(**self.labels, role=role).set(actual)
        self.pressure.labels(**self.labels, role=role).set(pressure)


def histogram_totals(h) -> tuple[float, float]:
    """(count, sum) of one labelled histogram: what a windowed mean is computed from."""
    return sum(b.get() for b in h._buckets), h._sum.get()
