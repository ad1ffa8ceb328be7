"""A float32 prefill on a thread (as the engine's step thread runs it), with the engine's heap
settings (pdserve.engine.heap_tuning) on or off: each batch's tokens/s, then the thread's
user and system time and page faults over the timed batches.

    HEAP=on|off OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s16/heap_ab.py 8 400 3

B prompts of L tokens, prefilled R times (a fresh set each time, after one untimed set).
"""
import os
import resource
import sys
import threading
import time

import pdserve.engine.llm_engine as llm_engine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

if os.environ.get("HEAP", "on") == "off":
    llm_engine.retain_freed_memory = lambda: False
B, L, R = (int(x) for x in sys.argv[1:4])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", num_threads=2,
                             show_progress=False))


def batch(tag: int) -> float:
    for i in range(B):
        eng.add_request(f"{tag}-{i}", [100 + (i * 7 + j + 997 * tag) % 5000 for j in range(L)],
                        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t


def timed() -> None:
    batch(0)
    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    for r in range(1, R + 1):
        dt = batch(r)
        print(f"prefill {B}x{L}: {dt * 1000:.0f} ms = {B * L / dt:.0f} tok/s", flush=True)
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    print(f"thread: user {r1.ru_utime - r0.ru_utime:.2f} s, sys {r1.ru_stime - r0.ru_stime:.2f}"
          f" s, page faults {r1.ru_minflt - r0.ru_minflt}")


t = threading.Thread(target=timed)
t.start()
t.join()
