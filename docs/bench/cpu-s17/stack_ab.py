"""One engine's decode steps alternated step by step between two ways of running the decode
stack, so both see the same machine noise:

    OMP_WAIT_POLICY=PASSIVE [DTYPE=bfloat16] [BUSY=s IDLE=s] \\
        python docs/bench/cpu-s17/stack_ab.py B L N none|hog head
    ... stack_ab.py B L N none|hog base BASE_LIB

B sequences of L-token prompts, N rounds past their prefills. `hog` runs
../cpu-s13/cpu_hog.py beside the engine: busy BUSY s, then asleep IDLE s (default 0.5 ms
every 4 ms: ~1.7 ms of a 15 ms step, what the tiers take per token at one stream).
`head`: this tree's stack with the LM head in its C call, against the same call without the
head and the head through the model's linear after it. `base`: this tree's stack against
session 16's, BASE_LIB: the kernel library built at ae28280 (`git worktree add BASE
ae28280; PYTHONPATH=BASE python -m pdserve.engine.cpu_kernels.build` prints its path),
called with that tree's arguments, its head through the model's linear.
"""
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_kernels.decode_stack import CpuDecodeStack
from pdserve.engine.layers.linear import GEMV_MAX_ROWS
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol import SamplingParams

B, L, N, load, mode = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                       sys.argv[5])
eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype=os.environ.get("DTYPE", "bfloat16"),
                             num_threads=2, show_progress=False))
for i in range(B):
    eng.add_request(f"r{i}", [100 + (i * 7 + j) % 5000 for j in range(L)],
                    SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
eng.trace = []


def pure_decode(t) -> bool:
    return len(t.scheduled) == B and all(k == 1 for _, k in t.scheduled)


while not eng.trace or not pure_decode(eng.trace[-1]):  # past the prefills
    eng.step()
gc.collect()


def layers_then_linear(lib, with_head_arg: bool):
    """A `CpuDecodeStack.run` that calls lib's ds_decode_layers without the head, then the
    model's linear for the logits."""
    def run(self, x, positions, slots, seq_lens, block_tables):
        m, t = self._model, x.shape[0]
        out = torch.empty_like(x)
        packed = self._packed if t > GEMV_MAX_ROWS else None
        head = (None,) if with_head_arg else ()
        rc = lib.ds_decode_layers(
            ctypes.byref(self._dims), self._weights, self._scales, packed,
            m.final_norm.data_ptr(), *head, self._kv.data_ptr(), x.data_ptr(), out.data_ptr(),
            positions.data_ptr(), slots.data_ptr(), seq_lens.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), m.cos.data_ptr(), m.sin.data_ptr(),
            self._num_slots, t, torch.get_num_threads())
        assert rc == 0, rc
        return m.linear(out, m.lm_head)
    return run


stack = next(o for o in gc.get_objects() if isinstance(o, CpuDecodeStack))
if mode == "head":
    ways = {"C head": CpuDecodeStack.run, "linear head": layers_then_linear(stack._lib, True)}
else:
    base = ctypes.CDLL(sys.argv[6])
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    base.ds_decode_layers.argtypes = [p] * 12 + [i64, p, p, i64, i64, i32]
    base.ds_decode_layers.restype = i32
    ways = {"this tree": CpuDecodeStack.run, "base": layers_then_linear(base, False)}
names = list(ways)
hog = None
if load == "hog":
    here = os.path.dirname(os.path.abspath(__file__))
    hog = subprocess.Popen([sys.executable, os.path.join(here, "..", "cpu-s13", "cpu_hog.py"),
                            os.environ.get("BUSY", "0.0005"), os.environ.get("IDLE", "0.004"),
                            "1000"])
    time.sleep(0.2)
times = {w: [] for w in ways}
for i in range(N):
    for name in names[i % 2:] + names[:i % 2]:
        CpuDecodeStack.run = ways[name]
        n0 = len(eng.trace)
        eng.step()
        times[name].append(eng.trace[n0].total_seconds * 1e3)
if hog is not None:
    hog.kill()
for name, ts in times.items():
    ratios = [a / b for a, b in zip(ts, times[names[1]])]
    print(f"B={B} {load}: {name:12s} step median {statistics.median(ts):6.2f} ms, mean "
          f"{statistics.mean(ts):6.2f} | / {names[1]}, per round: median "
          f"{statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}")
