"""One peers run: each system in turn, alone, on the same seeded workloads.

For each system of `RunSettings.systems`:

1. the CPU guard waits (bounded) until foreign CPU is at most the bound, and records that
   and the load average;
2. the system starts in its own session on a free port (its stdout/stderr in
   `<out-dir>/logs/<system>.log`), and `/health` is polled until 200, at most
   `startup_timeout_s`, with progress every 10 s; its tree's peak RSS is sampled from then
   on;
3. two short warm-up requests (other text, other seed) go first;
4. before each workload the prefix cache is emptied — an HTTP call (vLLM's
   `/reset_prefix_cache`) or a restart (pdserve, llama-server; see
   `pdserve.bench.peers_systems`) — and the workload is replayed by `pdserve.bench.runner` through
   `OpenAIHTTPClient` (`/v1/completions`, streamed, `temperature` 0, `ignore_eos`, usage in
   the last message): TPOT per output token counts the server's usage; requests not done
   by the workload's time limit (arrival window + `drain_s`) are lost;
5. SIGTERM to its PID, SIGKILL to what is left of its tree after a grace.

A system that fails to start is recorded with its error and the run goes on. After each
system, `peers.json` (merged into an existing one by system) and `peers.md` are rewritten.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import platform
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.clients import OpenAIHTTPClient
from pdserve.bench.peers_build import PeerPaths, say
from pdserve.bench.peers_host import PeakRSS, descendants, wait_quiet
from pdserve.bench.peers_report import render_markdown
from pdserve.bench.peers_systems import (
    MODEL,
    SYSTEMS,
    Launch,
    System,
    build_step,
    launch,
    missing,
    reset_requests,
)
from pdserve.bench.peers_workloads import WORKLOADS, PeerWorkload
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workloads import BenchRequest, make_workload
from pdserve.cluster import free_port

STOP_GRACE_S = 30.0
GREEDY = {"temperature": 0.0}


class NotBuilt(RuntimeError):
    """A system of the run needs something `build` makes; the message is one line."""


class StartError(RuntimeError):
    """A system did not become healthy."""


@dataclass(frozen=True)
class RunSettings:
    systems: tuple[str, ...]
    workloads: tuple[str, ...]
    seed: int = 0
    startup_timeout_s: float = 600.0
    guard_timeout_s: float = 300.0
    guard_cpu_pct: float = 5.0
    drain_s: float = 600.0
    progress: bool = True
    command: str = "python -m pdserve.bench.peers run"
    pdserve_args: tuple[str, ...] = ()  # appended to the pdserve systems' `pdserve up`


def check_built(paths: PeerPaths, names: tuple[str, ...]) -> None:
    """NotBuilt for the first system whose peer is not built, naming the build step."""
    for name in names:
        lacking = missing(SYSTEMS[name], paths)
        if lacking:
            raise NotBuilt(f"{name} is not built ({lacking[0]} is missing); run `python -m "
                           f"pdserve.bench.peers build --only {build_step(SYSTEMS[name])}`")


# ---------------------------------------------------------------------------- processes


class Server:
    """One started system: its process, its launch, its peak-RSS sampler."""

    def __init__(self, system: System, launch_: Launch, log_path: Path) -> None:
        self.system = system
        self.launch = launch_
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n$ {' '.join(launch_.argv)}\n".encode())
            self.proc = subprocess.Popen(
                launch_.argv, stdout=log, stderr=subprocess.STDOUT, cwd=launch_.cwd,
                env={**os.environ, **launch_.env}, start_new_session=True)
        self.rss = PeakRSS(self.proc.pid)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until `/health` answered 200; StartError on exit or timeout."""
        t0 = time.monotonic()
        last_log = t0
        while True:
            if self.proc.poll() is not None:
                raise StartError(f"{self.system.name} exited with {self.proc.returncode} "
                                 f"while starting; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.launch.health_url, timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while loading
            waited = time.monotonic() - t0
            if waited > timeout_s:
                raise StartError(f"{self.system.name} not healthy after {timeout_s:.0f}s; "
                                 f"see {self.log_path}")
            if time.monotonic() - last_log >= 10:
                say(f"{self.system.name}: waiting for {self.launch.health_url} ({waited:.0f}s)")
                last_log = time.monotonic()
            time.sleep(1.0)

    def stop(self) -> int:
        """SIGTERM to its PID; after STOP_GRACE_S, SIGKILL to every process left in its
        tree. The peak RSS seen."""
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.wait()
        return self.rss.stop()


def post(url: str) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


# ---------------------------------------------------------------------------- measuring


def warmup_requests(tokenizer: Any, seed: int) -> list[BenchRequest]:
    return make_workload("fixed", tokenizer, 2, seed + 10_007, input_len=64, output_len=4)


async def _replay(s: RunSettings, base_url: str, w: PeerWorkload,
                  requests: list[BenchRequest], label: str) -> dict[str, Any]:
    limit = max(r.arrival_s for r in requests) + s.drain_s
    async with OpenAIHTTPClient(base_url, MODEL, endpoint="completions",
                                extra_body=GREEDY) as client:
        result = await run_benchmark(client, requests, label=label, rate=w.rate,
                                     time_limit_s=limit, ttft_slo_s=w.ttft_slo_s,
                                     tpot_slo_s=w.tpot_slo_s, progress=s.progress)
    out = result.to_dict()
    r = result.report
    out["lost"] = r.failed
    say(f"{label}: ok {r.completed}/{r.num_requests}, {r.output_throughput:.1f} out tok/s, "
        f"TTFT p50 {r.ttft_ms.p50}, TPOT p50 {r.tpot_ms.p50}, short {r.short_outputs}")
    return out


async def _warm(base_url: str, requests: list[BenchRequest], timeout_s: float) -> None:
    async with OpenAIHTTPClient(base_url, MODEL, endpoint="completions",
                                extra_body=GREEDY) as client:
        for req in requests:
            rec = await client.run(req, timeout=timeout_s)
            if not rec.ok:
                say(f"warm-up request failed: {rec.error}")


def measure_system(paths: PeerPaths, s: RunSettings, system: System, tokenizer: Any,
                   requests: dict[str, list[BenchRequest]], log_dir: Path) -> dict[str, Any]:
    """Guard, start, warm up, replay each workload, stop: one system's result dict."""
    say(f"--- {system.name}: CPU guard (foreign CPU <= {s.guard_cpu_pct:g}%)")
    guard = wait_quiet(s.guard_cpu_pct, s.guard_timeout_s, say)
    if not guard.quiet:
        say(f"{system.name}: machine not quiet after {guard.waited_s:.0f}s (foreign CPU "
            f"{guard.foreign_cpu_pct:.0f}%); measuring anyway")
    out: dict[str, Any] = {"system": dataclasses.asdict(system), "guard": guard.to_dict(),
                           "workloads": {}, "startup_s": [], "peak_rss_bytes": 0,
                           "error": None, "finished_at": None}
    server: Server | None = None
    warmup = warmup_requests(tokenizer, s.seed)

    def start() -> Server:
        srv = Server(system, launch(system, paths, free_port(), s.pdserve_args),
                     log_dir / f"{system.name}.log")
        out["command"] = " ".join(srv.launch.argv)
        out["env"] = srv.launch.env
        say(f"{system.name}: starting: {out['command']}")
        try:
            took = srv.wait_healthy(s.startup_timeout_s)
        except StartError:
            out["peak_rss_bytes"] = max(out["peak_rss_bytes"], srv.stop())
            raise
        out["startup_s"].append(round(took, 1))
        say(f"{system.name}: healthy after {took:.0f}s")
        asyncio.run(_warm(srv.launch.base_url, warmup, s.startup_timeout_s))
        return srv

    try:
        for key in s.workloads:
            if server is None:
                server = start()
                reset = "fresh start"
            elif system.reset == "restart":
                rss, server = server.stop(), None
                out["peak_rss_bytes"] = max(out["peak_rss_bytes"], rss)
                server = start()
                reset = "restart"
            else:
                reset = "none"
            urls = reset_requests(system, server.launch.base_url)
            if urls:
                codes = {post(u) for u in urls}
                reset = f"{reset} + reset ({'ok' if codes == {200} else sorted(codes)})"
            w = WORKLOADS[key]
            say(f"{system.name}: workload {key} ({w.title}), prefix cache: {reset}")
            res = asyncio.run(_replay(s, server.launch.base_url, w, requests[key],
                                      f"{system.name}/{key}"))
            out["workloads"][key] = dict(res, prefix_cache=reset)
    except StartError as e:
        out["error"] = str(e)
        say(f"{system.name}: {e}")
    finally:
        if server is not None:
            out["peak_rss_bytes"] = max(out["peak_rss_bytes"], server.stop())
    out["loadavg_after"] = os.getloadavg()
    out["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def workload_dict(w: PeerWorkload) -> dict[str, Any]:
    """JSON-ready (no infinity: all-at-once is a rate of None)."""
    return dict(dataclasses.asdict(w), params=dict(w.params),
                rate=None if math.isinf(w.rate) else w.rate)


def run(paths: PeerPaths, s: RunSettings, out_dir: Path) -> dict[str, Any]:
    """Measure every system of `s` (see the module doc); the merged results."""
    check_built(paths, s.systems)
    from pdserve.engine.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    requests = {k: WORKLOADS[k].requests(tokenizer, s.seed) for k in s.workloads}
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "peers.json"
    merged: dict[str, Any] = {}
    if json_path.exists():
        merged = json.loads(json_path.read_text()).get("systems", {})
    doc: dict[str, Any] = {}
    for name in s.systems:
        merged[name] = measure_system(paths, s, SYSTEMS[name], tokenizer, requests,
                                      out_dir / "logs")
        merged[name]["run_command"] = s.command
        doc = {"command": s.command, "seed": s.seed,
               "machine": f"{platform.node()} ({len(os.sched_getaffinity(0))} cores usable, "
                          f"{cpu_model()})",
               "workloads": {k: workload_dict(w) for k, w in WORKLOADS.items()},
               "prompt_tokens": {k: sum(r.prompt_tokens for r in v)
                                 for k, v in requests.items()},
               "systems": merged}
        json_path.write_text(json.dumps(doc, indent=1))
        (out_dir / "peers.md").write_text(render_markdown(doc))
    say(f"wrote {json_path} and {out_dir / 'peers.md'}")
    return doc
