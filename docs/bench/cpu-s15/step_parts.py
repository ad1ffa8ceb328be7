"""One stream's decode step in process, in parts: the whole step (schedule to bookkeeping),
the model forward, the decode stack (all layers in one C call) and the LM head, medians over
~280 steps of one 128-token prompt decoding 300 tokens (the first 20 steps left out).

    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s15/step_parts.py bfloat16|float32
"""
import os, sys, time, statistics, torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.cpu_kernels.decode_stack import CpuDecodeStack
from pdserve.protocol import SamplingParams
dt = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dt, num_threads=2, show_progress=False))
acc = {"stack": [], "head": []}
orig = CpuDecodeStack.run
def run(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); acc["stack"].append(time.perf_counter() - t); return r
CpuDecodeStack.run = run
m = eng.model
lin = m.linear
def timed_linear(x, w):
    t = time.perf_counter(); r = lin(x, w)
    if w is m.lm_head: acc["head"].append(time.perf_counter() - t)
    return r
m.linear = timed_linear
eng.add_request("r", [100 + j for j in range(128)], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
eng.trace = []
while eng.has_unfinished():
    eng.step()
tr = [t for t in eng.trace if len(t.scheduled) == 1 and t.scheduled[0][1] == 1][20:]
n = len(tr)
med = lambda xs: 1e3 * statistics.median(xs)
print(f"{dt}: steps {n}: total {med([t.total_seconds for t in tr]):.2f} ms, forward {med([t.forward_seconds for t in tr]):.2f}, stack {med(acc['stack'][-n:]):.2f}, lm head {med(acc['head'][-n:]):.2f}")
