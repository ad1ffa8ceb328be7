"""Workload c's requests (arrival times, prompt and output lengths, from a peers.json's
pdserve-fp32 run) replayed through the engine in process: synthetic token ids, greedy,
`ignore_eos`, two threads, the engine stepped in a loop. Prints the share within TTFT 2 s and
TPOT 200 ms, TTFT and TPOT percentiles, and the wall time split between steps that carried a
prefill chunk and decode-only steps. No HTTP, no gateway: what the engine alone makes of c.

    OMP_WAIT_POLICY=PASSIVE [BUDGET=2048] [DTYPE=float32] \\
        .venv/bin/python docs/bench/cpu-s30/replay_c.py docs/bench/peers-s29-panels/peers.json
"""

import json
import os
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

BUDGET = int(os.environ.get("BUDGET", "2048"))
runs = json.load(open(sys.argv[1]))["systems"]["pdserve-fp32"]["workloads"]
pending = sorted(runs["c"]["requests"], key=lambda r: r["arrival_s"])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "float32"),
                             num_threads=2, show_progress=False, max_model_len=4096,
                             max_num_batched_tokens=BUDGET))
eng.trace = []
arrival: dict[str, float] = {}
first: dict[str, float] = {}
last: dict[str, float] = {}
tokens: dict[str, int] = {}
steps: list[tuple[float, bool]] = []  # (seconds, carried a prefill chunk)
t0 = time.monotonic()
i = 0
while i < len(pending) or eng.has_unfinished():
    now = time.monotonic() - t0
    while i < len(pending) and pending[i]["arrival_s"] <= now:
        r = pending[i]
        rid = str(r["request_id"])
        arrival[rid] = r["arrival_s"]
        prompt = [100 + (r["request_id"] * 31 + j * 13) % 5000 for j in range(r["prompt_tokens"])]
        eng.add_request(rid, prompt, SamplingParams(max_tokens=r["output_tokens"],
                                                    temperature=0.0, ignore_eos=True))
        i += 1
    if not eng.has_unfinished():
        time.sleep(max(0.0, pending[i]["arrival_s"] - now))
        continue
    s0 = time.monotonic()
    deltas = eng.step()
    t = time.monotonic() - t0
    chunked = bool(eng.trace) and any(k > 1 for _, k in eng.trace[-1].scheduled)
    steps.append((time.monotonic() - s0, chunked))
    for d in deltas:
        if d.new_token_ids:
            first.setdefault(d.request_id, t)
            last[d.request_id] = t
            tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.new_token_ids)

ttft = sorted(first[r] - arrival[r] for r in arrival)
tpot = sorted((last[r] - first[r]) / max(1, tokens[r] - 1) for r in arrival)
met = sum(first[r] - arrival[r] <= 2.0 and (last[r] - first[r]) / max(1, tokens[r] - 1) <= 0.2
          for r in arrival)


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


decode_only = [s for s, chunked in steps if not chunked]
print(f"budget {BUDGET}: share within both SLOs {met / len(arrival):.3f}; "
      f"TTFT p50 {pct(ttft, 0.5):.0f} p95 {pct(ttft, 0.95):.0f} ms; "
      f"TPOT p50 {pct(tpot, 0.5):.0f} p95 {pct(tpot, 0.95):.0f} ms; "
      f"wall {time.monotonic() - t0:.1f} s: steps with a prefill chunk "
      f"{sum(s for s, c in steps if c):.1f} s, decode-only {sum(decode_only):.1f} s "
      f"({len(decode_only)} steps)", flush=True)
