"""One stream's decode step in process, in parts: the whole step (schedule to bookkeeping),
the model forward, the decode stack (all layers in one C call) and the LM head, medians over
~280 steps of one 128-token prompt decoding 300 tokens (the first 20 steps left out).

    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s15/step_parts.py bfloat16|float32
"""
import statistics
import sys
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_kernels.decode_stack import CpuDecodeStack
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=dtype, num_threads=2,
                             show_progress=False))
seconds: dict[str, list[float]] = {"stack": [], "head": []}
stack_run = CpuDecodeStack.run
model = eng.model
linear = model.linear


def timed_stack(self, *args, **kwargs):
    t = time.perf_counter()
    out = stack_run(self, *args, **kwargs)
    seconds["stack"].append(time.perf_counter() - t)
    return out


def timed_linear(x, w):
    t = time.perf_counter()
    out = linear(x, w)
    if w is model.lm_head:
        seconds["head"].append(time.perf_counter() - t)
    return out


CpuDecodeStack.run = timed_stack
model.linear = timed_linear
eng.add_request("r", [100 + j for j in range(128)],
                SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
eng.trace = []
while eng.has_unfinished():
    eng.step()
steps = [t for t in eng.trace if len(t.scheduled) == 1 and t.scheduled[0][1] == 1][20:]
n = len(steps)


def ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):.2f}"


print(f"{dtype}: {n} steps: whole {ms([t.total_seconds for t in steps])} ms, forward "
      f"{ms([t.forward_seconds for t in steps])}, decode stack {ms(seconds['stack'][-n:])}, "
      f"LM head {ms(seconds['head'][-n:])}")
