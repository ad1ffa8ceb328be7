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

import importlib.util
import os
import pathlib
import statistics
import sys

from pdserve.bench.thread_cpu import threads_cpu
from pdserve.os_thread import ENGINE_THREAD_NAME

GW, DW, ROUNDS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
CONFIGS = sys.argv[4:]

# session 35's stream and counter readers, pointed at `pdserve up`'s default ports
_spec = importlib.util.spec_from_file_location(
    "served_step_decomp",
    pathlib.Path(__file__).parents[1] / "cpu-s35" / "served_step_decomp.py")
decomp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decomp)
decomp.HTTP, decomp.METRICS = "http://127.0.0.1:8000", "http://127.0.0.1:50054/metrics"


def apply(cfg: str) -> set[int]:
    """Place the cluster's threads as CONFIG says; the cores the client is to run on."""
    engine = sorted(t.tid for t in threads_cpu(DW) if t.name == ENGINE_THREAD_NAME)
    master, helpers = engine[0], engine[1:]  # the step thread started first
    every = [t.tid for pid in (GW, DW) for t in threads_cpu(pid)]
    for t in every:
        os.sched_setaffinity(t, {0, 1})
        os.setpriority(os.PRIO_PROCESS, t, 0)
    client = {0, 1}
    if cfg == "N":
        for t in engine:
            os.setpriority(os.PRIO_PROCESS, t, -5)
    elif cfg == "G":
        for t in threads_cpu(GW):
            os.sched_setaffinity(t.tid, {1})
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


if ROUNDS == 0:
    apply(CONFIGS[0])
    sys.exit()
results: dict[str, list[tuple[float, float, float]]] = {c: [] for c in CONFIGS}
for r in range(ROUNDS):
    for c in CONFIGS:
        os.sched_setaffinity(0, apply(c))
        n0, s0, f0 = decomp.engine_counters()
        tpot = decomp.stream_tpot(512)
        n1, s1, f1 = decomp.engine_counters()
        step, forward = (s1 - s0) / (n1 - n0), (f1 - f0) / (n1 - n0)
        results[c].append((tpot * 1e3, step * 1e3, forward * 1e3))
        print(f"round {r} {c}: tpot {tpot * 1e3:.2f} step {step * 1e3:.2f} "
              f"forward {forward * 1e3:.2f} rest {(step - forward) * 1e3:.2f}", flush=True)
apply("U")
for c, rows in results.items():
    tpot, step, forward = (statistics.median(x[i] for x in rows) for i in range(3))
    print(f"{c}: median tpot {tpot:.2f} step {step:.2f} forward {forward:.2f} "
          f"rest {step - forward:.2f}  (n={len(rows)})")
