"""Token streams on one Session call against a call per request, through `pdserve up`'s
layout on this machine, alternated burst by burst.

Two local clusters run side by side (the same model, dtype and cores); one's gateway
opens a Session per decode worker (`--decode-streams session`), the other's a call per
request. Each round sends the same 64 (or --streams) requests to one, then the other, in
alternating order, and prints the mean TPOT a streaming client sees and each tier's CPU
per output token (pdserve.bench.served_overhead's count). The idle cluster costs only its
heartbeats.

    python docs/bench/cpu-s15/sessions_ab.py --dtype bfloat16 --streams 64 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from pdserve.bench.served_overhead import _layout, served_side
from pdserve.bench.workloads import fixed
from pdserve.cluster import ClusterConfig, LocalCluster
from pdserve.engine.model_files import load_tokenizer, resolve_model

MODES = ("session", "per-request")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    a.layout = "auto"
    layout = _layout(a)
    clusters = {m: LocalCluster(ClusterConfig(
        model=a.model, num_prefill=layout.num_prefill, num_decode=layout.num_decode,
        http_port=0, grpc_port=0, cpus="auto", engine_args=("--dtype", a.dtype),
        gateway_args=("--decode-streams", m))) for m in MODES}
    rows = []
    try:
        eps = {}
        for m, c in clusters.items():
            c.start()
            eps[m] = c.wait_healthy(timeout=600)
        tok = load_tokenizer(resolve_model(a.model))
        for m in MODES:  # warm both
            asyncio.run(served_side(eps[m], a.model, fixed(tok, 8, seed=99)))
        for rnd in range(a.rounds):
            reqs = fixed(tok, a.streams, seed=rnd, input_len=128, output_len=128)
            for m in (MODES if rnd % 2 == 0 else MODES[::-1]):
                tpot, lost, cpu = asyncio.run(served_side(eps[m], a.model, reqs))
                row = {"round": rnd, "mode": m, "tpot_ms": tpot, "lost": lost,
                       "gateway_us": cpu.gateway_us, "worker_us": cpu.worker_us,
                       "client_us": cpu.client_us, "engine_us": cpu.engine_us}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for c in clusters.values():
            c.stop()
    for m in MODES:
        mine = [r for r in rows if r["mode"] == m]
        print(f"{m:>11}: TPOT median {statistics.median(r['tpot_ms'] for r in mine):6.1f} ms; "
              f"us/token gateway {statistics.median(r['gateway_us'] for r in mine):5.0f}, "
              f"workers {statistics.median(r['worker_us'] for r in mine):5.0f}, "
              f"client {statistics.median(r['client_us'] for r in mine):5.0f}; "
              f"lost {sum(r['lost'] for r in mine)}")
    pairs = [(s["tpot_ms"], q["tpot_ms"]) for s in rows if s["mode"] == MODES[0]
             for q in rows if q["mode"] == MODES[1] and q["round"] == s["round"]]
    print("TPOT session / per-request by round: "
          + ", ".join(f"{x / y:.3f}" for x, y in pairs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
