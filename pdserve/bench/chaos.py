"""Chaos: a fixed mixed load while workers die, stall and the gateway restarts.

    python -m pdserve.bench.chaos [--model smollm2-135m] [--duration 120] [--fault-every 20]

Life of a run (`main`): start a `LocalCluster` (1 prefill, 2 decode workers, conditional
disaggregation so the load mixes both paths) with a supervisor thread that restarts any
child that exits; replay the load once fault-free (the reference); then replay it at a
steady rate for `--duration` seconds while one fault from `FAULTS` fires every
`--fault-every` seconds, in turn; then report requests completed, errors by status, P99
TTFT/TPOT against the reference, KV blocks still held once the load is over, and whether
every greedy output equals the reference. A client whose gateway went away retries (that
is the contract: a clear status, then success against the restarted gateway).

The same pieces make the chaos suite (tests/test_chaos.py): `make_load`, `run_load`,
`inject`, `held_blocks`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.bench.metrics import percentile
from pdserve.client import PdserveClient
from pdserve.cluster import LocalCluster
from pdserve.cluster_auth import TOKEN_METADATA
from pdserve.protos.pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

FAULTS = ("kill-prefill", "kill-decode", "stop-prefill", "stop-decode", "restart-gateway")
RETRYABLE = frozenset({"UNAVAILABLE"})  # what a client retries (a gateway going away)


@dataclass(frozen=True)
class LoadRequest:
    index: int
    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class Outcome:
    """One request as the client saw it. `status` is the final one ("OK" or a gRPC status
    name); `failures` the statuses of attempts that failed before it."""

    index: int
    status: str = ""
    token_ids: tuple[int, ...] = ()
    ttft_s: float | None = None
    tpot_s: float | None = None
    failures: list[str] = field(default_factory=list)
    error: str = ""


def make_load(n: int = 32, seed: int = 0, min_prompt: int = 3, max_prompt: int = 80,
              min_tokens: int = 4, max_tokens: int = 12, vocab: int = 1000
              ) -> list[LoadRequest]:
    """The mixed load: varied prompt lengths (both sides of a disaggregation threshold in
    between) and output lengths, random token ids below `vocab`, fixed by `seed`."""
    rng = random.Random(seed)
    return [LoadRequest(i, tuple(rng.randrange(3, vocab)
                                 for _ in range(rng.randint(min_prompt, max_prompt))),
                        rng.randint(min_tokens, max_tokens)) for i in range(n)]


async def _one(address: str, req: LoadRequest, seed: int, retry_until: float,
               timeout_s: float) -> Outcome:
    out = Outcome(req.index)
    while True:
        t0 = time.perf_counter()
        times: list[float] = []
        ids: list[int] = []
        try:
            async with PdserveClient(address) as c:
                async for ch in c.generate(token_ids=req.token_ids, max_tokens=req.max_tokens,
                                           temperature=0, seed=seed, ignore_eos=True,
                                           timeout=timeout_s):
                    if ch.token_ids:
                        times.append(time.perf_counter())
                        ids.extend(ch.token_ids)
            out.status, out.token_ids = "OK", tuple(ids)
            if times:
                out.ttft_s = times[0] - t0
                if len(times) > 1:
                    out.tpot_s = (times[-1] - times[0]) / (len(times) - 1)
            return out
        except grpc.aio.AioRpcError as e:
            out.status, out.error = e.code().name, e.details() or ""
            if out.status not in RETRYABLE or time.monotonic() > retry_until:
                return out
            out.failures.append(out.status)
            await asyncio.sleep(0.5)


async def run_load(address: str, load: Sequence[LoadRequest], concurrency: int = 8,
                   rate: float | None = None, seed: int = 0, retry_s: float = 0.0,
                   timeout_s: float = 120.0) -> list[Outcome]:
    """Every request of `load` (at most `concurrency` at once; with `rate`, started at
    that many per second), each retried on UNAVAILABLE for up to `retry_s` seconds."""
    sem = asyncio.Semaphore(concurrency)
    start = time.monotonic()

    async def go(k: int, req: LoadRequest) -> Outcome:
        if rate:
            await asyncio.sleep(max(0.0, start + k / rate - time.monotonic()))
        async with sem:
            return await _one(address, req, seed, time.monotonic() + retry_s, timeout_s)

    return list(await asyncio.gather(*(go(k, r) for k, r in enumerate(load))))


# ---------------------------------------------------------------------------- faults


def _pid(cluster: LocalCluster, name: str) -> int:
    if name == "gateway":
        return cluster.endpoints.gateway_pid
    return next(w.pid for w in cluster.endpoints.workers if w.name == name)


def _busy(cluster: LocalCluster, name: str) -> bool:
    w = next(w for w in cluster.endpoints.workers if w.name == name)
    stub_cls = (prefill_pb2_grpc.PrefillWorkerStub if w.tier == "prefill"
                else decode_pb2_grpc.DecodeWorkerStub)
    with grpc.insecure_channel(w.address) as ch:
        try:
            load = stub_cls(ch).Stats(common_pb2.StatsRequest(), timeout=2, metadata=(
                (TOKEN_METADATA, cluster.cluster_token),)).load
        except grpc.RpcError:
            return False
    return load.num_running + load.num_waiting + load.queue_depth > 0


def _first_busy(cluster: LocalCluster, names: list[str], within_s: float) -> str | None:
    """The first of `names` seen with requests in hand within `within_s`, polled in turn."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        for name in names:
            if _busy(cluster, name):
                return name
        time.sleep(0.01)
    return None


