"""Pure decode steps in process at a given context: B rows whose prompts are P tokens, the
median forward of N steps once the batch is all decodes, two threads, float32 (DTYPE to
change it; KV_DTYPE for the cache's, the model's by default). Run once per build being
compared, alternated (PYTHONPATH=<worktree> for an older commit):

    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s28/decode_ctx.py 1:16,1:1000,64:256 12
"""

import os
import statistics
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

CASES = [tuple(int(x) for x in c.split(":")) for c in sys.argv[1].split(",")]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "float32"),
                             num_threads=2, show_progress=False, max_model_len=4096,
                             kv_cache_dtype=os.environ.get("KV_DTYPE")))


def median_forward_ms(b: int, p: int) -> float:
    for i in range(b):
        eng.add_request(f"r{b}-{p}-{i}-{time.monotonic_ns()}",
                        [100 + (i * 7 + j * 13) % 5000 for j in range(p)],
                        SamplingParams(max_tokens=N + 4, temperature=0.0, ignore_eos=True))
    eng.trace = []
    while not (eng.trace and len(eng.trace[-1].scheduled) == b
               and all(k == 1 for _, k in eng.trace[-1].scheduled)):
        eng.step()
    n0 = len(eng.trace)
    for _ in range(N):
        eng.step()
    while eng.has_unfinished():
        eng.step()
    return statistics.median(t.forward_seconds * 1e3 for t in eng.trace[n0:n0 + N])


print("  ".join(f"B={b} P={p}: {median_forward_ms(b, p):.2f} ms" for b, p in CASES), flush=True)
