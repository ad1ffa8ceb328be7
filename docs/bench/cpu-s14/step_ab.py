"""Decode steps of one engine, alternated step by step between ways of running them, so
that every way sees the same machine noise (this VM's step times drift 20-30 % between
runs; alternation within one run is what separates a few percent):

    OMP_WAIT_POLICY=PASSIVE [DTYPE=float32] [QUANT=int8] [BUSY=s IDLE=s] \\
        python docs/bench/cpu-s14/step_ab.py B L N none|hog kernels BASE_LIB
    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s14/step_ab.py B L N none|hog f32-batch

B sequences of L-token prompts, decoded N rounds past their prefills. `hog` runs
../cpu-s13/cpu_hog.py beside the steps: busy BUSY s every IDLE s (default 0.012 / 0.05).
`kernels`: this tree's kernel library against BASE_LIB, another tree's build of it (that
tree's `python -m pdserve.engine.cpu_kernels.build` prints its path): the decode stack
calls one, then the other. `f32-batch`: the decode stack's batched form against the layer
loop on oneDNN (main before session 14) and the layer loop on the panels.
"""
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import time

import pdserve.engine.llama as llama
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_kernels import library
from pdserve.engine.cpu_kernels.decode_stack import CpuDecodeStack
from pdserve.engine.cpu_kernels.gemv import gemv_linear
from pdserve.engine.layers.linear import GEMV_MAX_ROWS, blocked_onednn_linear
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

B, L, N, load, mode = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                       sys.argv[5])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "bfloat16"),
                             num_threads=2, show_progress=False,
                             quantization=os.environ.get("QUANT") or None))
for i in range(B):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 5000 for j in range(L)],
                    SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
eng.trace = []


def pure_decode(t) -> bool:
    return len(t.scheduled) == B and all(k == 1 for _, k in t.scheduled)


while not eng.trace or not pure_decode(eng.trace[-1]):  # past the prefills
    eng.step()

if mode == "kernels":
    stack = next(o for o in gc.get_objects() if isinstance(o, CpuDecodeStack))
    base = ctypes.CDLL(sys.argv[6])
    library._declare(base)
    libs = {"this tree": library.load(), "base": base}

    def use(name):
        stack._lib = libs[name]
    ways, reference = list(libs), "base"
else:
    model, real_stack_for, real_linear = eng.model, llama.LlamaModel._stack_for, eng.model.linear
    onednn = blocked_onednn_linear()

    def loop_on_onednn(x, w):
        return gemv_linear(x, w) if x.shape[0] <= GEMV_MAX_ROWS else onednn(x, w)

    def no_stack(self, *a, **k):
        return None
    setups = {"stack": (real_stack_for, real_linear),
              "loop on oneDNN": (no_stack, loop_on_onednn),
              "loop on panels": (no_stack, real_linear)}

    def use(name):
        llama.LlamaModel._stack_for, model.linear = setups[name]
    ways, reference = list(setups), "loop on oneDNN"

hog = None
if load == "hog":
    here = os.path.dirname(os.path.abspath(__file__))
    hog = subprocess.Popen([sys.executable, os.path.join(here, "..", "cpu-s13", "cpu_hog.py"),
                            os.environ.get("BUSY", "0.012"), os.environ.get("IDLE", "0.05"),
                            "1000"])
    time.sleep(0.2)
times = {w: [] for w in ways}
for i in range(N):
    for name in ways[i % len(ways):] + ways[:i % len(ways)]:
        use(name)
        n0 = len(eng.trace)
        eng.step()
        times[name].append(eng.trace[n0].forward_seconds * 1e3)
if hog is not None:
    hog.kill()
for name, ts in times.items():
    ratios = [a / b for a, b in zip(ts, times[reference])]
    print(f"B={B} {load}: {name:15s} median {statistics.median(ts):6.1f} ms, mean "
          f"{statistics.mean(ts):6.1f} | / {reference}, per round: median "
          f"{statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}")
