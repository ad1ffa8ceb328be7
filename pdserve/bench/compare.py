"""The comparison harness: disaggregated vs colocated, prefix caching on vs off, offline
throughput against `transformers`, and (on request) the planner against a fixed P:D split
under a load that changes shape (`elastic`, see `pdserve.bench.elastic`), each against its
target.

    python -m pdserve.bench.compare [--quick] [--only disagg,prefix,offline,elastic]
                                    [--out-dir docs/bench]

A cluster comparison (`disagg`, `prefix`):

1. builds its seeded workload once with the tokenizer of `--model`;
2. for each configuration starts a real `LocalCluster` (free ports, workers pinned so every
   configuration gets the same cores), waits until it is healthy, sends a short warm-up
   (unrelated text, so no prefix it caches is one the workload uses), then replays the
   workload through the gateway's gRPC API — one run per rate, each bounded by a request
   count and a time limit (arrival window + `drain_s`) — reading the workers' `/metrics`
   counters before and after, and stops the cluster;
3. reduces the runs to per-rate rows, ratios and targets (met, or missed by how much).

`offline` runs `pdserve.bench.offline` as a child process (float32 engine and transformers, then a
bfloat16 engine run) and folds its JSON in. Everything lands in `--out-dir`: `results.json`
and `results.md` (one section per comparison, with the command that produced it; sections
not run this time keep their earlier content), and per comparison `runs.json` and PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench import elastic, plots
from pdserve.bench.clients import GatewayGRPCClient
from pdserve.bench.metrics import meets_slo
from pdserve.bench.runner import RunResult, run_benchmark
from pdserve.bench.workloads import BenchRequest, Tokenizer, fit_text, make_workload, with_arrivals
from pdserve.cluster import ClusterConfig, LocalCluster

COMPARISONS = ("disagg", "prefix", "offline", "elastic")
DEFAULT_COMPARISONS = ("disagg", "prefix", "offline")  # elastic: ~10 minutes more, on request
SUSTAINED_ATTAINMENT = 0.9  # DistServe's SLO attainment for "SLO capacity"
# TPOT SLOs the disaggregated comparison is re-scored under, from the same requests: whether
# disaggregation pays in goodput depends on how tight the TPOT SLO is (DistServe, fig. 1)
TPOT_SLO_GRID_MS = (100.0, 150.0, 200.0, 250.0, 300.0)
COUNTERS = ("pdserve:prompt_tokens_total", "pdserve:prefix_cache_hits_total")


@dataclass(frozen=True)
class Settings:
    """Everything a comparison run depends on (recorded in the results)."""

    model: str = "smollm2-135m"
    quick: bool = False
    seed: int = 0
    ttft_slo_ms: float = 5000.0
    tpot_slo_ms: float = 250.0
    disagg_requests: int = 32
    disagg_rates: tuple[float, ...] = (0.3, 0.6, 0.9, 1.2)
    # a third layout for the disagg comparison: prompts of at least this many tokens go to
    # the prefill worker, shorter ones prefill on the decode worker; 0 = leave it out
    conditional_threshold: int = 1024
    prefix_requests: int = 24
    prefix_rate: float = 0.3
    drain_s: float = 60.0  # a run's time limit is its arrival window plus this
    offline_requests: int = 64
    offline_timeout_s: float = 1200.0
    kv_cache_memory: str = "1GiB"
    dtype: str = "float32"  # the workers' dtype in the disagg and prefix comparisons
    startup_timeout_s: float = 300.0
    long_prompt_params: Mapping[str, Any] = field(default_factory=dict)
    elastic: elastic.ElasticSettings = elastic.ElasticSettings()
    shared_prefix_params: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = True
    command: str = "python -m pdserve.bench.compare"


QUICK = {"disagg_requests": 4, "disagg_rates": (0.5, 1.0), "prefix_requests": 4,
         "prefix_rate": 0.5, "drain_s": 40.0, "offline_requests": 4, "offline_timeout_s": 600.0}


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- helpers


def two_cores() -> tuple[int, int]:
    """The first two cores this process may use (the same one twice on a 1-core machine)."""
    avail = sorted(os.sched_getaffinity(0))
    return (avail[0], avail[1]) if len(avail) > 1 else (avail[0], avail[0])


def fresh_text(requests: Sequence[BenchRequest], tokenizer: Tokenizer,
               salt: str) -> list[BenchRequest]:
    """The same requests (lengths, outputs) with new prompt text, so a replay at another rate
    finds nothing of the previous one in the prefix cache. Chat requests are kept."""
    return [r if r.prompt is None else dataclasses.replace(
        r, prompt=fit_text(tokenizer, random.Random(f"{salt}:{r.request_id}"), r.prompt_tokens))
        for r in requests]


def warmup_requests(workload: str, tokenizer: Tokenizer, s: Settings,
                    params: Mapping[str, Any]) -> list[BenchRequest]:
    """Two short-output requests of `workload` from another seed (another system prompt)."""
    reqs = make_workload(workload, tokenizer, 2, s.seed + 10_007, **params)
    return [dataclasses.replace(r, output_tokens=min(4, r.output_tokens)) for r in reqs]


def scrape(url: str, names: Sequence[str] = COUNTERS) -> dict[str, float]:
    """Sum of each named sample over its label sets, from a Prometheus text page."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name in out:
            out[name] += float(value)
    return out


