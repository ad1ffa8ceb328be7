"""`pdserve up`: a whole cluster on this machine (gateway, prefill and decode workers as
child processes) until Ctrl-C or SIGTERM. Unless --prefill says otherwise, the layout is
chosen for the cores it may use (`pdserve.cluster.choose_layout`) and printed with its
reason. A child that exits is restarted with backoff; the cluster stops only on a signal or
when a child keeps dying. The supervision itself is
`pdserve.cluster`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time

from pdserve.cluster import (
    DISAGG_MIN_CORES,
    ClusterConfig,
    ClusterError,
    Endpoints,
    HealthStatus,
    Layout,
    LocalCluster,
    choose_layout,
    parse_cpu_spec,
)
from pdserve.engine_args import add_engine_args, engine_argv
from pdserve.worker_runtime import int_at_least

__all__ = ["register"]

STOP_MARGIN_S = 2.0  # of --grace, for a process to stop once its drain is over


def drain_flags(grace_s: float) -> dict[str, tuple[str, ...]]:
    """Each tier's flags that bound its drain on SIGTERM to fit in `pdserve up`'s grace
    (the workers' own default, 55 s, is the manifests' and would be cut short here)."""
    s = f"{max(0.0, grace_s - STOP_MARGIN_S):g}"
    return {"gateway": ("--grace", s), "prefill": ("--drain-timeout", s),
            "decode": ("--drain-timeout", s)}


_nonneg_int = int_at_least(0)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "up", help="run a gateway, prefill and decode workers on this machine",
        description="Start the gateway and the workers as local processes (all on 127.0.0.1), "
                    "wait until every one is healthy (the gateway only once it can route a "
                    "request), print the endpoints, restart any that exits (with backoff; "
                    "one that keeps dying stops the cluster), and stop them all on Ctrl-C or "
                    "SIGTERM. Engine flags go to every worker.")
    p.add_argument("--prefill", type=_nonneg_int, default=None, metavar="N",
                   help="prefill workers (0 = no prefill tier: colocated). Default: chosen "
                        f"for this machine: 0 below {DISAGG_MIN_CORES} usable cores, where a "
                        "prefill worker costs decoding more than it saves, else 1; the choice "
                        "and its reason are printed at start-up")
    p.add_argument("--decode", type=_nonneg_int, default=1, metavar="M",
                   help="decode workers (default 1)")
    p.add_argument("--http-port", type=_nonneg_int, default=8000,
                   help="gateway OpenAI HTTP port (default 8000; 0 = any free port)")
    p.add_argument("--grpc-port", type=_nonneg_int, default=50051,
                   help="gateway gRPC port (default 50051; 0 = any free port); workers take "
                        "free ports above the gateway's")
    p.add_argument("--registry-port", type=_nonneg_int, default=None,
                   help="the gateway's internal registry port, where workers register "
                        "(default: --grpc-port + 1, any free port when that is 0; 0 = any "
                        "free port). Every process gets one cluster "
                        "token, PDSERVE_CLUSTER_TOKEN from this environment or a new random "
                        "one, in its environment")
    p.add_argument("--disagg-threshold", type=_nonneg_int, default=None, metavar="N",
                   help="passed to the gateway: prompts shorter than N tokens are served "
                        "colocated (default: the gateway's)")
    p.add_argument("--cpus", default="auto", metavar="auto|none|SPEC",
                   help="pin workers to cores: 'auto' (default) splits this process's cores "
                        "between prefill and decode workers, 'none' pins nothing, a SPEC such "
                        "as 'prefill=0,decode=1' or 'prefill=0-3,decode=4-7' names each tier's "
                        "cores. Pinned workers get --threads = their cores unless --threads "
                        "is given. 'auto' gives the gateway a core of its own from three "
                        "cores up; below, it runs on the decode worker's cores but its first, "
                        "which that worker keeps for its engine's step thread and event loop. "
                        "Under 'none' or a SPEC that does not name it, the gateway is not "
                        "pinned.")
    p.add_argument("--log-dir", default=None,
                   help="where each process logs (default: a new temporary directory)")
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for every process to be healthy (default 600)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL on shutdown (default 10). The "
                        f"processes are told to finish in-flight requests within S - "
                        f"{STOP_MARGIN_S:g} (their drain timeout), so the drain ends "
                        "before the SIGKILL rather than the workers' own 55 s default")
    p.add_argument("--stream-interval", type=int_at_least(1), default=1, metavar="N",
                   help="passed to the decode workers: a request's tokens go out N at a time "
                        "(its first token and its end at once), so N tokens cost one message "
                        "through the tiers and the client's stream; ITL comes in steps of N "
                        "(default 1: every token as it comes)")
    p.add_argument("--decode-streams", choices=("session", "per-request"), default="session",
                   help="passed to the gateway: 'session' (default) carries its token streams "
                        "from a decode worker on one call, a step's tokens in one message; "
                        "'per-request' opens a call per request")
    add_engine_args(p)
    p.set_defaults(func=_cmd_up)


class _Progress:
    """One line on stderr: rewritten in place on a terminal, every few seconds otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""
        self.last_t = 0.0

    def __call__(self, s: HealthStatus) -> None:
        tiers = ", ".join(f"{t} {r}/{n}" for t, (r, n) in s.ready.items())
        loading = ", ".join(s.loading) or "worker registration"
        line = f"starting: {tiers} ready; waiting for {loading} ({s.elapsed_s:.0f}s)"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
        elif line.split(" (")[0] != self.last.split(" (")[0] or time.monotonic() - self.last_t > 5:
            print(line, file=sys.stderr, flush=True)
            self.last_t = time.monotonic()
        self.last = line

    def done(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _cores(cpus: tuple[int, ...] | None) -> str:
    return ",".join(map(str, cpus)) if cpus else "any"


def format_endpoints(e: Endpoints, model: str, log_dir: str, layout: Layout | None = None
                     ) -> str:
    lines = [f"pdserve is up (model {model})"]
    if layout is not None:
        lines.append(f"  layout       {layout.describe()}")
    lines += [f"  OpenAI HTTP  {e.http_url}/v1   metrics {e.metrics_url}   pid {e.gateway_pid}   "
              f"cpus {_cores(e.gateway_cpus)}",
              f"  gRPC         {e.grpc_address}   registry {e.registry_address} (token only)"]
    for w in e.workers:
        lines.append(f"  {w.name:<12} {w.address}   metrics {w.metrics_url}   pid {w.pid}   "
                     f"cpus {_cores(w.cpus)}")
    lines.append(f"  logs         {log_dir}")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    curl = (f"  curl -s {e.http_url}/v1/chat/completions "
            f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")
    lines += ["try:", curl, "Ctrl-C stops everything."]
    return "\n".join(lines)


def usable_cores(cpus: str) -> int:
    """The cores the cluster will run on: those a --cpus SPEC names, else this process's."""
    if cpus not in ("auto", "none"):
        return len({c for cores in parse_cpu_spec(cpus).values() for c in cores})
    return len(os.sched_getaffinity(0))


def _cmd_up(a: argparse.Namespace) -> int:
    try:
        layout = choose_layout(usable_cores(a.cpus), a.prefill, a.decode)
        drain = drain_flags(a.grace)
        cfg = ClusterConfig(
            model=a.model, num_prefill=layout.num_prefill, num_decode=layout.num_decode,
            http_port=a.http_port,
            grpc_port=a.grpc_port, registry_port=a.registry_port,
            disagg_threshold=a.disagg_threshold,
            engine_args=tuple(engine_argv(a)), cpus=a.cpus, log_dir=a.log_dir,
            gateway_args=(*drain["gateway"], *(("--decode-streams", a.decode_streams)
                                               if a.decode_streams != "session" else ())),
            prefill_args=drain["prefill"],
            decode_args=(*drain["decode"], *(("--stream-interval", str(a.stream_interval))
                                               if a.stream_interval != 1 else ())))
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    cluster = LocalCluster(cfg)
    print(f"pdserve up: logs in {cluster.log_dir}", file=sys.stderr, flush=True)
    print(f"pdserve up: layout {layout.describe()}", file=sys.stderr, flush=True)

    def on_signal(signum, frame) -> None:
        raise KeyboardInterrupt

    def on_signal_while_stopping(signum, frame) -> None:
        cluster.kill_now.set()  # a second Ctrl-C: no more grace, SIGKILL now

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = _Progress()
    rc = 0
    try:
        cluster.start()
        endpoints = cluster.wait_healthy(a.startup_timeout, progress)
        progress.done()
        print(format_endpoints(endpoints, a.model, str(cluster.log_dir), layout), flush=True)
        while True:
            time.sleep(1.0)
            cluster.supervise(lambda line: print(f"pdserve up: {line}", file=sys.stderr,
                                                 flush=True))
    except (ClusterError, ValueError) as e:
        progress.done()
        print(f"pdserve up: {e}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        progress.done()
    finally:
        for s in old:
            signal.signal(s, on_signal_while_stopping)
        print("pdserve up: stopping ...", file=sys.stderr, flush=True)
        cluster.stop(grace=a.grace)
        for s, h in old.items():
            signal.signal(s, h)
    print("pdserve up: stopped", file=sys.stderr, flush=True)
    return rc
