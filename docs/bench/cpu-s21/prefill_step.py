"""One 128-token prefill step, timed in process (median and min of 9 after a warm-up), to
compare OpenMP wait policies: run it under each environment, alternated.

    OMP_WAIT_POLICY=PASSIVE [GOMP_SPINCOUNT=N] [DTYPE=float32] [THREAD=1] \\
        python docs/bench/cpu-s21/prefill_step.py

THREAD=1 steps the engine from a thread of its own, as a worker's engine loop does.
"""

import os
import random
import threading
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

DTYPE = os.environ.get("DTYPE", "bfloat16")
times: list[float] = []


def run() -> None:
    eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=DTYPE, num_threads=2,
                                 show_progress=False, enable_prefix_caching=False))
    rng = random.Random(0)
    for r in range(10):
        ids = [rng.randrange(100, 40000) for _ in range(128)]
        eng.add_request(f"r{r}", ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                     ignore_eos=True))
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        times.append((time.perf_counter() - t0) * 1e3)


if os.environ.get("THREAD"):
    th = threading.Thread(target=run)
    th.start()
    th.join()
else:
    run()
ts = sorted(times[1:])
print(DTYPE, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"),
      f"median {ts[len(ts) // 2]:.1f} ms, min {ts[0]:.1f} ms")
