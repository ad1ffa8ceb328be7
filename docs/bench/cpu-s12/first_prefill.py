"""The prefill step of three successive 128-token requests on a fresh bfloat16 engine, in
ms: the first one used to make the CPU linears' kept weight copies (session 12,
docs/benchmarks.md section 6).

    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s12/first_prefill.py
"""
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="bfloat16", num_threads=2,
                             show_progress=False, enable_prefix_caching=False))
for i in range(3):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 5000 for j in range(128)],
                    SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    eng.step()
    print(f"request {i}: prefill step {(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
    while eng.has_unfinished():
        eng.step()
