"""Pure decode steps of B rows (200-token prompts) in the engine, in process, under the torch
profiler: the step time and where it goes by op. The prompts are prefilled (and their
prefix cached) first, so the profiled run is decode steps and one short prefill.

    python docs/bench/cpu-s6/decode_step_profile.py float32 64
"""

import collections
import sys

from torch.profiler import ProfilerActivity, profile

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, kv_cache_memory="2GiB",
                                 show_progress=False))
    prompts = [[(i * 7 + j * 13) % 40000 + 100 for j in range(200)] for i in range(b)]
    eng.generate(prompts, [SamplingParams(max_tokens=1, temperature=0)] * b)
    eng.trace = []
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        eng.generate(prompts, [params] * b)
    steps = [t for t in eng.trace
             if len(t.scheduled) == b and sum(n for _, n in t.scheduled) == b]
    print(f"{len(steps)} decode steps of {b} rows: "
          f"{1000 * sum(t.total_seconds for t in steps) / len(steps):.1f} ms each")
    gemm = collections.Counter()
    for e in prof.events():
        shapes = e.input_shapes
        if e.name == "mkldnn::_linear_pointwise" and shapes and shapes[0] and shapes[0][0] == b:
            gemm[tuple(shapes[0])] += e.cpu_time_total / 1e6
    print("projections at M = rows, seconds by input shape:", dict(gemm))
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"{e.key:40s} {e.self_cpu_time_total / 1e6:7.3f} s {e.count:6d} calls "
              f"{100 * e.self_cpu_time_total / total:5.1f} %")


if __name__ == "__main__":
    main()
