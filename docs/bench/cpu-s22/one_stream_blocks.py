"""One stream decoded in process, with the default model's GGUF blocks streamed or not: ms
per step over three 128-token prompts of 200 greedy tokens each, and the tokens written to
/tmp/blocks-tokens-B.json to compare the two runs.

    DTYPE=float32|bfloat16 BLOCKS=1|0 OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \\
        python docs/bench/cpu-s22/one_stream_blocks.py
"""

import json
import os
import random
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

ON = os.environ.get("BLOCKS", "1") == "1"
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "float32"),
                             num_threads=2, show_progress=False, gguf_blocks=ON,
                             enable_prefix_caching=False))
rng = random.Random(1)
outs = []
for rnd in range(3):
    ids = [rng.randrange(100, 40000) for _ in range(128)]
    eng.add_request(f"r{rnd}", ids, SamplingParams(max_tokens=200, temperature=0.0,
                                                   ignore_eos=True))
    tokens: list[int] = []
    eng.step()  # the prefill
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        for d in eng.step():
            tokens += d.new_token_ids
        n += 1
    print(f"blocks={ON}: {(time.perf_counter() - t0) / n * 1e3:.2f} ms/step", flush=True)
    outs.append(tokens)
with open(f"/tmp/blocks-tokens-{int(ON)}.json", "w") as f:
    json.dump(outs, f)
