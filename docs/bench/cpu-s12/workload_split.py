"""Peers workload a in this process, bfloat16: wall time and out tok/s, and the forwards split
between pure decode steps (the decode stack's) and steps that carry prompt chunks, with the
pure decode steps' batch sizes (session 12, docs/benchmarks.md section 6).

    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s12/workload_split.py

PYTHONPATH=<checkout> runs another checkout's engine.
"""
import collections
import time

from pdserve.bench.peers_workloads import WORKLOADS
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", num_threads=2,
                             show_progress=False))
reqs = WORKLOADS["a"].requests(eng.tokenizer, 0)
eng.trace = []
t0 = time.perf_counter()
out = 0
for r in reqs:
    eng.add_request(r.request_id, r.prompt, SamplingParams(
        max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True))
while eng.has_unfinished():
    out += sum(len(d.new_token_ids) for d in eng.step())
el = time.perf_counter() - t0
tr = eng.trace
pure = [t for t in tr if all(k == 1 for _, k in t.scheduled)]
mixed = [t for t in tr if not all(k == 1 for _, k in t.scheduled)]
print(f"{el:.2f} s, {out / el:.1f} out tok/s; {len(tr)} steps: pure decode {len(pure)}, "
      f"forwards {sum(t.forward_seconds for t in pure):.2f} s; with prompt chunks "
      f"{len(mixed)}, forwards {sum(t.forward_seconds for t in mixed):.2f} s, "
      f"{sum(sum(k for _, k in t.scheduled) for t in mixed)} tokens")
sizes = collections.Counter(len(t.scheduled) // 8 * 8 for t in pure)
print("pure decode steps by batch size (8s):", sorted(sizes.items()))
