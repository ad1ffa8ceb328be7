"""One prompt's prefill in process (SmolLM2-135M, two threads, a fresh prompt each time so
the prefix cache cannot serve it): best of 3 wall ms at 128 and 512 tokens, in DTYPE
(bfloat16 by default). From the repository root:

    DTYPE=bfloat16 .venv/bin/python docs/bench/cpu-s29/prefill_ms.py

With N P (session 35): N fresh P-token prompts one after another, each one's wall ms, after
a line "start" once the model is loaded and warm (for a profiler to attach or cut there).
"""

import itertools
import os
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dtype = os.environ.get("DTYPE", "bfloat16")
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, num_threads=2,
                             show_progress=False, max_model_len=4096))
fresh = itertools.count(1)


def prefill_seconds(p: int) -> float:
    base = next(fresh) * 997
    eng.add_request(f"p{base}", [100 + (base + 13 * j) % 5000 for j in range(p)],
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t


prefill_seconds(64)
if len(sys.argv) == 3:
    n, p = int(sys.argv[1]), int(sys.argv[2])
    print("start", flush=True)
    print(dtype, p, " ".join(f"{1e3 * prefill_seconds(p):.0f}" for _ in range(n)), flush=True)
else:
    for p in (128, 512):
        print(dtype, "prefill", p, f"{min(prefill_seconds(p) for _ in range(3)) * 1e3:.0f} ms",
              flush=True)