async def wait_idle(endpoints: Any, timeout_s: float) -> None:
    """Until no worker has a request running or waiting (what a previous, cut-short run
    left behind), at most `timeout_s`."""
    names = ("pdserve:num_requests_running", "pdserve:num_requests_waiting")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(sum(scrape(w.metrics_url, names).values()) for w in endpoints.workers):
            return
        await asyncio.sleep(0.5)
    log(f"workers still busy after {timeout_s:.0f}s; measuring anyway")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def target(metric: str, measured: float | None, op: str, bound: float) -> dict[str, Any]:
    """One target: met or not, and when missed, by how much (relative to the bound)."""
    assert op in ("<=", ">="), op
    if measured is None:
        return {"metric": metric, "target": f"{op} {bound:g}", "measured": None, "met": False,
                "result": "not measured"}
    met = measured <= bound if op == "<=" else measured >= bound
    if met:
        result = "met"
    elif op == "<=":
        over = measured / bound
        result = (f"missed by {100 * (over - 1):.0f}%" if over < 2
                  else f"missed: {over:.1f}x the bound")
    else:
        result = f"missed by {100 * (1 - measured / bound):.0f}%"
    return {"metric": metric, "target": f"{op} {bound:g}", "measured": round(measured, 3),
            "met": met, "result": result}


# ---------------------------------------------------------------------------- cluster runs


@dataclass(frozen=True)
class Configuration:
    """One cluster layout to measure."""

    label: str
    num_prefill: int
    cpus: str
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    disagg_threshold: int | None = None


def run_configuration(s: Settings, cfg: Configuration,
                      runs: Sequence[tuple[float, list[BenchRequest]]],
                      warmup: Sequence[BenchRequest]) -> tuple[list[RunResult], dict[str, Any]]:
    """Start `cfg`, warm it up, replay each (rate, requests) and return the results and the
    per-worker counter deltas over the measured runs."""
    cluster = LocalCluster(ClusterConfig(
        model=s.model, num_prefill=cfg.num_prefill, num_decode=1, http_port=0, grpc_port=0,
        disagg_threshold=cfg.disagg_threshold, cpus=cfg.cpus,
        engine_args=("--kv-cache-memory", s.kv_cache_memory, "--dtype", s.dtype,
                     *cfg.engine_args),
        prefill_args=cfg.prefill_args, decode_args=cfg.decode_args))
    log(f"{cfg.label}: starting cluster (cpus {cfg.cpus}; logs in {cluster.log_dir})")
    try:
        cluster.start()
        endpoints = cluster.wait_healthy(s.startup_timeout_s)
        finish_stops()  # the previous configuration is gone before this one measures
        return asyncio.run(_measure(s, cfg, endpoints, runs, warmup))
    finally:
        # its workers drain and exit (seconds) while the next configuration starts up
        stop = threading.Thread(target=cluster.stop, name=f"stop {cfg.label}")
        stop.start()
        _STOPPING.append(stop)


_STOPPING: list[threading.Thread] = []  # clusters being stopped in the background


def finish_stops() -> None:
    """Wait until every cluster run_configuration left stopping has stopped."""
    while _STOPPING:
        _STOPPING.pop().join()


async def _measure(s: Settings, cfg: Configuration, endpoints: Any,
                   runs: Sequence[tuple[float, list[BenchRequest]]],
                   warmup: Sequence[BenchRequest]) -> tuple[list[RunResult], dict[str, Any]]:
    results = []
    async with GatewayGRPCClient(endpoints.grpc_address) as client:
        for req in warmup:
            rec = await client.run(req, timeout=s.startup_timeout_s)
            if not rec.ok:
                log(f"{cfg.label}: warm-up request failed: {rec.error}")
        before = {w.name: scrape(w.metrics_url) for w in endpoints.workers}
        for rate, requests in runs:
            await wait_idle(endpoints, s.drain_s)
            planned = with_arrivals(requests, rate, s.seed)
            limit = planned[-1].arrival_s + s.drain_s
            log(f"{cfg.label}: {len(planned)} requests at {rate:g} req/s (limit {limit:.0f}s)")
            result = await run_benchmark(
                client, planned, label=cfg.label, rate=rate, time_limit_s=limit,
                ttft_slo_s=s.ttft_slo_ms / 1000, tpot_slo_s=s.tpot_slo_ms / 1000,
                progress=s.progress)
            r = result.report
            log(f"{cfg.label} @ {rate:g}: ok {r.completed}/{r.num_requests}, goodput "
                f"{r.goodput:.2f}, P99 TPOT {r.tpot_ms.p99}, P50 TTFT {r.ttft_ms.p50}")
            results.append(result)
        after = {w.name: scrape(w.metrics_url) for w in endpoints.workers}
    counters = {name: {k: after[name][k] - before[name][k] for k in COUNTERS} for name in after}
    return results, counters


