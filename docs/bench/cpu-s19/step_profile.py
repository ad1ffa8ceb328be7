"""Where a decode step of B sequences goes, by torch profiler op (engine in-process):

    OMP_WAIT_POLICY=PASSIVE DTYPE=bfloat16 python docs/bench/cpu-s19/step_profile.py B L N

B sequences of L-token prompts, N pure-decode steps profiled after 5 untimed ones."""
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
for _ in range(5):
    eng.step()
t0 = time.perf_counter()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(N):
        eng.step()
wall = (time.perf_counter() - t0) / N * 1e3
print(f"B={B} L={L}: {wall:.1f} ms per step (profiled)")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
