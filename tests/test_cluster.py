"""Tests for pdserve.cluster and `pdserve up`: CPU assignment, engine-flag passthrough, the
`up` help, process supervision against stand-in tiers (tiny gRPC health servers, so they run
in seconds and whether or not the real services exist), and a real small cluster with the
tiny model (skipped until gateway/, prefill_worker/ and decode_worker/ are runnable)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.bench.thread_cpu import threads_cpu
from pdserve.cli import build_parser
from pdserve.cluster import (
    MODULES,
    SHARED_CORE_SPINCOUNT,
    ClusterConfig,
    ClusterError,
    LocalCluster,
    assign_cpus,
    choose_layout,
    free_ports,
    parse_cpu_spec,
    pins_step_thread,
)
from pdserve.engine_args import engine_argv, engine_config_from_args
from pdserve.event_loop import loop_name
from pdserve.os_thread import ENGINE_THREAD_NAME

# ---------------------------------------------------------------------------- pure logic


def test_cpu_spec_parsing():
    assert parse_cpu_spec("prefill=0,decode=1") == {"prefill": [0], "decode": [1]}
    assert parse_cpu_spec("prefill=0-2,decode=3,5") == {"prefill": [0, 1, 2], "decode": [3, 5]}
    with pytest.raises(ValueError, match="unknown tier"):
        parse_cpu_spec("encode=0")
    with pytest.raises(ValueError, match="must start with"):
        parse_cpu_spec("0,1")


def test_assign_cpus_auto_splits_tiers():
    a = assign_cpus("auto", 1, 1, available=[0, 1])
    assert a == {"gateway": [None], "prefill": [(0,)], "decode": [(1,)]}
    # three or more cores: the gateway gets the last one to itself, workers split the rest
    a = assign_cpus("auto", 1, 3, available=range(9))
    assert a["gateway"] == [(8,)]
    assert a["prefill"] == [(0, 1)] and a["decode"] == [(2, 3), (4, 5), (6, 7)]
    a = assign_cpus("auto", 2, 3, available=[0, 1])  # more workers than cores: they share
    assert a["prefill"] == [(0,), (0,)] and a["decode"] == [(1,), (1,), (1,)]
    a = assign_cpus("auto", 0, 2, available=[0, 1, 2, 3, 4])
    assert a["prefill"] == [] and a["decode"] == [(0, 1), (2, 3)] and a["gateway"] == [(4,)]
    # colocated on two cores: both decode's, the gateway beside its engine's other thread
    a = assign_cpus("auto", 0, 1, available=[0, 1])
    assert a == {"gateway": [(1,)], "prefill": [], "decode": [(0, 1)]}
    assert assign_cpus("auto", 0, 1, available=[3])["gateway"] == [None]  # one core: no pins
    assert assign_cpus("auto", 0, 2, available=[0, 1])["gateway"] == [None]  # a core each


def test_a_worker_pins_its_step_thread_where_the_gateway_shares_its_other_cores(tmp_path):
    assert pins_step_thread((0, 1), (1,)) and pins_step_thread((4, 5, 6), (5, 6))
    assert not pins_step_thread((0, 1), None)  # the gateway anywhere: nothing to keep off
    assert not pins_step_thread((0, 1), (0,))  # on the first core itself
    assert not pins_step_thread((0, 1), (1, 2))  # partly elsewhere
    assert not pins_step_thread((1,), (1,)) and not pins_step_thread(None, (1,))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    shared = f"decode={cores[0]},{cores[1]},gateway={cores[1]}"
    for spec, pinned in ((shared, True), (f"decode={cores[0]},{cores[1]}", False),
                         ("none", False)):
        c = LocalCluster(model="m", num_prefill=0, http_port=0, grpc_port=0, cpus=spec,
                         log_dir=str(tmp_path))
        gateway, decode = c._plan()
        assert ("--pin-threads" in decode.argv) is pinned, spec
        assert "--pin-threads" not in gateway.argv


def test_layout_follows_the_cores_unless_asked():
    two = choose_layout(2)
    assert (two.num_prefill, two.num_decode, two.name) == (0, 1, "colocated")
    assert "2 core(s) < 4" in two.describe()
    eight = choose_layout(8)
    assert (eight.num_prefill, eight.num_decode, eight.name) == (1, 1, "disaggregated")
    asked = choose_layout(2, num_prefill=1, num_decode=2)
    assert (asked.num_prefill, asked.num_decode) == (1, 2) and "as asked" in asked.reason
    assert assign_cpus("none", 1, 1, available=[0, 1])["decode"] == [None]


def test_assign_cpus_spec():
    a = assign_cpus("prefill=0,decode=1", 1, 2, available=[0, 1])
    assert a == {"gateway": [None], "prefill": [(0,)], "decode": [(1,), (1,)]}
    with pytest.raises(ValueError, match="not available"):
        assign_cpus("prefill=0,decode=7", 1, 1, available=[0, 1])


def _up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_engine_flags_pass_through_to_workers():
    assert engine_argv(_up_args()) == []
    a = _up_args("--kv-cache-memory", "64MiB", "--no-prefix-caching", "--block-size", "32",
                 "--model", "x", "--prefill", "2")
    assert engine_argv(a) == ["--kv-cache-memory", "64MiB", "--block-size", "32",
                              "--no-prefix-caching"]
    a = _up_args("--kv-cache-dtype", "bfloat16")
    assert engine_argv(a) == ["--kv-cache-dtype", "bfloat16"]
    assert engine_config_from_args(a).cache_dtype == "bfloat16"
    assert engine_config_from_args(_up_args()).kv_cache_dtype is None  # auto: --dtype


def test_up_help_is_truthful():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--help"],
                         capture_output=True, text=True, check=True).stdout
    up = next(a for a in build_parser()._subparsers._group_actions[0].choices.items()
              if a[0] == "up")[1]
    flags = {s for act in up._actions for s in act.option_strings}
    shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", out))
    assert {"--prefill", "--decode", "--model", "--http-port", "--grpc-port",
            "--disagg-threshold", "--cpus", "--log-dir", "--kv-cache-memory",
            "--threads"} <= shown
    assert shown <= flags, f"help mentions flags the parser does not take: {shown - flags}"
    a = _up_args()
    assert (a.prefill, a.decode, a.http_port, a.grpc_port, a.cpus) == (None, 1, 8000, 50051,
                                                                       "auto")
    assert "Default: chosen" in out and "default 8000" in out and "default 50051" in out
    assert "'auto' (default)" in out


# ---------------------------------------------------------------------------- stand-in tiers

FAKE_TIER = textwrap.dedent('''
    """A stand-in tier: gRPC health (listening after FAKE_BIND_DELAY s, SERVING FAKE_DELAY s
    later) and, for the gateway, an HTTP /health. Records its argv, CPU affinity and when it
    turned SERVING; misbehaves on request."""
    import argparse, http.server, json, os, signal, subprocess, sys, threading, time
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    def main(tier):
        p = argparse.ArgumentParser()
        for f in ("--model", "--host", "--gateway", "--worker-id", "--metrics-port",
                  "--threads", "--kv-cache-memory", "--disagg-threshold", "--grace",
                  "--drain-timeout"):
            p.add_argument(f)
        for f in ("--port", "--grpc-port", "--http-port", "--registry-port"):
            p.add_argument(f, type=int)
        a = p.parse_args()
        name = a.worker_id or tier
        out = os.environ["FAKE_OUT"]
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump({"argv": sys.argv[1:], "cpus": sorted(os.sched_getaffinity(0)),
                       "token": os.environ.get("PDSERVE_CLUSTER_TOKEN")}, f)
        if os.environ.get("FAKE_CRASH") == name:
            print("boom: cannot load the model", flush=True)
            sys.exit(3)
        if os.environ.get("FAKE_IGNORE_TERM") == name:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ.get("FAKE_GRANDCHILD") == name:
            g = subprocess.Popen(["sleep", "300"])
            with open(os.path.join(out, name + ".grandchild"), "w") as f:
                f.write(str(g.pid))
        time.sleep(float(os.environ.get("FAKE_BIND_DELAY", "0")))
        server = grpc.server(futures.ThreadPoolExecutor(4))
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        server.add_insecure_port(f"{a.host}:{a.port or a.grpc_port}")
        server.start()
        hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        if a.http_port:
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200 if self.path == "/health" else 404)
                    self.end_headers()
                def log_message(self, *args):
                    pass
            httpd = http.server.ThreadingHTTPServer((a.host, a.http_port), H)
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
        time.sleep(float(os.environ.get("FAKE_DELAY", "0.5")))
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        with open(os.path.join(out, name + ".serving"), "w") as f:
            f.write(repr(time.time()))
        print(name, "serving", flush=True)
        while True:
            time.sleep(1)
''')


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    """Stand-in tiers as `fake_<tier>` modules and as `pdserve.<tier package>` packages that
    shadow the real ones when this directory comes first on PYTHONPATH (a `pdserve` package
    here whose path continues into the real one, so `pdserve.cli` is still the real CLI)."""
    import pdserve

    (tmp_path / "_fake_tier.py").write_text(FAKE_TIER)
    shadow = tmp_path / "pdserve"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        f"__path__.append({pdserve.__path__[0]!r})\n__version__ = {pdserve.__version__!r}\n")
    for tier, module in MODULES.items():
        (tmp_path / f"fake_{tier}.py").write_text(
            f"from _fake_tier import main\nmain({tier!r})\n")
        pkg = shadow / module.split(".")[-1]
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "__main__.py").write_text(f"from _fake_tier import main\nmain({tier!r})\n")
    (tmp_path / "out").mkdir()
    return tmp_path


def _fake_cluster(fakes: Path, **kw) -> LocalCluster:
    env = {"PYTHONPATH": str(fakes), "FAKE_OUT": str(fakes / "out"), **kw.pop("env", {})}
    mods = tuple((t, f"fake_{t}") for t in ("gateway", "prefill", "decode"))
    return LocalCluster(ClusterConfig(http_port=0, grpc_port=0, modules=mods,
                                      env=tuple(env.items()), log_dir=str(fakes / "logs"), **kw))


def _gone(pid: int) -> bool:
    """No live process (zombies are dead) has this pid or belongs to its process group."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if fields[0] != "Z" and (int(entry.name) == pid or int(fields[2]) == pid):
            return False
    return True