def _row(result: RunResult) -> dict[str, Any]:
    r = result.report
    return {"completed": r.completed, "num_requests": r.num_requests, "failed": r.failed,
            "goodput": r.goodput, "slo_attainment": r.slo_attainment,
            "output_throughput": r.output_throughput, "ttft_ms_p50": r.ttft_ms.p50,
            "ttft_ms_p99": r.ttft_ms.p99, "tpot_ms_p50": r.tpot_ms.p50,
            "tpot_ms_p99": r.tpot_ms.p99, "errors": r.errors, "sustained": r.failed == 0}


def _save_runs(out_dir: Path, name: str, results: Sequence[RunResult], workload: str,
               seed: int) -> list[str]:
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    runs = [dict(r.to_dict(), workload=workload, seed=seed) for r in results]
    (folder / "runs.json").write_text(json.dumps({"runs": runs}, indent=1))
    paths = plots.write_plots(runs, folder)
    if any(r["rate"] is not None for r in runs) and len({r["rate"] for r in runs}) > 1:
        paths.append(plots.plot_goodput(runs, folder / "goodput.png"))
    return [str(p.relative_to(out_dir)) for p in paths]


# ---------------------------------------------------------------------------- comparisons


def compare_disagg(s: Settings, tokenizer: Tokenizer, out_dir: Path) -> dict[str, Any]:
    """(a) long-prompt at each rate: 1 prefill + 1 decode worker on one core each vs one
    colocated decode worker on both cores."""
    rates = sorted(s.disagg_rates)
    base = make_workload("long-prompt", tokenizer, s.disagg_requests, s.seed,
                         **s.long_prompt_params)
    runs = [(rate, base if i == 0 else fresh_text(base, tokenizer, f"{s.seed}:{i}"))
            for i, rate in enumerate(rates)]
    warmup = warmup_requests("long-prompt", tokenizer, s, s.long_prompt_params)
    c0, c1 = two_cores()
    configs = [
        Configuration("disaggregated", 1, f"prefill={c0},decode={c1}", ("--threads", "1"),
                      ("--threads", "1"), disagg_threshold=0),
        Configuration("colocated", 0, f"decode={c0},{c1}" if c0 != c1 else f"decode={c0}",
                      decode_args=("--threads", "2" if c0 != c1 else "1")),
    ]
    if s.conditional_threshold:
        configs.append(Configuration(
            "conditional", 1, f"prefill={c0},decode={c1}", ("--threads", "1"),
            ("--threads", "1"), disagg_threshold=s.conditional_threshold))
    results = {c.label: run_configuration(s, c, runs, warmup)[0] for c in configs}
    rows = [{"rate": rate, **{label: _row(res[i]) for label, res in results.items()}}
            for i, rate in enumerate(rates)]
    sustained = [row["rate"] for row in rows if row["colocated"]["sustained"]]
    at = max(sustained) if sustained else rates[0]
    row = next(r for r in rows if r["rate"] == at)
    targets = disagg_targets(row)  # disaggregated's two first: P99 TPOT, then goodput
    capacity = {label: slo_capacity(rates, [r[label]["slo_attainment"] for r in rows],
                                    [r[label]["sustained"] for r in rows])
                for label in results}
    all_results = [r for res in results.values() for r in res]
    sensitivity = tpot_slo_sensitivity(results, rates, s.ttft_slo_ms)
    return {
        "workload": "long-prompt", "rates": rates, "requests_per_run": s.disagg_requests,
        "configurations": [dataclasses.asdict(c) for c in configs],
        "slo_ms": {"ttft": s.ttft_slo_ms, "tpot": s.tpot_slo_ms},
        "rows": rows,
        "compared_at_rate": at, "colocated_sustained_any": bool(sustained),
        "p99_tpot_ratio": targets[0]["measured"], "goodput_ratio": targets[1]["measured"],
        "slo_capacity": capacity,
        "slo_capacity_ratio": ratio(capacity["disaggregated"], capacity["colocated"]),
        "tpot_slo_sensitivity": sensitivity,
        "targets": targets,
        "plots": _save_runs(out_dir, "disagg", all_results, "long-prompt", s.seed),
    }


