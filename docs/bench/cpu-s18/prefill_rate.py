"""Prefill throughput of one engine in process (SmolLM2-135M, two threads, one prompt at a
time, max_tokens 1): 128, 512 and 2048 tokens, each prompt new to the prefix cache.

    python docs/bench/cpu-s18/prefill_rate.py [float32|bfloat16]
"""
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, num_threads=2,
                             show_progress=False))
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
eng.generate([[100 + j for j in range(64)]], params)  # warm-up, not timed
for n in (128, 512, 2048):
    prompt = [200 + (j * 7 + n) % 5000 for j in range(n)]
    t = time.perf_counter()
    eng.generate([prompt], params)
    dt = time.perf_counter() - t
    print(f"prefill {n} tokens: {dt * 1e3:.0f} ms, {n / dt:.0f} tok/s")
