"""A layer's four projections (SmolLM2-135M: QKV 576->960, O 576->576, gate+up 576->3072,
down 1536->576) at M rows, weights in cache, two threads: the float32 panels, the bfloat16
panels (on an AVX2 CPU their AVX2 form) and F.linear in bfloat16 (what a bfloat16 batch ran
on where oneDNN has no bfloat16), GFLOP/s, best of 5 alternated rounds. From the repository
root:

    .venv/bin/python docs/bench/cpu-s29/panels_bf16.py 5,16,64,128,512,2048
"""

import sys
import time

import torch

from pdserve.engine.cpu_kernels import bf16_panels, f32_panels

torch.set_num_threads(2)
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
ws = [torch.randn(o, i) * 0.02 for i, o in SHAPES]
wb = [w.bfloat16() for w in ws]
pf = [f32_panels.f32_pack(w) for w in ws]
pb = [bf16_panels.bf16_pack(w) for w in wb]
for m in [int(a) for a in sys.argv[1].split(",")]:
    xs = [torch.randn(m, i) for i, _ in SHAPES]
    xb = [x.bfloat16() for x in xs]
    flops = sum(2 * m * i * o for i, o in SHAPES)
    fns = {
        "f32 panels": lambda xs=xs: [f32_panels.f32_panels_linear(x, p, w.shape[0])
                                     for x, p, w in zip(xs, pf, ws)],
        "bf16 panels": lambda xb=xb: [bf16_panels.bf16_panels_linear(x, p, w.shape[0])
                                      for x, p, w in zip(xb, pb, wb)],
    }
    if m <= 256:  # F.linear in bfloat16 takes seconds past that
        fns["F.linear bf16"] = lambda xb=xb: [torch.nn.functional.linear(x, w)
                                              for x, w in zip(xb, wb)]
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(5):
        for name, fn in fns.items():
            reps = 1 if name == "F.linear bf16" else max(2, 2000 // m)
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / reps)
    print(m, "  ".join(f"{k} {flops / v / 1e9:.0f} GFLOP/s" for k, v in best.items()), flush=True)
