"""Benchmark metrics: from `RequestRecord`s to one JSON-serialisable `BenchReport`.

Per successful request (times in ms in the report, seconds in the records):

- TTFT  = first_token_time - send_time
- E2E   = end_time - send_time
- TPOT  = (E2E - TTFT) / (output_tokens - 1), only for requests with more than one token
- ITL   = the gaps between consecutive token arrivals, pooled over all requests

Each is summarised as mean, P50, P95, P99 (linear interpolation between closest ranks,
numpy's default). Throughputs divide by the run duration: the wall time of the run when
the runner gives it, else first send to last end. Goodput is successful requests per
second that meet both SLOs (TTFT <= ttft_slo and TPOT <= tpot_slo; a one-token request
has no TPOT and meets that SLO trivially). Failed requests count in `failed`/`errors`
and in nothing else.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.clients import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of `values`, interpolating linearly between ranks."""
    assert values, "percentile of nothing"
    assert 0.0 <= q <= 100.0, q
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency, in milliseconds; all None when there were no samples."""

    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(0, None, None, None, None)
        ms = [v * 1000.0 for v in values]
        return cls(
            count=len(ms),
            mean=sum(ms) / len(ms),
            p50=percentile(ms, 50),
            p95=percentile(ms, 95),
            p99=percentile(ms, 99),
        )


def ttft_s(rec: RequestRecord) -> float | None:
    if rec.send_time is None or rec.first_token_time is None:
        return None
    return rec.first_token_time - rec.send_time


def e2e_s(rec: RequestRecord) -> float | None:
    if rec.send_time is None or rec.end_time is None:
        return None
    return rec.end_time - rec.send_time


def tpot_s(rec: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output_tokens - 1); None for one-token or unfinished requests."""
    ttft, e2e = ttft_s(rec), e2e_s(rec)
    if ttft is None or e2e is None or rec.output_tokens <= 1:
        return None
    return (e2e - ttft) / (rec.output_tokens - 1)


def itl_s(rec: RequestRecord) -> list[float]:
    """Gaps between consecutive token arrivals."""
    t = rec.token_times
    return [b - a for a, b in itertools.pairwise(t)]


def meets_slo(rec: RequestRecord, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    """Successful, TTFT <= ttft_slo_s and TPOT <= tpot_slo_s (a None SLO always holds)."""
    if not rec.ok:
        return False
    ttft, tpot = ttft_s(rec), tpot_s(rec)
    if ttft_slo_s is not None and (ttft is None or ttft > ttft_slo_s):
        return False
    return tpot_slo_s is None or tpot is None or tpot <= tpot_slo_s


def _error_kind(rec: RequestRecord) -> str:
    """Group errors by status when there is one, else by the message's first words."""
    if rec.status not in (None, 200, "OK"):
        return str(rec.status)
    return (rec.error or "").split(":")[0][:60]


@dataclass(frozen=True)
class BenchReport:
    """One run's results; `to_dict` is JSON-ready (no NaN, no infinity)."""

    label: str
    rate: float | None  # requests/s offered; None for all at once
    num_requests: int
    completed: int
    failed: int
    short_outputs: int  # completed with fewer tokens than asked (ignore_eos not honoured?)
    duration_s: float
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s of completed requests
    total_token_throughput: float  # (prompt + output) tokens/s of completed requests
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    goodput: float  # requests/s meeting both SLOs
    slo_attainment: float  # fraction of all requests meeting both SLOs
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    errors: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compute_report(
    records: Sequence[RequestRecord],
    *,
    label: str = "",
    rate: float | None = None,
    duration_s: float | None = None,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
) -> BenchReport:
    """Summarise `records` (see the module doc for every definition)."""
    ok = [r for r in records if r.ok]
    if duration_s is None:
        sends = [r.send_time for r in records if r.send_time is not None]
        ends = [r.end_time for r in records if r.end_time is not None]
        duration_s = max(ends) - min(sends) if sends and ends else 0.0

    def per_second(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    ttfts = [v for v in map(ttft_s, ok) if v is not None]
    tpots = [v for v in map(tpot_s, ok) if v is not None]
    e2es = [v for v in map(e2e_s, ok) if v is not None]
    itls = [gap for r in ok for gap in itl_s(r)]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(
        r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_tokens for r in ok
    )
    good = sum(meets_slo(r, ttft_slo_s, tpot_slo_s) for r in records)
    return BenchReport(
        label=label,
        rate=None if rate is None or math.isinf(rate) else rate,
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        short_outputs=sum(r.output_tokens < r.expected_output_tokens for r in ok),
        duration_s=duration_s,
        request_throughput=per_second(len(ok)),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(output_tokens + prompt_tokens),
        ttft_slo_ms=None if ttft_slo_s is None else ttft_slo_s * 1000.0,
        tpot_slo_ms=None if tpot_slo_s is None else tpot_slo_s * 1000.0,
        goodput=per_second(good),
        slo_attainment=good / len(records) if records else 0.0,
        ttft_ms=LatencyStats.of_seconds(ttfts),
        tpot_ms=LatencyStats.of_seconds(tpots),
        itl_ms=LatencyStats.of_seconds(itls),
        e2e_ms=LatencyStats.of_seconds(e2es),
        errors=dict(Counter(_error_kind(r) for r in records if not r.ok)),
    )


def request_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """One compact JSON row per request (ms), enough to redraw latency CDFs later."""

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000.0

    return [
        {
            "request_id": r.request_id,
            "arrival_s": r.arrival_s,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "chunks": r.chunk_count,
            "ttft_ms": ms(ttft_s(r)),
            "tpot_ms": ms(tpot_s(r)),
            "e2e_ms": ms(e2e_s(r)),
            "status": r.status,
            "error": r.error,
        }
        for r in records
    ]
