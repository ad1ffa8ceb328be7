"""The elastic comparison (`python -m pdserve.bench.compare --only elastic`): does moving
workers between the tiers pay when the traffic changes shape?

One gateway and two `pdserve.role_worker` processes (one core each) start 1 prefill : 1
decode. The same seeded two-phase load is replayed against two configurations:

  fixed    the gateway's planner off: 1P:1D throughout;
  planner  `--planner slo` with the comparison's SLOs (and `--planner-min-prefill 0`, so the
           last prefill worker may leave: the decode workers then prefill colocated).

  phase 1 (`phase_s`)  long prompts, short outputs, Poisson at `prompt_rate`;
  phase 2 (`phase_s`)  short prompts, long outputs, Poisson at `output_rate`.

A request belongs to the phase it arrived in. Goodput is requests per second of the
phase that met both SLOs (TTFT and TPOT); the target is the planner's goodput over the
whole run >= 1.3x the fixed split's. Role switches are read from the gateway's
`pdserve:planner_role_switches_total`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.clients import GatewayGRPCClient
from pdserve.bench.metrics import meets_slo
from pdserve.bench.runner import RunResult, run_benchmark
from pdserve.bench.workloads import BenchRequest, Tokenizer, make_workload, with_arrivals
from pdserve.cluster import MODULES, ClusterConfig, LocalCluster

TARGET_RATIO = 1.3
SWITCHES = "pdserve:planner_role_switches_total"


@dataclass(frozen=True)
class ElasticSettings:
    phase_s: float = 120.0
    prompt_len: int = 1536  # phase 1: long prompts ...
    prompt_phase_output: int = 16  # ... short outputs
    prompt_rate: float = 0.3
    output_prompt_len: int = 64  # phase 2: short prompts ...
    output_len: int = 256  # ... long outputs
    output_rate: float = 0.6
    planner_sustain_s: float = 5.0
    planner_dwell_s: float = 15.0


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float


def phases(e: ElasticSettings) -> tuple[Phase, Phase]:
    return (Phase("long-prompt", 0.0, e.phase_s),
            Phase("long-output", e.phase_s, 2 * e.phase_s))


def two_phase_load(e: ElasticSettings, tokenizer: Tokenizer, seed: int) -> list[BenchRequest]:
    """Phase 1's requests then phase 2's, with Poisson arrivals inside each phase."""
    out: list[BenchRequest] = []
    shapes = ((e.prompt_len, e.prompt_phase_output, e.prompt_rate),
              (e.output_prompt_len, e.output_len, e.output_rate))
    for k, (phase, (inp, outp, rate)) in enumerate(zip(phases(e), shapes)):
        n = max(1, math.ceil(rate * e.phase_s * 1.5))  # more than the phase can hold
        reqs = make_workload("fixed", tokenizer, n, seed + 97 * k, input_len=inp,
                             output_len=outp)
        timed = [r for r in with_arrivals(reqs, rate, seed + k) if r.arrival_s < e.phase_s]
        out += [dataclasses.replace(r, request_id=len(out) + i,
                                    arrival_s=phase.start_s + r.arrival_s)
                for i, r in enumerate(timed)]
    return out


def phase_goodput(result: RunResult, e: ElasticSettings, ttft_slo_s: float,
                  tpot_slo_s: float) -> dict[str, Any]:
    """Per phase and overall: requests, completed, met both SLOs, goodput (met / s)."""
    rows: dict[str, Any] = {}
    ps = phases(e)
    for p in (*ps, Phase("all", 0.0, ps[-1].end_s)):
        recs = [r for r in result.records if p.start_s <= r.arrival_s < p.end_s]
        met = sum(meets_slo(r, ttft_slo_s, tpot_slo_s) for r in recs)
        rows[p.name] = {"requests": len(recs), "completed": sum(r.ok for r in recs),
                        "met_slo": met, "goodput": met / (p.end_s - p.start_s)}
    return rows


def cluster_config(model: str, engine_args: Sequence[str], planner: bool,
                   ttft_slo_s: float, tpot_slo_s: float, e: ElasticSettings,
                   cpus: str) -> ClusterConfig:
    gateway_args: tuple[str, ...] = ()
    if planner:
        gateway_args = ("--planner", "slo", "--ttft-slo", f"{ttft_slo_s:g}",
                        "--tpot-slo", f"{tpot_slo_s:g}",
                        "--planner-sustain", f"{e.planner_sustain_s:g}",
                        "--planner-dwell", f"{e.planner_dwell_s:g}",
                        "--planner-min-prefill", "0")
    modules = dict(MODULES, prefill="pdserve.role_worker", decode="pdserve.role_worker")
    return ClusterConfig(model=model, num_prefill=1, num_decode=1, http_port=0, grpc_port=0,
                         cpus=cpus, engine_args=tuple(engine_args), gateway_args=gateway_args,
                         prefill_args=("--role", "prefill"), decode_args=("--role", "decode"),
                         modules=tuple(modules.items()))


def run_elastic(config: ClusterConfig, label: str, load: Sequence[BenchRequest],
                warmup: Sequence[BenchRequest], ttft_slo_s: float, tpot_slo_s: float,
                drain_s: float, startup_timeout_s: float, progress: bool,
                log) -> tuple[RunResult, float]:
    """One configuration: start, warm up, replay `load`; the result and role switches."""
    from pdserve.bench.compare import scrape

    cluster = LocalCluster(config)
    log(f"elastic {label}: starting cluster (cpus {config.cpus}; logs in {cluster.log_dir})")
    try:
        cluster.start()
        endpoints = cluster.wait_healthy(startup_timeout_s)

        async def measure() -> RunResult:
            async with GatewayGRPCClient(endpoints.grpc_address) as client:
                for req in warmup:
                    rec = await client.run(req, timeout=startup_timeout_s)
                    if not rec.ok:
                        log(f"elastic {label}: warm-up request failed: {rec.error}")
                return await run_benchmark(
                    client, load, label=label, time_limit_s=load[-1].arrival_s + drain_s,
                    ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, progress=progress)

        before = scrape(endpoints.metrics_url, (SWITCHES,))[SWITCHES]
        result = asyncio.run(measure())
        switches = scrape(endpoints.metrics_url, (SWITCHES,))[SWITCHES] - before
        return result, switches
    finally:
        cluster.stop()


def elastic_md(c: dict[str, Any]) -> list[str]:
    lines = ["| configuration | phase | requests | completed | met both SLOs | goodput (req/s) |",
             "|---|---|---|---|---|---|"]
    for label in ("fixed", "planner"):
        for phase, row in c["phases"][label].items():
            lines.append(f"| {label} | {phase} | {row['requests']} | {row['completed']} | "
                         f"{row['met_slo']} | {row['goodput']:.3f} |")
    lines += ["", f"Role switches: fixed {c['switches']['fixed']:g}, "
                  f"planner {c['switches']['planner']:g}."]
    return lines
