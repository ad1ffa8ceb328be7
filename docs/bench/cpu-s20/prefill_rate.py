"""Prefill rate of one engine in process (SmolLM2-135M, two threads, no prefix cache): R
timed rounds of P prompts of L tokens, each prompt run to its first token, after one untimed
round; "GFLOP/s (linears)" counts the projections' 2 x 106 M multiply-adds per token only.

    OMP_WAIT_POLICY=PASSIVE DTYPE=float32 python docs/bench/cpu-s20/prefill_rate.py P L R

Run from outside the checkout with PYTHONPATH=<a tree> to time that tree (session 20: main
against an archive of 05ea00d, alternated)."""
import os
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

P, L, R = (int(a) for a in sys.argv[1:4])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "float32"),
                             num_threads=2, show_progress=False, enable_prefix_caching=False))
k = 0
for r in range(R + 1):
    for _ in range(P):
        eng.add_request(f"r{k}", [100 + (k * 13 + j * 7) % 5000 for j in range(L)],
                        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        k += 1
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    if r:
        print(f"{P}x{L}: {dt * 1e3:.0f} ms, {P * L / dt:.0f} tok/s, "
              f"{P * L * 0.212 / dt:.0f} GFLOP/s (linears)")
