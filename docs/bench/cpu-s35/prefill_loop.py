"""N fresh prompts of P tokens prefilled in process (SmolLM2-135M, two threads), one after
another, their wall ms printed; "start" is printed once the model is loaded and warm, for
a profiler to attach then. From the repository root:

    DTYPE=float32 OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/bench/cpu-s35/prefill_loop.py N P
"""

import itertools
import os
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dtype = os.environ.get("DTYPE", "float32")
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
n, p = int(sys.argv[1]), int(sys.argv[2])
print("start", flush=True)
print(dtype, p, " ".join(f"{1e3 * prefill_seconds(p):.0f}" for _ in range(n)), flush=True)