def compare_elastic(s: Settings, tokenizer: Tokenizer, out_dir: Path) -> dict[str, Any]:
    """(d) the two-phase load on 1 gateway + 2 role workers (one core each): planner off
    (fixed 1P:1D) vs `--planner slo`; goodput per phase and role switches."""
    e = s.elastic
    ttft, tpot = s.ttft_slo_ms / 1000, s.tpot_slo_ms / 1000
    load = elastic.two_phase_load(e, tokenizer, s.seed)
    warmup = warmup_requests("fixed", tokenizer, s, {"input_len": 64, "output_len": 4})
    c0, c1 = two_cores()
    engine = ("--kv-cache-memory", s.kv_cache_memory, "--dtype", s.dtype, "--threads", "1")
    phases, switches, results = {}, {}, []
    for label, planner in (("fixed", False), ("planner", True)):
        cfg = elastic.cluster_config(s.model, engine, planner, ttft, tpot, e,
                                     f"prefill={c0},decode={c1}")
        result, switches[label] = elastic.run_elastic(
            cfg, label, load, warmup, ttft, tpot, s.drain_s, s.startup_timeout_s, s.progress,
            log)
        phases[label] = elastic.phase_goodput(result, e, ttft, tpot)
        log(f"elastic {label}: {phases[label]}, switches {switches[label]:g}")
        results.append(result)
    g = ratio(phases["planner"]["all"]["goodput"], phases["fixed"]["all"]["goodput"])
    return {
        "workload": "two-phase", "settings": dataclasses.asdict(e),
        "slo_ms": {"ttft": s.ttft_slo_ms, "tpot": s.tpot_slo_ms},
        "phases": phases, "switches": switches, "goodput_ratio": g,
        "targets": [target("elastic goodput, planner / fixed 1P:1D", g, ">=",
                           elastic.TARGET_RATIO)],
        "plots": _save_runs(out_dir, "elastic", results, "two-phase", s.seed),
    }


def slo_capacity(rates: Sequence[float], attainment: Sequence[float],
                 sustained: Sequence[bool]) -> float | None:
    """The highest rate sustained with SLO attainment >= SUSTAINED_ATTAINMENT, or None."""
    ok = [rate for rate, a, sus in zip(rates, attainment, sustained)
          if sus and a >= SUSTAINED_ATTAINMENT]
    return max(ok) if ok else None