def _recorded(fakes: Path, name: str) -> dict:
    return json.loads((fakes / "out" / f"{name}.json").read_text())


def test_local_cluster_starts_waits_and_stops(fakes):
    cluster = _fake_cluster(fakes, num_prefill=1, num_decode=2, cpus="auto",
                            engine_args=("--kv-cache-memory", "64MiB"),
                            env={"FAKE_GRANDCHILD": "decode-1"})
    seen = []
    try:
        cluster.start()
        e = cluster.wait_healthy(timeout=60, progress=seen.append, poll_s=0.1)
        assert [w.name for w in e.workers] == ["prefill-0", "decode-0", "decode-1"]
        gw_port = max(int(a.rsplit(":", 1)[1])
                      for a in (e.http_url, e.grpc_address, e.registry_address))
        ports = [int(w.address.rsplit(":", 1)[1]) for w in e.workers] + [
            int(w.metrics_url.split(":")[2].split("/")[0]) for w in e.workers]
        assert len(set(ports)) == len(ports) and min(ports) > gw_port
        with urllib.request.urlopen(f"{e.http_url}/health", timeout=5) as r:
            assert r.status == 200
        assert seen and seen[0].loading  # progress was reported while tiers were loading
        pf, d0 = _recorded(fakes, "prefill-0"), _recorded(fakes, "decode-0")
        avail = sorted(os.sched_getaffinity(0))
        assert pf["cpus"] == list(next(w.cpus for w in e.workers if w.name == "prefill-0"))
        if len(avail) >= 2:
            assert set(pf["cpus"]).isdisjoint(d0["cpus"])
        assert pf["argv"][pf["argv"].index("--threads") + 1] == str(len(pf["cpus"]))
        assert pf["argv"][pf["argv"].index("--kv-cache-memory") + 1] == "64MiB"
        # workers register on the internal registry port, not the public one
        assert pf["argv"][pf["argv"].index("--gateway") + 1] == e.registry_address
        assert e.registry_address != e.grpc_address
        gw = _recorded(fakes, "gateway")
        assert gw["argv"][gw["argv"].index("--registry-port") + 1] == \
            e.registry_address.rsplit(":", 1)[1]
        # one generated cluster token, handed over in the environment, never in argv
        tokens = {r["token"] for r in (gw, pf, d0)}
        assert tokens == {cluster.cluster_token} and len(cluster.cluster_token) >= 32
        assert not any(cluster.cluster_token in " ".join(r["argv"]) for r in (gw, pf, d0))
        assert _recorded(fakes, "gateway")["cpus"] == avail  # the gateway is not pinned
        grandchild = int((fakes / "out" / "decode-1.grandchild").read_text())
        pids = cluster.pids
    finally:
        cluster.stop(grace=5)
    assert len(pids) == 4 and all(_gone(p) for p in pids)
    assert _gone(grandchild), "a worker's own child outlived stop()"
    cluster.stop()  # idempotent