def inject(cluster: LocalCluster, fault: str, stop_s: float = 5.0,
           busy_within_s: float = 0.0) -> tuple[str, bool]:
    """Fire one of FAULTS (blocks for `stop_s` for a stop); returns the victim's name and
    whether it was seen with requests in hand just before (always True for the gateway).
    With `busy_within_s`, a worker is hit once it has requests in hand (or when that time
    has passed), so the fault lands mid-request. A killed child is restarted by whoever
    supervises the cluster. The victim is the first worker of its tier found busy (with
    two decode workers, load can sit on either), else the tier's first worker."""
    action, tier = fault.split("-", 1)
    busy = True
    if tier == "gateway":
        victim = "gateway"
    else:
        tier_workers = [w.name for w in cluster.endpoints.workers if w.tier == tier]
        found = _first_busy(cluster, tier_workers, busy_within_s)
        busy = found is not None
        victim = found or tier_workers[0]
    pid = _pid(cluster, victim)
    if action in ("kill", "restart"):
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stop_s)
        finally:
            os.kill(pid, signal.SIGCONT)
    return victim, busy


class Supervisor:
    """Calls `cluster.supervise()` every `period_s` on its own thread until closed."""

    def __init__(self, cluster: LocalCluster, period_s: float = 0.2) -> None:
        self.cluster, self.period_s = cluster, period_s
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.cluster.supervise(self.lines.append)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def held_blocks(cluster: LocalCluster, timeout_s: float = 30.0) -> dict[str, int]:
    """Blocks each worker still holds (Stats, with the cluster token), polled until every
    one is clean or `timeout_s` passes: cancels and expiries are asynchronous. A worker
    that does not answer counts as holding -1."""
    end = time.monotonic() + timeout_s
    md = ((TOKEN_METADATA, cluster.cluster_token),)
    while True:
        held: dict[str, int] = {}
        for w in cluster.endpoints.workers:
            stub_cls = (prefill_pb2_grpc.PrefillWorkerStub if w.tier == "prefill"
                        else decode_pb2_grpc.DecodeWorkerStub)
            with grpc.insecure_channel(w.address) as ch:
                try:
                    load = stub_cls(ch).Stats(common_pb2.StatsRequest(), timeout=5,
                                              metadata=md).load
                    held[w.name] = (load.total_blocks - load.free_blocks + load.num_running
                                    + load.num_waiting)
                except grpc.RpcError:
                    held[w.name] = -1
        if not any(held.values()) or time.monotonic() > end:
            return held
        time.sleep(0.2)


