"""Netns topology against loopback: the same cluster and workload, two networks.

    python -m pdserve.bench.netns [--num-requests 16] [--rate 1] [--input-len 512]
                                  [--output-len 32] [--out docs/bench/netns.json]

Root only (it creates network namespaces, `pdserve.netns`). Starts one gateway (every
request disaggregated: `--disagg-threshold 0`), one prefill and one decode worker with
the tier commands (`pdserve.cli gateway | prefill | decode`), each a process of its own,
twice:

- loopback: every process in this namespace on 127.0.0.1;
- netns: every process in its own namespace with its own address on one bridge (veth
  pairs), the load generator in a fourth;

and runs the same seeded `pdserve bench` workload (fixed prompt and output lengths,
Poisson arrivals at `--rate`) against each in turn, then reports TTFT and TPOT p50/p99 and
the KV bytes the decode worker received (`pdserve:kv_received_bytes_total`). The load
generator runs in the client's namespace through this module's `client` subcommand.

What it isolates: the network path only (veth + bridge against loopback). Both runs share
the machine's cores, so on a shared machine the spread between repeated runs of one layout
can exceed the difference between the layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.report_io import emit_report

GRPC_PORT, HTTP_PORT, REGISTRY_PORT = 47051, 47080, 47052
PREFILL_PORT, DECODE_PORT = 47061, 47062
PREFILL_METRICS, DECODE_METRICS = 47091, 47092
NAMES = ("gateway", "prefill", "decode", "client")


def _argv(name: str, addr: dict[str, str], model: str) -> list[str]:
    cli = [sys.executable, "-m", "pdserve.cli"]
    if name == "gateway":
        return [*cli, "gateway", "--model", model, "--host", addr[name],
                "--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT),
                "--registry-port", str(REGISTRY_PORT), "--disagg-threshold", "0"]
    port, metrics = ((PREFILL_PORT, PREFILL_METRICS) if name == "prefill"
                     else (DECODE_PORT, DECODE_METRICS))
    return [*cli, name, "--model", model, "--host", addr[name], "--port", str(port),
            "--advertise-address", f"{addr[name]}:{port}", "--metrics-port", str(metrics),
            "--gateway", f"{addr['gateway']}:{REGISTRY_PORT}", "--worker-id", name,
            "--threads", "1"]


def _client_argv(addr: dict[str, str], a: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "pdserve.bench.netns", "client",
            "--gateway", f"{addr['gateway']}:{GRPC_PORT}",
            "--metrics", f"http://{addr['decode']}:{DECODE_METRICS}/metrics",
            "--num-requests", str(a.num_requests), "--rate", str(a.rate),
            "--input-len", str(a.input_len), "--output-len", str(a.output_len)]


def _layout(kind: str, a: argparse.Namespace, log_dir: Path) -> dict:
    """Starts the cluster in `kind` ("loopback" | "netns"), runs the client, stops it."""
    from pdserve.netns import Topology

    if kind == "netns":
        topo = Topology(NAMES).create()
        addr = {n: topo.address(n) for n in NAMES}
        env = topo.env()
    else:
        topo = None
        addr = dict.fromkeys(NAMES, "127.0.0.1")
        env = Topology(NAMES).env()  # the same environment, no namespace made
    procs: list[subprocess.Popen] = []
    try:
        for name in NAMES[:3]:
            log = log_dir / f"{kind}-{name}.log"
            if topo is not None:
                procs.append(topo.spawn(name, _argv(name, addr, a.model), log))
            else:
                with open(log, "wb") as out:
                    procs.append(subprocess.Popen(
                        _argv(name, addr, a.model), env=env, stdout=out,
                        stderr=subprocess.STDOUT, start_new_session=True))
        argv = _client_argv(addr, a)
        if topo is not None:
            r = subprocess.run(["ip", "netns", "exec", topo.host("client").netns, *argv],
                               env=env, capture_output=True, text=True, timeout=a.timeout)
        else:
            r = subprocess.run(argv, env=env, capture_output=True, text=True,
                               timeout=a.timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{kind} client failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        if topo is not None:
            topo.close()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
            p.wait()


def _client(a: argparse.Namespace) -> int:
    """Inside the client's namespace: wait for the cluster, run the workload, read the KV
    bytes; prints one JSON line."""
    import asyncio

    from pdserve.bench import loadgen
    from pdserve.client import PdserveClient

    async def ready() -> None:
        end = time.monotonic() + a.timeout
        async with PdserveClient(a.gateway) as c:
            while time.monotonic() < end:
                try:
                    if any(m.num_prefill_workers and m.num_decode_workers
                           for m in await c.list_models()):
                        return
                except Exception:  # not up yet
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{a.gateway} not ready in {a.timeout} s")

    def kv_bytes() -> float:
        with urllib.request.urlopen(a.metrics, timeout=10) as r:
            text = r.read().decode()
        m = re.search(r"^pdserve:kv_received_bytes_total\{[^}]*\} (\S+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    asyncio.run(ready())
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "runs.json"
        rc = loadgen.main(["--grpc", a.gateway, "--workload", "fixed",
                           "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                           "--num-requests", str(a.num_requests), "--rate", str(a.rate),
                           "--seed", "0", "--no-progress", "--out", str(out)])
        run = json.loads(out.read_text())["runs"][0]
    report = run.get("report", run)
    print(json.dumps({"rc": rc, "kv_bytes": kv_bytes(), "report": report}))
    return 0


def _row(kind: str, res: dict) -> dict:
    rep = res["report"]
    return {"layout": kind, "completed": rep.get("completed"),
            "num_requests": rep.get("num_requests"),
            "ttft_ms_p50": rep["ttft_ms"]["p50"], "ttft_ms_p99": rep["ttft_ms"]["p99"],
            "tpot_ms_p50": rep["tpot_ms"]["p50"], "tpot_ms_p99": rep["tpot_ms"]["p99"],
            "kv_bytes": res["kv_bytes"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.netns",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    for q in (p, c := sub.add_parser("client", help="(internal) the load generator side")):
        q.add_argument("--num-requests", type=int, default=16)
        q.add_argument("--rate", type=float, default=1.0)
        q.add_argument("--input-len", type=int, default=512)
        q.add_argument("--output-len", type=int, default=32)
        q.add_argument("--timeout", type=float, default=600.0)
    c.add_argument("--gateway", required=True)
    c.add_argument("--metrics", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layouts", default="loopback,netns")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.cmd == "client":
        return _client(a)
    from pdserve.netns import unavailable

    reason = unavailable()
    if reason:
        p.error(f"needs network namespaces: {reason}")
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for kind in a.layouts.split(","):
            print(f"{kind} ...", file=sys.stderr)
            rows.append(_row(kind, _layout(kind, a, Path(logs))))
    emit_report({"command": "python -m pdserve.bench.netns " + " ".join(argv or sys.argv[1:]),
                 "rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
