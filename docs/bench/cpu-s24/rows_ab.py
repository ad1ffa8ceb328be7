"""Pure decode steps of B rows in process, the decode stack's GEMV over the GGUF blocks
against its batched form over the packed panels, alternated per B (ROUNDS rounds, default
two), two threads; the median forward of N steps after the batch is all decodes.

    DTYPE=float32|bfloat16 OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s24/rows_ab.py 5,6,8 10

The form is chosen by the stack's `gemv_rows` (the most rows its GEMV takes): PANELS_PAST
(default 4) sends every batch past that many rows to the panels (4: as before session 24),
64 sends every batch to the GEMV.
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
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "float32"),
                             num_threads=2, show_progress=False))


def all_decodes(b: int) -> bool:
    return bool(eng.trace) and len(eng.trace[-1].scheduled) == b and all(
        k == 1 for _, k in eng.trace[-1].scheduled)


def median_forward_ms(b: int, gemv_rows: int) -> float:
    for i in range(b):
        eng.add_request(f"r{b}-{i}-{time.monotonic_ns()}",
                        [100 + (i * 7 + j) % 5000 for j in range(32)],
                        SamplingParams(max_tokens=N + 40, temperature=0.0, ignore_eos=True))
    eng.trace = []
    while not all_decodes(b):
        eng.step()
    eng.model._decode_stack[1].gemv_rows = gemv_rows
    n0 = len(eng.trace)
    for _ in range(N):
        eng.step()
    while eng.has_unfinished():
        eng.step()
    return statistics.median(t.forward_seconds * 1e3 for t in eng.trace[n0:n0 + N])


for rnd in range(int(os.environ.get("ROUNDS", "2"))):
    for b in BS:
        panels = median_forward_ms(b, int(os.environ.get("PANELS_PAST", "4")))
        blocks = median_forward_ms(b, 64)
        print(f"round {rnd} B={b}: panels {panels:.1f} ms  blocks {blocks:.1f} ms", flush=True)
