"""Workload c (Poisson 2 req/s, SLO TTFT 2 s / TPOT 200 ms) replayed on a step-time model of
one engine, to ask which prefill order and step budget meet the most SLOs, and how much
that depends on the engine's speed. Arrivals and lengths come from a peers run's JSON.

    python docs/bench/cpu-s21/slo_sim.py [TOK_MS] [ROW_MS] [PEERS_JSON]

A step of D decode rows and P prompt tokens takes 22 ms + D * ROW_MS + P * TOK_MS
(float32 on the session-20/21 Zen 4: ~1.35-1.5 ms a prompt token, ~1.3 ms a decode row).
"""

import json
import sys
from pathlib import Path

TOK = float(sys.argv[1]) / 1e3 if len(sys.argv) > 1 else 0.00145
ROW = float(sys.argv[2]) / 1e3 if len(sys.argv) > 2 else 0.0013
BASE = 0.022
SRC = Path(sys.argv[3]) if len(sys.argv) > 3 else (
    Path(__file__).parents[1] / "peers-s20" / "peers.json")
REQS = json.loads(SRC.read_text())["systems"]["pdserve-fp32"]["workloads"]["c"]["requests"]


def simulate(policy: str, budget: int) -> tuple[float, list[int]]:
    """policy: fcfs (arrival order) or sjf (fewest prompt tokens left first)."""
    t, i, live, done = 0.0, 0, [], []
    pending = sorted(REQS, key=lambda r: r["arrival_s"])
    while i < len(pending) or live:
        while i < len(pending) and pending[i]["arrival_s"] <= t:
            r = pending[i]
            i += 1
            live.append({"id": r["request_id"], "arr": r["arrival_s"], "left": r["prompt_tokens"],
                         "out": r["output_tokens"], "got": 0})
        if not live:
            t = pending[i]["arrival_s"]
            continue
        dec = [s for s in live if s["left"] == 0]
        pre = sorted((s for s in live if s["left"] > 0),
                     key=(lambda s: s["arr"]) if policy == "fcfs" else (lambda s: s["left"]))
        room, chosen = budget - len(dec), []
        for s in pre:
            if room <= 0:
                break
            n = min(s["left"], room)
            chosen.append((s, n))
            room -= n
        t += BASE + ROW * len(dec) + TOK * sum(n for _, n in chosen)
        for s in dec:
            s["got"] += 1
        for s, n in chosen:
            s["left"] -= n
            if s["left"] == 0:
                s["got"], s["first"] = 1, t
        for s in [s for s in live if s["left"] == 0 and s["got"] >= s["out"]]:
            s["end"] = t
            live.remove(s)
            done.append(s)
    missed = sorted(s["id"] for s in done
                    if s["first"] - s["arr"] > 2.0
                    or (s["end"] - s["first"]) / max(1, s["out"] - 1) > 0.2)
    return 1 - len(missed) / len(done), missed


for policy in ("fcfs", "sjf"):
    for budget in (2048, 512, 256):
        share, missed = simulate(policy, budget)
        print(f"{policy} budget {budget:5}: {share:.3f} within both SLOs, missed {missed}")
