"""The torch profiler over 10 pure decode steps of B sequences with L-token prompts (session
10, docs/benchmarks.md section 6): which kernels a batched decode step spends its time in.

    python docs/bench/cpu-s10/profile_decode_batch.py bfloat16 64 300
"""
import sys

from torch.profiler import ProfilerActivity, profile

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dt, B, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dt, num_threads=2, show_progress=False))
for i in range(B):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 5000 for j in range(L)],
                    SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
eng.trace = []


def pure_decode(t) -> bool:
    return len(t.scheduled) == B and all(k == 1 for _, k in t.scheduled)


while not eng.trace or not pure_decode(eng.trace[-1]):  # past the prefills
    eng.step()
for _ in range(5):
    eng.step()
n0 = len(eng.trace)
for _ in range(20):
    eng.step()
print("decode step forward ms", [round(t.forward_seconds * 1e3, 1) for t in eng.trace[n0:]])
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(10):
        eng.step()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
