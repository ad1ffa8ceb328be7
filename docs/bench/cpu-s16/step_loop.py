"""In-process decode steps of B sequences of L-token prompts: the mean and median step
after their prefills (N steps), the engine as the decode worker runs it.

    OMP_WAIT_POLICY=PASSIVE [DTYPE=float32] [BS=16] \\
        python docs/bench/cpu-s16/step_loop.py 64 300 150

Prints its pid before the timed steps (for `perf record -p`).
"""
import os
import statistics
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

B, L, N = (int(x) for x in sys.argv[1:4])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "bfloat16"),
                             num_threads=2, show_progress=False,
                             block_size=int(os.environ.get("BS", "16"))))
for i in range(B):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 5000 for j in range(L)],
                    SamplingParams(max_tokens=N + 5, temperature=0.0, ignore_eos=True))
while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.seqs.values()):
    eng.step()
print("decoding, pid", os.getpid(), flush=True)
ts = []
for _ in range(N):
    t = time.perf_counter()
    eng.step()
    ts.append(time.perf_counter() - t)
print(f"B={B} L={L}: step mean {statistics.mean(ts) * 1000:.2f} ms, "
      f"median {statistics.median(ts) * 1000:.2f} ms")