# ---------------------------------------------------------------------------- the benchmark


def summarize(outcomes: Sequence[Outcome], reference: dict[int, tuple[int, ...]]
              ) -> dict:
    ok = [o for o in outcomes if o.status == "OK"]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    return {
        "requests": len(outcomes), "completed": len(ok),
        "errors": dict(Counter(o.status for o in outcomes if o.status != "OK")),
        "retried": sum(bool(o.failures) for o in ok),
        "p99_ttft_s": percentile(ttft, 99) if ttft else None,
        "p99_tpot_s": percentile(tpot, 99) if tpot else None,
        "outputs_equal": sum(o.token_ids == reference[o.index] for o in ok),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of faulty load")
    p.add_argument("--fault-every", type=float, default=20.0)
    p.add_argument("--stop-s", type=float, default=8.0, help="how long a SIGSTOP lasts")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--requests", type=int, default=32, help="size of the mixed load")
    p.add_argument("--disagg-threshold", type=int, default=32)
    p.add_argument("--engine-args", default="--kv-cache-memory 64MiB --threads 1")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="the gateway's rpc and stream idle timeouts (s)")
    p.add_argument("--out", default=None, help="write the report here as JSON")
    return p


def start_cluster(model: str, engine_args: Sequence[str], disagg_threshold: int,
                  timeout_s: float) -> LocalCluster:
    """The cluster chaos runs against: 1 prefill, 2 decode workers, short liveness bounds
    (so a stalled worker is noticed within `timeout_s`), healthy on return."""
    t = f"{timeout_s:g}"
    cluster = LocalCluster(
        model=model, num_prefill=1, num_decode=2, http_port=0, grpc_port=0, cpus="none",
        disagg_threshold=disagg_threshold, engine_args=tuple(engine_args),
        gateway_args=("--rpc-timeout", t, "--stream-idle-timeout", t,
                      "--heartbeat-timeout", t),
        decode_args=("--stream-keepalive", "0.5", "--reservation-timeout", "10"))
    cluster.start()
    try:
        cluster.wait_healthy(timeout=600)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    load = make_load(a.requests)
    cluster = start_cluster(a.model, a.engine_args.split(), a.disagg_threshold, a.timeout)
    sup = Supervisor(cluster)
    try:
        address = cluster.endpoints.grpc_address
        ref = asyncio.run(run_load(address, load, rate=a.rate))
        reference = {o.index: o.token_ids for o in ref}
        n = int(a.duration * a.rate)
        steady = [LoadRequest(k, load[k % len(load)].token_ids, load[k % len(load)].max_tokens)
                  for k in range(n)]
        faults: list[tuple[float, str]] = []

        def fire() -> None:
            t0 = time.monotonic()
            for i in range(int(a.duration // a.fault_every)):
                time.sleep(max(0.0, t0 + (i + 1) * a.fault_every - time.monotonic()))
                fault = FAULTS[i % len(FAULTS)]
                faults.append((time.monotonic() - t0, fault))
                inject(cluster, fault, a.stop_s)

        th = threading.Thread(target=fire, daemon=True)
        th.start()
        outs = asyncio.run(run_load(address, steady, concurrency=64, rate=a.rate,
                                    retry_s=30.0))
        th.join()
        ref_by_index = {k: reference[k % len(load)] for k in range(n)}
        report = {"command": "python -m pdserve.bench.chaos " + " ".join(argv),
                  "faults": faults, "reference": summarize(ref, reference),
                  "chaos": summarize(outs, ref_by_index),
                  "restarts": cluster.restarts, "held_blocks": held_blocks(cluster)}
    finally:
        sup.close()
        cluster.stop()
    print(json.dumps(report, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
