"""Pure decode steps of B rows in process: an engine that streams the GGUF blocks against
one that streams its float32 rows (row GEMV to 4 rows, packed panels past that), the two
alternated per B, ROUNDS rounds (default 2), two threads; the median forward of N steps
once the batch is all decodes.

    DTYPE=float32 OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s27/blocks_ab.py 1,2,4,8 12
"""

import os
import statistics
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

BS = [int(b) for b in sys.argv[1].split(",")]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10
engines = {name: LLMEngine(EngineConfig(model="smollm2-135m",
                                        dtype=os.environ.get("DTYPE", "float32"),
                                        num_threads=2, show_progress=False, gguf_blocks=on))
           for name, on in (("blocks", True), ("rows", False))}
assert engines["blocks"].model.gguf_blocks is not None, "this build streams no blocks"


def median_forward_ms(eng: LLMEngine, b: int) -> float:
    for i in range(b):
        eng.add_request(f"r{b}-{i}-{time.monotonic_ns()}",
                        [100 + (i * 7 + j) % 5000 for j in range(32)],
                        SamplingParams(max_tokens=N + 40, temperature=0.0, ignore_eos=True))
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


for rnd in range(int(os.environ.get("ROUNDS", "2"))):
    for b in BS:
        got = {name: median_forward_ms(eng, b) for name, eng in engines.items()}
        print(f"round {rnd} B={b}: " + "  ".join(f"{k} {v:.1f} ms" for k, v in got.items())
              + f"  blocks/rows {got['blocks'] / got['rows']:.3f}", flush=True)
