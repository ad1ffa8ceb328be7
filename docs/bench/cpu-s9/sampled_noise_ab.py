"""In-process A/B on workload a, sampled: the sampling path as it was (the torch formulas for
the noise and the race, top-k / top-p from the full sort) against the C noise and race and
the candidate filter, alternated in one engine.

    python docs/bench/cpu-s9/sampled_noise_ab.py bfloat16 2 1.0 1.0   # temperature, top_p
"""
import sys
import time

import pdserve.engine.device_sampler as sampler
import pdserve.engine.sampling_noise as noise
from pdserve.bench.workloads import mixed
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dtype, rounds, temperature, top_p = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \
    float(sys.argv[4])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, kv_cache_memory="2GiB",
                             enable_prefix_caching=False, show_progress=False))
reqs = mixed(eng.tokenizer, 64, 0)
prompts = [eng.tokenizer.encode(r.prompt) for r in reqs]
params = [SamplingParams(max_tokens=r.output_tokens, temperature=temperature, top_p=top_p,
                         ignore_eos=True) for r in reqs]
eng.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=1.0))
kernels, candidates = noise._cpu_ops(), sampler.TOP_CANDIDATES
for _ in range(rounds):
    for name in ("before", "after"):
        noise._cpu = None if name == "before" else kernels
        sampler.TOP_CANDIDATES = () if name == "before" else candidates
        t = time.perf_counter()
        outs = eng.generate(prompts, params)
        tokens = sum(len(o.token_ids) for o in outs)
        print(name, round(tokens / (time.perf_counter() - t), 1), "out tok/s", flush=True)
