"""Wall time of pure decode steps of one engine in process (SmolLM2-135M, two threads), and
with PROFILE=1 where it goes, by torch profiler op:

    OMP_WAIT_POLICY=PASSIVE DTYPE=bfloat16 [PROFILE=1] \
        python docs/bench/cpu-s19/step_time.py B L N

B prompts of L tokens prefilled, 3 untimed steps, then N timed (or profiled) ones. Run
from outside the checkout with PYTHONPATH=<a tree> to time that tree (session 19: this
tree against a worktree of the commit before, one after the other)."""
import contextlib
import os
import sys
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

B, L, N = (int(a) for a in sys.argv[1:4])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "bfloat16"),
                             num_threads=2, show_progress=False))
for i in range(B):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 5000 for j in range(L)],
                    SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
eng.trace = []
while not eng.trace or len(eng.trace[-1].scheduled) != B or any(
        k != 1 for _, k in eng.trace[-1].scheduled):
    eng.step()
for _ in range(3):
    eng.step()
n0 = len(eng.trace)
t0 = time.perf_counter()
profiling = os.environ.get("PROFILE") == "1"
with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profiling
      else contextlib.nullcontext()) as prof:
    for _ in range(N):
        eng.step()
wall = (time.perf_counter() - t0) / N * 1e3
fw = sorted(t.forward_seconds * 1e3 for t in eng.trace[n0:])
print(f"B={B}: wall {wall:.1f} ms/step, forward median {fw[len(fw) // 2]:.1f} min {fw[0]:.1f}")
if profiling:
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