def disagg_targets(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The comparison's targets at one rate's row: each disaggregated layout against
    colocated (P99 TPOT <= 0.5x, goodput >= 1.5x)."""
    c = row["colocated"]
    out = []
    for label in ("disaggregated", "conditional"):
        if label in row:
            d = row[label]
            out += [target(f"P99 TPOT, {label} / colocated",
                           ratio(d["tpot_ms_p99"], c["tpot_ms_p99"]), "<=", 0.5),
                    target(f"goodput, {label} / colocated", ratio(d["goodput"], c["goodput"]),
                           ">=", 1.5)]
    return out


def tpot_slo_sensitivity(results: Mapping[str, Sequence[RunResult]], rates: Sequence[float],
                         ttft_slo_ms: float) -> list[dict[str, Any]]:
    """The same runs scored under each TPOT SLO of TPOT_SLO_GRID_MS (TTFT SLO fixed):
    per setup, SLO attainment at each rate and the SLO capacity (highest sustained rate
    with attainment >= SUSTAINED_ATTAINMENT)."""
    grid = []
    for tpot_ms in TPOT_SLO_GRID_MS:
        entry: dict[str, Any] = {"tpot_slo_ms": tpot_ms}
        for label, runs in results.items():
            att = [sum(meets_slo(r, ttft_slo_ms / 1000, tpot_ms / 1000) for r in run.records)
                   / max(1, len(run.records)) for run in runs]
            entry[label] = {"attainment": att, "slo_capacity": slo_capacity(
                rates, att, [run.report.failed == 0 for run in runs])}
        entry["capacity_ratio"] = ratio(entry["disaggregated"]["slo_capacity"],
                                        entry["colocated"]["slo_capacity"])
        if "conditional" in entry:
            entry["conditional_capacity_ratio"] = ratio(entry["conditional"]["slo_capacity"],
                                                        entry["colocated"]["slo_capacity"])
        grid.append(entry)
    return grid


def compare_prefix(s: Settings, tokenizer: Tokenizer, out_dir: Path) -> dict[str, Any]:
    """(b) shared-prefix on one colocated decode worker (both cores), caching on vs off."""
    requests = make_workload("shared-prefix", tokenizer, s.prefix_requests, s.seed,
                             **s.shared_prefix_params)
    warmup = warmup_requests("shared-prefix", tokenizer, s, s.shared_prefix_params)
    c0, c1 = two_cores()
    cpus = f"decode={c0},{c1}" if c0 != c1 else f"decode={c0}"
    threads = ("--threads", "2" if c0 != c1 else "1")
    configs = [Configuration("caching on", 0, cpus, decode_args=threads),
               Configuration("caching off", 0, cpus, decode_args=threads,
                             engine_args=("--no-prefix-caching",))]
    out: dict[str, Any] = {}
    all_results = []
    for cfg in configs:
        (result,), counters = run_configuration(s, cfg, [(s.prefix_rate, requests)], warmup)
        prompt = sum(c["pdserve:prompt_tokens_total"] for c in counters.values())
        hits = sum(c["pdserve:prefix_cache_hits_total"] for c in counters.values())
        out[cfg.label] = {**_row(result), "prompt_tokens": prompt, "prefix_cache_hits": hits,
                          "prefill_tokens_computed": prompt - hits, "worker_counters": counters}
        all_results.append(result)
    on, off = out["caching on"], out["caching off"]
    p50 = ratio(off["ttft_ms_p50"], on["ttft_ms_p50"])
    return {
        "workload": "shared-prefix", "rate": s.prefix_rate, "requests": s.prefix_requests,
        "configurations": [dataclasses.asdict(c) for c in configs],
        "results": out,
        "ttft_p50_ratio": p50, "ttft_p99_ratio": ratio(off["ttft_ms_p99"], on["ttft_ms_p99"]),
        "prefill_tokens_ratio": ratio(off["prefill_tokens_computed"],
                                      on["prefill_tokens_computed"]),
        "targets": [target("TTFT P50, caching off / caching on", p50, ">=", 3.0)],
        "plots": _save_runs(out_dir, "prefix", all_results, "shared-prefix", s.seed),
    }


def _offline_run(s: Settings, dtype: str, path: Path, skip_transformers: bool) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pdserve.bench.offline", "--model", s.model, "--dtype", dtype,
            "--num-requests", str(s.offline_requests), "--seed", str(s.seed), "--out", str(path)]
    if skip_transformers:
        argv.append("--skip-transformers")
    log(f"offline: {shlex.join(argv[1:])}")
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=s.offline_timeout_s)
    return json.loads(path.read_text())


def compare_offline(s: Settings, out_dir: Path) -> dict[str, Any]:
    """(c) `pdserve.bench.offline`: float32 engine vs transformers, then a bfloat16 engine run
    (its ratio is against the float32 transformers baseline)."""
    folder = out_dir / "offline"
    folder.mkdir(parents=True, exist_ok=True)
    fp32 = _offline_run(s, "float32", folder / "float32.json", skip_transformers=False)
    bf16 = _offline_run(s, "bfloat16", folder / "bfloat16.json", skip_transformers=True)
    base = fp32["transformers_static"]["output_tokens_per_s"]
    r32 = ratio(fp32["engine"]["output_tokens_per_s"], base)
    r16 = ratio(bf16["engine"]["output_tokens_per_s"], base)
    bars = {"transformers fp32": base, "engine fp32": fp32["engine"]["output_tokens_per_s"],
            "engine bf16": bf16["engine"]["output_tokens_per_s"]}
    png = plots.plot_bars(bars, folder / "throughput.png", title="Offline output throughput",
                          ylabel="output tokens/s")
    return {"requests": s.offline_requests, "float32": fp32, "bfloat16": bf16,
            "speedup_float32": r32, "speedup_bfloat16": r16,
            "targets": [target("engine fp32 / transformers fp32", r32, ">=", 5.0),
                        target("engine bf16 / transformers fp32", r16, ">=", 8.0)],
            "plots": [str(png.relative_to(out_dir))]}


# ---------------------------------------------------------------------------- results.md


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _targets_md(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| target | wanted | measured | result |", "|---|---|---|---|"]
    lines += [f"| {t['metric']} | {t['target']} | {_f(t['measured'], 2)} | {t['result']} |"
              for t in targets]
    return lines


def _header_md(c: Mapping[str, Any]) -> list[str]:
    lines = [f"Command: `{c['command']}`", "",
             f"Run {c['finished_at']} on {c['machine']}, model `{c['model']}`, "
             f"{c['elapsed_s']:.0f} s."]
    if c.get("quick"):
        lines += ["", "**Quick smoke run: a handful of requests, not a measurement.**"]
    return lines + [""]


def disagg_md(c: Mapping[str, Any]) -> list[str]:
    slo = c["slo_ms"]
    labels = [cfg["label"] for cfg in c["configurations"]]
    conditional = next((cfg for cfg in c["configurations"] if cfg["label"] == "conditional"),
                       None)
    layouts = ("Disaggregated: 1 prefill worker on one core + 1 decode worker on the other "
               "(`--threads 1` each, `--disagg-threshold 0`). Colocated: 1 decode worker on "
               "both cores (`--threads 2`, no prefill worker). ")
    if conditional:
        layouts += ("Conditional: the disaggregated layout with `--disagg-threshold "
                    f"{conditional['disagg_threshold']}`: shorter prompts prefill on the decode "
                    "worker. ")
    lines = ["## Disaggregated vs colocated (`long-prompt`)", "", *_header_md(c),
             layouts + "Gateway unpinned in all. "
             f"{c['requests_per_run']} Poisson requests per rate; each rate replays the same "
             "lengths with new text (no prefix-cache carry-over).", "",
             f"SLOs: TTFT <= {slo['ttft']:g} ms, TPOT <= {slo['tpot']:g} ms. A setup "
             "*sustains* a rate when every request completed within the run's time limit "
             "(arrival window + drain allowance). *SLO capacity*: the highest rate sustained "
             f"with SLO attainment >= {SUSTAINED_ATTAINMENT:.0%} (DistServe's goodput).", "",
             "| rate (req/s) | setup | ok | goodput (req/s) | SLO att. | P50 TPOT (ms) "
             "| P99 TPOT (ms) | P50 TTFT (ms) | P99 TTFT (ms) | sustained |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in c["rows"]:
        for label in labels:
            r = row[label]
            lines.append(
                f"| {row['rate']:g} | {label} | {r['completed']}/{r['num_requests']} "
                f"| {r['goodput']:.2f} | {r['slo_attainment']:.0%} | {_f(r['tpot_ms_p50'])} "
                f"| {_f(r['tpot_ms_p99'])} | {_f(r['ttft_ms_p50'])} | {_f(r['ttft_ms_p99'])} "
                f"| {'yes' if r['sustained'] else 'no'} |")
    at = c["compared_at_rate"]
    why = ("the highest rate colocated sustains" if c["colocated_sustained_any"]
           else "colocated sustained no rate; compared at the lowest")
    cap = c["slo_capacity"]
    caps = ", ".join(f"{label} {_f(cap[label], 2)}" for label in labels)
    lines += ["", f"Compared at {at:g} req/s ({why}). SLO capacity (req/s): {caps} "
              f"(disaggregated / colocated {_f(c['slo_capacity_ratio'], 2)}).", "",
              *_targets_md(c["targets"])]
    grid = c.get("tpot_slo_sensitivity")
    if grid:
        rates = " / ".join(f"{r:g}" for r in c["rates"])
        lines += ["", f"The same requests scored under other TPOT SLOs (TTFT <= {slo['ttft']:g} "
                  f"ms): SLO attainment at {rates} req/s, and SLO capacity.", "",
                  "| TPOT SLO (ms) | " + " | ".join(f"{label} attainment | capacity"
                                                    for label in labels)
                  + " | capacity, disaggregated / colocated |",
                  "|---|" + "---|---|" * len(labels) + "---|"]
        for e in grid:
            cells = [f"{' / '.join(f'{a:.0%}' for a in e[label]['attainment'])} "
                     f"| {_f(e[label]['slo_capacity'], 2)}" for label in labels]
            lines.append(f"| {e['tpot_slo_ms']:g} | " + " | ".join(cells)
                         + f" | {_f(e['capacity_ratio'], 2)} |")
    return lines


def prefix_md(c: Mapping[str, Any]) -> list[str]:
    lines = ["## Prefix caching on vs off (`shared-prefix`)", "", *_header_md(c),
             f"One colocated decode worker on both cores; {c['requests']} requests at "
             f"{c['rate']:g} req/s (Poisson); off = `--no-prefix-caching`. Prefill tokens "
             "computed = Δ`pdserve:prompt_tokens_total` − Δ`pdserve:prefix_cache_hits_total` "
             "on the worker over the run.", "",
             "| setup | ok | P50 TTFT (ms) | P99 TTFT (ms) | P50 TPOT (ms) | prompt tokens "
             "| cache hits | prefill tokens computed |", "|---|---|---|---|---|---|---|---|"]
    for label, r in c["results"].items():
        lines.append(f"| {label} | {r['completed']}/{r['num_requests']} "
                     f"| {_f(r['ttft_ms_p50'])} | {_f(r['ttft_ms_p99'])} "
                     f"| {_f(r['tpot_ms_p50'])} | {r['prompt_tokens']:.0f} "
                     f"| {r['prefix_cache_hits']:.0f} | {r['prefill_tokens_computed']:.0f} |")
    lines += ["", f"TTFT P99 off/on: {_f(c['ttft_p99_ratio'], 2)}; prefill tokens computed "
              f"off/on: {_f(c['prefill_tokens_ratio'], 2)}.", "", *_targets_md(c["targets"])]
    return lines


def offline_md(c: Mapping[str, Any]) -> list[str]:
    fp32, bf16 = c["float32"], c["bfloat16"]
    lines = ["## Offline throughput vs transformers", "", *_header_md(c),
             f"`pdserve.bench.offline`: {c['requests']} `mixed` requests submitted at once; "
             "transformers `generate` in static batches of "
             f"{fp32['transformers_static']['batch_size']}. Commands: "
             f"`{fp32['command']}`, `{bf16['command']}`. The bfloat16 ratio is against the "
             "float32 transformers baseline.", "",
             "| run | output tokens/s | wall (s) |", "|---|---|---|",
             f"| transformers float32 | {fp32['transformers_static']['output_tokens_per_s']} "
             f"| {fp32['transformers_static']['wall_s']} |",
             f"| engine float32 | {fp32['engine']['output_tokens_per_s']} "
             f"| {fp32['engine']['wall_s']} |",
             f"| engine bfloat16 | {bf16['engine']['output_tokens_per_s']} "
             f"| {bf16['engine']['wall_s']} |", "", *_targets_md(c["targets"])]
    return lines


def elastic_md(c: Mapping[str, Any]) -> list[str]:
    e, slo = c["settings"], c["slo_ms"]
    return ["## Planner vs fixed 1P:1D under a two-phase load (`elastic`)", "",
            *_header_md(c),
            f"1 gateway + 2 role workers, one core each. Phase 1 ({e['phase_s']:g} s): "
            f"{e['prompt_len']}-token prompts, {e['prompt_phase_output']} output tokens, "
            f"{e['prompt_rate']:g} req/s; phase 2 ({e['phase_s']:g} s): "
            f"{e['output_prompt_len']}-token prompts, {e['output_len']} output tokens, "
            f"{e['output_rate']:g} req/s (Poisson). Goodput: requests per second of the phase "
            f"meeting TTFT <= {slo['ttft']:g} ms and TPOT <= {slo['tpot']:g} ms.", "",
            *elastic.elastic_md(c), "", *_targets_md(c["targets"])]


SECTIONS = {"disagg": disagg_md, "prefix": prefix_md, "offline": offline_md,
            "elastic": elastic_md}


def results_md(comparisons: Mapping[str, Mapping[str, Any]]) -> str:
    lines = ["# pdserve benchmark results", "",
             "Written by `bench/compare.py`; each section names the command that produced it.",
             ""]
    for name in COMPARISONS:
        if name in comparisons:
            c = comparisons[name]
            lines += SECTIONS[name](c)
            lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in c.get("plots", ())), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- entry point


def run(s: Settings, only: Sequence[str], out_dir: Path) -> dict[str, Any]:
    """Run the comparisons in `only`, merge them into `out_dir/results.json`, rewrite
    `results.md`, and return the merged comparisons."""
    from pdserve.engine.model_files import load_tokenizer, resolve_model

    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    merged: dict[str, Any] = {}
    if results_path.exists():
        merged = json.loads(results_path.read_text()).get("comparisons", {})
    tokenizer = None
    if {"disagg", "prefix", "elastic"} & set(only):
        tokenizer = load_tokenizer(resolve_model(s.model))
    machine = f"{platform.node()} ({len(os.sched_getaffinity(0))} cores usable)"
    try:
        for name in COMPARISONS:
            if name in only:
                _run_one(s, name, tokenizer, out_dir, machine, merged, results_path)
    finally:
        finish_stops()  # no cluster outlives the run
    log(f"wrote {results_path} and {out_dir / 'results.md'}")
    return merged


def _run_one(s: Settings, name: str, tokenizer: Tokenizer | None, out_dir: Path, machine: str,
             merged: dict[str, Any], results_path: Path) -> None:
    """One comparison, merged into `merged` and written out."""
    log(f"--- {name}")
    t0 = time.monotonic()
    if name == "disagg":
        result = compare_disagg(s, tokenizer, out_dir)
    elif name == "prefix":
        result = compare_prefix(s, tokenizer, out_dir)
    else:
        finish_stops()  # these measure from their first second: nothing else may be running
        if name == "elastic":
            result = compare_elastic(s, tokenizer, out_dir)
        else:
            result = compare_offline(s, out_dir)
    result.update(command=s.command, model=s.model, quick=s.quick, machine=machine,
                  elapsed_s=time.monotonic() - t0, seed=s.seed,
                  finished_at=time.strftime("%Y-%m-%d %H:%M:%S"))
    merged[name] = result
    results_path.write_text(json.dumps({"comparisons": merged}, indent=1))
    (out_dir / "results.md").write_text(results_md(merged))
    for t in result["targets"]:
        log(f"{name}: {t['metric']} = {_f(t['measured'], 2)} ({t['target']}): {t['result']}")


def _only(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = sorted(set(names) - set(COMPARISONS))
    if bad or not names:
        raise argparse.ArgumentTypeError(f"choose from {','.join(COMPARISONS)}, not {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(
        prog="python -m pdserve.bench.compare",
        description="Run pdserve's comparisons on real local clusters (disaggregated vs "
                    "colocated, prefix caching on vs off, offline engine vs transformers) and "
                    "write results.json, results.md and PNG plots. The full run takes about "
                    "25 minutes on 2 cores; --quick about 4.")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK['disagg_requests']} requests at rates "
                        f"{','.join(map(str, QUICK['disagg_rates']))}, "
                        f"{QUICK['prefix_requests']} prefix requests, "
                        f"{QUICK['offline_requests']} offline requests")
    p.add_argument("--only", type=_only, default=list(DEFAULT_COMPARISONS), metavar="LIST",
                   help=f"comma-separated subset of {','.join(COMPARISONS)} (default: "
                        f"{','.join(DEFAULT_COMPARISONS)})")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where results go (default docs/bench; docs/bench/quick with --quick)")
    p.add_argument("--model", default=d.model, help=f"model for every worker (default {d.model})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"workload seed (default {d.seed})")
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo_ms, metavar="MS",
                   help=f"TTFT SLO for goodput (default {d.ttft_slo_ms:g}: the longest "
                        "(2048-token) prompt's prefill on one core plus a little queueing)")
    p.add_argument("--tpot-slo", type=float, default=d.tpot_slo_ms, metavar="MS",
                   help=f"TPOT SLO for goodput (default {d.tpot_slo_ms:g}: ~2.5x an "
                        "undisturbed decode step of ~10 sequences on one core; a long prefill "
                        "chunk in the same step breaks it)")
    p.add_argument("--rates", type=float, nargs="+", metavar="RATE",
                   help="disagg rate sweep in req/s (default "
                        f"{' '.join(map(str, d.disagg_rates))})")
    p.add_argument("--conditional-threshold", type=int, default=d.conditional_threshold,
                   metavar="TOKENS",
                   help="disagg comparison: also run the disaggregated layout with prompts "
                        "shorter than TOKENS prefilled on the decode worker (default "
                        f"{d.conditional_threshold}; 0 leaves this layout out)")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help=f"requests per disagg run (default {d.disagg_requests}) and prefix run "
                        f"(default {d.prefix_requests})")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"],
                   help=f"workers' dtype for the disagg and prefix comparisons "
                        f"(default {d.dtype})")
    p.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                   help=f"KV cache per worker (default {d.kv_cache_memory})")
    e = d.elastic
    p.add_argument("--phase-seconds", type=float, default=e.phase_s, metavar="S",
                   help=f"elastic: length of each of the two phases (default {e.phase_s:g})")
    p.add_argument("--elastic-rates", type=float, nargs=2, metavar=("PROMPT", "OUTPUT"),
                   default=(e.prompt_rate, e.output_rate),
                   help="elastic: req/s of the long-prompt and the long-output phase "
                        f"(default {e.prompt_rate:g} {e.output_rate:g})")
    p.add_argument("--elastic-lengths", type=int, nargs=2, metavar=("PROMPT", "OUTPUT"),
                   default=(e.prompt_len, e.output_len),
                   help="elastic: prompt tokens of the long-prompt phase and output tokens "
                        f"of the long-output phase (default {e.prompt_len} {e.output_len})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    s = Settings(model=a.model, seed=a.seed, ttft_slo_ms=a.ttft_slo, tpot_slo_ms=a.tpot_slo,
                 kv_cache_memory=a.kv_cache_memory, dtype=a.dtype,
                 progress=not a.no_progress,
                 command=shlex.join(["python", "-m", "pdserve.bench.compare", *argv]))
    if a.quick:
        s = dataclasses.replace(s, quick=True, **QUICK)
    if a.rates:
        if not all(r > 0 and math.isfinite(r) for r in a.rates):
            print("pdserve.bench.compare: --rates must be finite and > 0", file=sys.stderr)
            return 2
        s = dataclasses.replace(s, disagg_rates=tuple(a.rates))
    if a.requests:
        s = dataclasses.replace(s, disagg_requests=a.requests, prefix_requests=a.requests)
    if a.conditional_threshold < 0:
        print("pdserve.bench.compare: --conditional-threshold must be >= 0", file=sys.stderr)
        return 2
    s = dataclasses.replace(s, conditional_threshold=a.conditional_threshold)
    if not (a.phase_seconds > 0 and all(r > 0 and math.isfinite(r) for r in a.elastic_rates)
            and min(a.elastic_lengths) >= 1):
        print("pdserve.bench.compare: --phase-seconds, --elastic-rates and --elastic-lengths "
              "must be > 0", file=sys.stderr)
        return 2
    s = dataclasses.replace(s, elastic=dataclasses.replace(
        s.elastic, phase_s=a.phase_seconds, prompt_rate=a.elastic_rates[0],
        output_rate=a.elastic_rates[1], prompt_len=a.elastic_lengths[0],
        output_len=a.elastic_lengths[1]))
    out_dir = a.out_dir or Path("docs/bench/quick" if a.quick else "docs/bench")
    run(s, a.only, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
