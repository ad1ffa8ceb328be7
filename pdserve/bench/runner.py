"""Benchmark runner: replay a workload against a client on its arrival schedule.

A run:

1. the dispatcher walks the requests in arrival order, sleeping until each one's
   `arrival_s` after the run start, and starts it as its own task;
2. a started request waits for a concurrency slot (`max_concurrency`, unbounded when None)
   and is then sent — so TTFT measures the server, not the client's own queue;
3. with `time_limit_s`, each sent request gets the time left as its timeout, and requests
   whose arrival falls after the limit are recorded as not sent (failed);
4. when every task is done, the records (in workload order) become a `BenchReport`.

A progress bar (tqdm) counts finished requests on stderr.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from pdserve.bench.clients import BenchClient, RequestRecord
from pdserve.bench.metrics import BenchReport, compute_report, request_rows
from pdserve.bench.workloads import BenchRequest, rate_sweep


@dataclass
class RunResult:
    """One run: its configuration label, offered rate, report and per-request records."""

    label: str
    rate: float  # math.inf for all at once
    report: BenchReport
    records: list[RequestRecord]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the report and one compact row per request (for CDF plots)."""
        return {
            "label": self.label,
            "rate": None if math.isinf(self.rate) else self.rate,
            "report": self.report.to_dict(),
            "requests": request_rows(self.records),
        }


def _not_sent(req: BenchRequest) -> RequestRecord:
    return RequestRecord(
        request_id=req.request_id,
        prompt_tokens=req.prompt_tokens,
        expected_output_tokens=req.output_tokens,
        arrival_s=req.arrival_s,
        error="not sent: time limit reached",
    )


async def run_benchmark(
    client: BenchClient,
    requests: Sequence[BenchRequest],
    *,
    label: str = "",
    rate: float = math.inf,
    max_concurrency: int | None = None,
    time_limit_s: float | None = None,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    progress: bool = True,
) -> RunResult:
    """Send `requests` at their `arrival_s` offsets and measure them (see module doc).

    `rate` is only recorded in the report; the schedule is the requests' own arrivals.
    """
    assert max_concurrency is None or max_concurrency >= 1, max_concurrency
    records: list[RequestRecord | None] = [None] * len(requests)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(
        total=len(requests),
        file=sys.stderr,
        disable=not progress,
        desc=label or "bench",
        unit="req",
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + time_limit_s

    async def send(index: int, req: BenchRequest) -> None:
        if slots is not None:
            await slots.acquire()
        try:
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                records[index] = _not_sent(req)
            else:
                records[index] = await client.run(req, timeout=left)
        finally:
            if slots is not None:
                slots.release()
            bar.update(1)

    tasks = []
    try:
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        for index in order:
            req = requests[index]
            if deadline is not None and start + req.arrival_s >= deadline:
                records[index] = _not_sent(req)
                bar.update(1)
                continue
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(index, req)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    duration = time.perf_counter() - start
    done = [r for r in records if r is not None]
    assert len(done) == len(requests), "every request ends in a record"
    report = compute_report(
        done,
        label=label,
        rate=rate,
        duration_s=duration,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
    )
    return RunResult(label=label, rate=rate, report=report, records=done)


async def run_sweep(
    client: BenchClient,
    requests: Sequence[BenchRequest],
    rates: Sequence[float],
    *,
    seed: int,
    **kwargs: Any,
) -> list[RunResult]:
    """Run the same requests once per rate (Poisson arrivals seeded by `seed`, inf = all at
    once), one after another; `kwargs` go to `run_benchmark`."""
    results = []
    for planned in rate_sweep(requests, rates, seed):
        results.append(await run_benchmark(client, planned.requests, rate=planned.rate, **kwargs))
    return results
