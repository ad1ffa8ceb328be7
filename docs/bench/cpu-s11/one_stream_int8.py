"""One bfloat16 stream in process, `--quantization int8` against none, alternated in one
process: ms per output token of a 65-token greedy generation, four rounds.

    .venv/bin/python docs/bench/cpu-s11/one_stream_int8.py [THREADS]
"""

import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

threads = int(sys.argv[1]) if len(sys.argv) > 1 else None
engines = {q: LLMEngine(EngineConfig(dtype="bfloat16", quantization=q, show_progress=False,
                                     num_threads=threads)) for q in (None, "int8")}
ids = [engines[None].tokenizer.encode("Write a short story about a lighthouse keeper.")]
for _ in range(4):
    for q, engine in engines.items():
        engine.generate(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        engine.generate(ids, SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True))
        print(q or "none", f"{(time.perf_counter() - t0) * 1e3 / 65:.1f} ms/token", flush=True)
