"""The batched bfloat16 decode step (B sequences of L-token prompts, N steps) with or without a
CPU hog beside it (cpu_hog.py: 12 ms busy every 62 ms, like the gateway's burst per step):
    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s13/step_under_load.py 64 200 40 hog|none
"""
import os
import statistics
import subprocess
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

B, L, N, load = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", num_threads=2,
                             show_progress=False))
for i in range(B):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 5000 for j in range(L)],
                    SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
eng.trace = []


def pure_decode(t) -> bool:
    return len(t.scheduled) == B and all(k == 1 for _, k in t.scheduled)


while not eng.trace or not pure_decode(eng.trace[-1]):  # past the prefills
    eng.step()
hog = None
if load == "hog":
    hog_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_hog.py")
    hog = subprocess.Popen([sys.executable, hog_py, "0.012", "0.05", "1000"])
    time.sleep(0.2)
n0 = len(eng.trace)
for _ in range(N):
    eng.step()
if hog is not None:
    hog.kill()
ts = [t.forward_seconds * 1e3 for t in eng.trace[n0:]]
print(f"B={B} {load}: median {statistics.median(ts):.1f} ms, mean {statistics.mean(ts):.1f} ms")