def test_wait_healthy_sees_late_listeners_within_a_second(fakes):
    # Tiers listen only after their imports (seconds): the health channels fail to connect
    # at first and must retry promptly. Under grpcio's iomgr client (pdserve's
    # GRPC_EXPERIMENTS) such a channel in a process polling nothing else retried only at
    # gRPC's 20 s connect timeout, so every `pdserve up` waited ~20 s for a cluster up in 5
    # (pdserve.rpc.RECONNECT_OPTIONS).
    cluster = _fake_cluster(fakes, num_prefill=1, num_decode=1, cpus="none",
                            env={"FAKE_BIND_DELAY": "2", "FAKE_DELAY": "0.2"})
    try:
        cluster.start()
        cluster.wait_healthy(timeout=60, poll_s=0.1)
        seen = time.time()
    finally:
        cluster.stop(grace=5)
    served = max(float((fakes / "out" / f"{n}.serving").read_text())
                 for n in ("gateway", "prefill-0", "decode-0"))
    assert seen - served < 2.5, f"healthy {seen - served:.1f}s after the last tier served"


def test_child_exit_fails_fast_with_its_log(fakes):
    cluster = _fake_cluster(fakes, env={"FAKE_CRASH": "decode-0", "FAKE_DELAY": "30"})
    t0 = time.monotonic()
    try:
        cluster.start()
        with pytest.raises(ClusterError, match=r"decode-0 exited with code 3(.|\n)*boom"):
            cluster.wait_healthy(timeout=60, poll_s=0.1)
        assert time.monotonic() - t0 < 20
    finally:
        cluster.stop(grace=5)
    assert all(_gone(p) for p in cluster.pids)


