"""Decode steps in process with sampled rows: ms per step for 1 and 64 streams of the
default model, greedy against temperature 1.0 and two nucleus settings, so the sampler's
share of a step shows beside the model's. Every stream has a 64-token prompt and 96 output
tokens (`ignore_eos`); the steps until every stream has its first token (the prefills) are
not counted. STREAMS=1,64 picks the stream counts, ONLY='greedy|T=1.0' the settings.
FILTER=0 draws through the torch filters instead of the C one (cpu_kernels/sampling_filter.c),
for an A/B in one sitting (min-p rows too, since session 24).

    DTYPE=float32|bfloat16 FILTER=1|0 OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \\
        python docs/bench/cpu-s24/sampled_steps.py
"""

import os
import random
import time

import pdserve.engine.device_sampler as device_sampler
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

SETTINGS = {
    "T=1.0 min_p=0.05": {"temperature": 1.0, "min_p": 0.05},
    "greedy rep=1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
    "T=1.0 top_p=0.9 min_p=0.1": {"temperature": 1.0, "top_p": 0.9, "min_p": 0.1},
    "greedy": {"temperature": 0.0},
    "T=1.0": {"temperature": 1.0},
    "T=0.7 top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "T=1.0 top_p=0.95": {"temperature": 1.0, "top_p": 0.95},
    "T=0.8 top_k=40": {"temperature": 0.8, "top_k": 40},
}
if os.environ.get("ONLY"):  # a |-separated subset of the settings
    SETTINGS = {k: v for k, v in SETTINGS.items() if k in os.environ["ONLY"].split("|")}
if os.environ.get("FILTER", "1") == "0":
    device_sampler._cpu_filter = lambda: None
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "float32"),
                             num_threads=2, show_progress=False, enable_prefix_caching=False))
rng = random.Random(1)
for streams in [int(s) for s in os.environ.get("STREAMS", "1,64").split(",")]:
    for name, kw in SETTINGS.items():
        for i in range(streams):
            ids = [rng.randrange(100, 40000) for _ in range(64)]
            eng.add_request(f"{name}-{streams}-{i}", ids, SamplingParams(
                max_tokens=96, ignore_eos=True, seed=i, **kw))
        started: set[str] = set()
        while len(started) < streams:  # the prefill steps
            started |= {d.request_id for d in eng.step() if d.new_token_ids}
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            n += 1
        print(f"streams {streams:3} {name:18}: {(time.perf_counter() - t0) / n * 1e3:7.2f} "
              f"ms/step", flush=True)
