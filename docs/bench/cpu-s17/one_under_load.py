"""B decode rows (L-token prompts), rounds of N steps with and without a CPU hog beside the
engine (../cpu-s13/cpu_hog.py: BUSY s busy, then IDLE s asleep), in one process; the order
flips each round. Run once per tree to compare two trees:
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=TREE python docs/bench/cpu-s17/one_under_load.py \
        DTYPE B L N ROUNDS BUSY IDLE
"""
import os
import statistics
import subprocess
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dtype, B, L, N, R = sys.argv[1], *map(int, sys.argv[2:6])
busy, idle = sys.argv[6], sys.argv[7]
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, num_threads=2,
                             show_progress=False))
hog_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpu-s13",
                      "cpu_hog.py")
res = {"none": [], "hog": []}
for r in range(R):
    for i in range(B):
        eng.add_request(f"r{r}-{i}", [100 + (i * 7 + j) % 5000 for j in range(L)],
                        SamplingParams(max_tokens=2 * N + 8, temperature=0.0, ignore_eos=True))
    eng.trace = []
    while not eng.trace or not (len(eng.trace[-1].scheduled) == B
                                and all(k == 1 for _, k in eng.trace[-1].scheduled)):
        eng.step()
    for load in (("none", "hog") if r % 2 == 0 else ("hog", "none")):
        hog = None
        if load == "hog":
            hog = subprocess.Popen([sys.executable, hog_py, busy, idle, "1000"])
            time.sleep(0.3)
        n0 = len(eng.trace)
        for _ in range(N):
            eng.step()
        if hog is not None:
            hog.kill()
            hog.wait()
        ts = [t.forward_seconds * 1e3 for t in eng.trace[n0:]]
        res[load].append(statistics.median(ts))
        print(f"round {r} {load}: median {statistics.median(ts):.2f} mean "
              f"{statistics.mean(ts):.2f} ms", flush=True)
    while eng.has_unfinished():
        eng.step()
for k, v in res.items():
    print(k, " ".join(f"{x:.2f}" for x in v), "median", f"{statistics.median(v):.2f}")