def test_stop_kills_a_child_that_ignores_sigterm(fakes):
    cluster = _fake_cluster(fakes, env={"FAKE_IGNORE_TERM": "prefill-0"})
    cluster.start()
    try:
        cluster.wait_healthy(timeout=60, poll_s=0.1)
    finally:
        t0 = time.monotonic()
        cluster.stop(grace=1.0)
    assert time.monotonic() - t0 < 10
    assert all(_gone(p) for p in cluster.pids)


def test_wait_healthy_times_out_naming_the_slow_tier(fakes):
    cluster = _fake_cluster(fakes, env={"FAKE_DELAY": "60"})
    cluster.start()
    try:
        with pytest.raises(ClusterError, match="not healthy after 2s, waiting for gateway"):
            cluster.wait_healthy(timeout=2, poll_s=0.1)
    finally:
        cluster.stop(grace=2)


def _run_up(cwd: Path, env: dict[str, str], *argv: str) -> tuple[subprocess.Popen, str]:
    """Start `pdserve up ...`, return it and its stdout up to the ready banner."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", *argv], cwd=cwd,
                            env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            break
    return proc, "".join(lines)


def _pids_in(banner: str) -> list[int]:
    return [int(p) for p in re.findall(r"pid (\d+)", banner)]


def test_pdserve_up_sigterm_stops_everything_and_exits_0(fakes):
    env = {"PYTHONPATH": str(fakes), "FAKE_OUT": str(fakes / "out")}
    proc, banner = _run_up(fakes, env, "--http-port", "0", "--grpc-port", "0",
                           "--prefill", "1", "--decode", "2", "--log-dir", str(fakes / "logs"),
                           "--grace", "12")
    try:
        assert "curl -s http://127.0.0.1:" in banner and "/v1/chat/completions" in banner, (
            banner + proc.stderr.read() if proc.poll() is not None else banner)
        for name in ("prefill-0", "decode-0", "decode-1"):
            assert name in banner
        pids = _pids_in(banner)
        assert len(pids) == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(_gone(p) for p in pids)
    assert "stopped" in proc.stderr.read()
    # each process drains within the grace, less the margin to stop (not the workers' 55 s)
    for name, flag in (("gateway", "--grace"), ("prefill-0", "--drain-timeout"),
                       ("decode-0", "--drain-timeout"), ("decode-1", "--drain-timeout")):
        argv = _recorded(fakes, name)["argv"]
        assert argv[argv.index(flag) + 1] == "10", (name, argv)


# ---------------------------------------------------------------------------- the real cluster


def test_real_cluster_serves_a_chat_completion(tiny_model_dir):
    cluster = LocalCluster(model=tiny_model_dir, http_port=0, grpc_port=0, cpus="none",
                           engine_args=("--kv-cache-memory", "64MiB"))
    try:
        cluster.start()
        e = cluster.wait_healthy(timeout=300)
        body = json.dumps({"model": tiny_model_dir, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hello!"}]}).encode()
        req = urllib.request.Request(f"{e.http_url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["message"]["role"] == "assistant"
        assert out["usage"]["completion_tokens"] >= 1
        pids = cluster.pids
        # every tier served on the event loop pdserve.event_loop chose for this machine
        for name in ("gateway", "prefill-0", "decode-0"):
            assert f"event loop: {loop_name()}" in cluster.log_path(name).read_text(), name
    finally:
        cluster.stop()
    assert len(pids) == 3 and all(_gone(p) for p in pids)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_step_thread_keeps_its_core_from_the_gateway_in_a_real_cluster(tiny_model_dir):
    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    cluster = LocalCluster(model=tiny_model_dir, num_prefill=0, http_port=0, grpc_port=0,
                           cpus=f"decode={c0},{c1},gateway={c1}",
                           engine_args=("--kv-cache-memory", "64MiB"))
    try:
        cluster.start()
        e = cluster.wait_healthy(timeout=300)
        body = json.dumps({"model": tiny_model_dir, "prompt": "Hello", "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{e.http_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
        decode = e.workers[0].pid

        def cores(tid: int) -> set[int]:
            return os.sched_getaffinity(tid)

        engine = sorted(t.tid for t in threads_cpu(decode) if t.name == ENGINE_THREAD_NAME)
        # the step thread (started first) and the event loop on c0; the team's other on c1
        assert [cores(t) for t in engine] == [{c0}, {c1}]
        assert cores(decode) == {c0}
        assert cores(e.gateway_pid) == {c1} and e.gateway_cpus == (c1,)
        assert f"engine step thread on core {c0}" in cluster.log_path("decode-0").read_text()
    finally:
        cluster.stop()


def test_workers_on_shared_cores_wait_passively(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    shared = LocalCluster(model="m", num_prefill=0, http_port=0, grpc_port=0, cpus="none",
                          log_dir=str(tmp_path))
    children = shared._plan()
    assert [dict(ch.env) for ch in children] == [
        {}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SHARED_CORE_SPINCOUNT)}]
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")  # the user's spin is kept, the policy added
    assert [dict(ch.env) for ch in shared._plan()] == [{}, {"OMP_WAIT_POLICY": "PASSIVE"}]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # every process on its own core: threads may spin
        own = LocalCluster(model="m", num_prefill=0, http_port=0, grpc_port=0,
                           cpus=f"gateway={cores[0]},decode={cores[1]}", log_dir=str(tmp_path))
        assert all(ch.env == () for ch in own._plan())
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice wins
    assert all(ch.env == () for ch in shared._plan())


def _ephemeral_floor() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(),
                    reason="reads Linux's ephemeral port range")
def test_picked_ports_stay_below_the_ephemeral_range(tmp_path):
    """An outgoing connection can take an ephemeral port between the pick and the child's
    bind (a CI run's gateway died with EADDRINUSE on its HTTP port that way)."""
    floor = _ephemeral_floor()
    c = LocalCluster(model="m", num_prefill=2, num_decode=2, http_port=0, grpc_port=0,
                     cpus="none", log_dir=str(tmp_path))
    children = c._plan()
    ep = c.endpoints
    ports = [int(ep.http_url.rsplit(":", 1)[1]), int(ep.grpc_address.rsplit(":", 1)[1]),
             int(ep.registry_address.rsplit(":", 1)[1])]
    for ch in children[1:]:
        argv = ch.argv
        ports += [int(argv[argv.index("--port") + 1]), int(argv[argv.index("--metrics-port") + 1])]
    assert len(ports) == 3 + 8 and len(set(ports)) == len(ports)
    assert all(p < floor for p in ports), (ports, floor)


def test_free_ports_skip_a_listening_port_and_honour_a_users_neighbourhood():
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_ports()[0]))
        held.listen()
        busy = held.getsockname()[1]
        got = free_ports("127.0.0.1", 2, start=busy)
        assert busy not in got and len(set(got)) == 2
        assert free_ports("127.0.0.1", 1, taken=frozenset({busy + 1}), start=busy)[0] != busy + 1
    # gateway ports the user put above the range: workers follow them upwards
    above = free_ports("127.0.0.1", 1, start=61000)[0]
    assert above >= 61000
