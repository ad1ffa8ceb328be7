"""In-process A/B on workload a sampled at temperature 1: the sampler's noise from the torch
formula against pdserve::exponential_noise, alternated in one engine.

    python docs/bench/cpu-s9/sampled_noise_ab.py bfloat16 2
"""
import sys
import time

import pdserve.engine.sampling_noise as noise
from pdserve.bench.workloads import mixed
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dtype, rounds = sys.argv[1], int(sys.argv[2])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, kv_cache_memory="2GiB",
                             enable_prefix_caching=False, show_progress=False))
reqs = mixed(eng.tokenizer, 64, 0)
prompts = [eng.tokenizer.encode(r.prompt) for r in reqs]
params = [SamplingParams(max_tokens=r.output_tokens, temperature=1.0, ignore_eos=True)
          for r in reqs]
eng.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=1.0))
kernel = noise._cpu_noise()
for _ in range(rounds):
    for name in ("torch", "kernel"):
        noise._cpu_op = None if name == "torch" else kernel
        t = time.perf_counter()
        outs = eng.generate(prompts, params)
        tokens = sum(len(o.token_ids) for o in outs)
        print(name, round(tokens / (time.perf_counter() - t), 1), "out tok/s", flush=True)
