"""In-process decode step time (median) of one stream of SmolLM2-135M at 200-3000 tokens of
context. Run from the repository root (another tree: PYTHONPATH=<its checkout> in front):

    .venv/bin/python docs/bench/cpu-s26/longctx_step.py float32
"""

import statistics
import sys

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams


def main(dtype: str) -> None:
    eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, kv_cache_memory="1GiB",
                                 show_progress=False))
    for ctx in (200, 1000, 2000, 3000):
        eng.add_request(f"r{ctx}", list(range(1000, 1000 + ctx)),
                        SamplingParams(max_tokens=64, ignore_eos=True))
        eng.trace = []
        while eng.has_unfinished():
            eng.step()
        steps = [t.total_seconds for t in eng.trace if all(k == 1 for _, k in t.scheduled)]
        eng.trace = None
        print(f"{dtype} ctx {ctx}: decode step median {1e3 * statistics.median(steps):.2f} ms",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32")
