"""Thread placement A/B on a running two-core `pdserve up` started before session 36's change
(HTTP :8000, the decode worker's metrics :50054): per round and per placement, one greedy
512-token stream, its client TPOT and the engine's own step / forward time over it (the
worker's engine_step_seconds / engine_forward_seconds counters).

    python sched_ab.py GATEWAY_PID DECODE_PID ROUNDS CONFIG [CONFIG ...]
    python sched_ab.py GATEWAY_PID DECODE_PID 0 CONFIG     # only apply CONFIG

CONFIG (cores 0 and 1; "master" is the engine's step thread, "helper" its OpenMP thread):
  U   every thread on 0,1 (as before session 36)
  P   master on 0; everything else, client included, on 1
  N   as U, the engine's threads at nice -5
  M   master on 0, helper on 0,1, the rest on 1
  Q   master and the worker's event loop on 0; helper, gateway, the worker's other
      threads and the client on 1
  Qc  as Q, the client unpinned (what session 36 made the default, the client aside)
  R   as Q, the helper on 0,1
  G   the gateway on 1, nothing else pinned
"""

import json
import os
import re
import statistics
import sys
import time
import urllib.request

GW, DW, ROUNDS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
CONFIGS = sys.argv[4:]
METRICS = "http://127.0.0.1:50054/metrics"


def counters() -> tuple[float, float, float]:
    text = urllib.request.urlopen(METRICS).read().decode()

    def value(name: str) -> float:
        return float(re.search(r"^pdserve:%s\{[^}]*\} (\S+)" % name, text, re.M).group(1))

    return (value("engine_steps_total"), value("engine_step_seconds_total"),
            value("engine_forward_seconds_total"))


def threads(pid: int) -> list[tuple[int, str]]:
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append((int(t), open(f"/proc/{pid}/task/{t}/comm").read().strip()))
        except FileNotFoundError:
            pass
    return out


def apply(cfg: str) -> set[int]:
    """Place the cluster's threads as CONFIG says; the cores the client is to run on."""
    engine = sorted(t for t, n in threads(DW) if n == "pdserve-engine")
    master, helpers = engine[0], engine[1:]  # the step thread started first
    every = [t for t, _ in threads(GW)] + [t for t, _ in threads(DW)]
    for t in every:
        os.sched_setaffinity(t, {0, 1})
        os.setpriority(os.PRIO_PROCESS, t, 0)
    client = {0, 1}
    if cfg == "N":
        for t in engine:
            os.setpriority(os.PRIO_PROCESS, t, -5)
    elif cfg == "G":
        for t, _ in threads(GW):
            os.sched_setaffinity(t, {1})
    elif cfg in ("P", "M", "Q", "Qc", "R"):
        for t in every:
            os.sched_setaffinity(t, {1})
        os.sched_setaffinity(master, {0})
        if cfg in ("Q", "Qc", "R"):
            os.sched_setaffinity(DW, {0})  # the worker's event loop
        if cfg in ("M", "R"):
            for t in helpers:
                os.sched_setaffinity(t, {0, 1})
        client = {0, 1} if cfg == "Qc" else {1}
    return client


def stream(tokens: int = 512) -> float:
    body = json.dumps({"model": "smollm2-135m", "prompt": "Once upon a time",
                       "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": 0}).encode()
    req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", body,
                                 {"Content-Type": "application/json"})
    arrivals = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


if ROUNDS == 0:
    apply(CONFIGS[0])
    sys.exit()
results: dict[str, list[tuple[float, float, float]]] = {c: [] for c in CONFIGS}
for r in range(ROUNDS):
    for c in CONFIGS:
        os.sched_setaffinity(0, apply(c))
        n0, s0, f0 = counters()
        tpot = stream()
        n1, s1, f1 = counters()
        step, forward = (s1 - s0) / (n1 - n0), (f1 - f0) / (n1 - n0)
        results[c].append((tpot * 1e3, step * 1e3, forward * 1e3))
        print(f"round {r} {c}: tpot {tpot * 1e3:.2f} step {step * 1e3:.2f} "
              f"forward {forward * 1e3:.2f} rest {(step - forward) * 1e3:.2f}", flush=True)
apply("U")
for c, rows in results.items():
    tpot, step, forward = (statistics.median(x[i] for x in rows) for i in range(3))
    print(f"{c}: median tpot {tpot:.2f} step {step:.2f} forward {forward:.2f} "
          f"rest {step - forward:.2f}  (n={len(rows)})")
