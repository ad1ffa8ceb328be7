"""A whole step's projections at M rows, bfloat16, on distinct weights (30 layers of
SmolLM2-135M's four shapes, then the LM head): the AMX kernel (pdserve::amx_linear on packed
copies) against oneDNN on blocked weights, min of three alternated rounds (session 12,
docs/benchmarks.md section 6).

    MS=8,16,32,64 python docs/bench/cpu-s12/projections_step.py
"""
import os
import time

import torch

from pdserve.engine.cpu_kernels.amx_linear import amx_available, amx_linear, amx_pack
from pdserve.engine.layers.linear import blocked_onednn_linear

torch.set_num_threads(2)
assert amx_available(), "no AMX tiles here"
onednn = blocked_onednn_linear()
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
gen = torch.Generator().manual_seed(0)
ws = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(30) for k, n in SHAPES]
ws.append(torch.randn(49152, 576, generator=gen).bfloat16())
packed = [amx_pack(w) for w in ws]


def tiles(xs):
    for w, p in zip(ws, packed):
        amx_linear(xs[w.shape[1]], p, w.shape[0])


def blocked(xs):
    for w in ws:
        onednn(xs[w.shape[1]], w)


with torch.inference_mode():
    for m in [int(v) for v in os.environ.get("MS", "8,16,32,64").split(",")]:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
        best = {}
        for _ in range(3):
            for name, fn in (("amx", tiles), ("onednn", blocked)):
                fn(xs)
                t0 = time.perf_counter()
                fn(xs)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
        print(f"M={m}: AMX {best['amx'] * 1e3:.1f} ms, oneDNN {best['onednn'] * 1e3:.1f} ms, "
              f"{best['onednn'] / best['amx']:.2f}x", flush=True)
