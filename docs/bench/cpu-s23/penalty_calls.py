"""A step's penalties on the CPU: `penalized` on the touched (row, token) pairs (the CPU's
default) against the dense [rows, vocab] formula (what a captured graph runs), median ms
of fill + penalized over the default model's vocabulary, rows with 64 prompt and 200
output tokens.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 python docs/bench/cpu-s23/penalty_calls.py
"""

import random
import time

import torch

from pdserve.engine.device_sampler import SamplingBuffers, penalized
from pdserve.engine.sampler import SampleRow
from pdserve.protocol import SamplingParams

torch.set_num_threads(2)
V = 49152
rng = random.Random(0)
for name, kw in (("repetition 1.1", {"repetition_penalty": 1.1}),
                 ("presence 0.5 + frequency 0.3", {"presence_penalty": 0.5,
                                                   "frequency_penalty": 0.3})):
    for n in (1, 64):
        rows = [SampleRow(SamplingParams(temperature=0.7, **kw),
                          [rng.randrange(V) for _ in range(64)],
                          [rng.randrange(V) for _ in range(200)], (2,)) for _ in range(n)]
        logits = torch.randn(n, V)
        out = {}
        for sparse in (True, False):
            bufs = SamplingBuffers(n, V, torch.device("cpu"), sparse=sparse)
            ts = []
            for _ in range(30):
                t0 = time.perf_counter()
                got = penalized(logits, bufs, bufs.fill(rows, n))
                ts.append(time.perf_counter() - t0)
            out[sparse] = (sorted(ts)[15] * 1e3, got)
        print(f"{name:28} rows {n:2}: touched pairs {out[True][0]:6.2f} ms, dense "
              f"{out[False][0]:6.2f} ms, equal {torch.equal(out[True][1], out[False][1])}")
