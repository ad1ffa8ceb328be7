"""The model's projections at decode sizes on the CPU: oneDNN's matmul on blocked weights
(as the engine runs it: `blocked_onednn_linear`) against the C GEMV
(`pdserve::gemv_linear`), streaming a whole model's worth of distinct weights per "step" so
that nothing is served from cache, as in a real decode step; and the machine's read
bandwidth (a sum over 1 GiB) as the bound both are measured against.

    python -m pdserve.bench.cpu_linear [--rows 1,2,4,8,12,16] [--threads N] [--rounds 5]

Shapes are SmolLM2-135M's (30 layers of QKV 576->960, O 576->576, gate+up 576->3072,
down 1536->576, and the tied 576->49152 LM head): 538 MB in float32, 269 MB in bfloat16,
143 MB as int8 with its scales. Prints ms per step and GB/s of weights for each M (rows of
x); the crossover is where the C GEMV stops winning
(pdserve.engine.layers.linear.GEMV_MAX_ROWS). The int8 rows time the int8 GEMV
(`pdserve::gemv_linear_int8`, bfloat16 x) against oneDNN on the de-quantized bfloat16
weights, what `--quantization int8` runs at those sizes. The float32 and bfloat16 rows also
time the batched kernel over packed copies where the build and CPU have it (AVX-512 or AVX2 panels,
`pdserve::f32_panels_linear`; AMX tiles, `pdserve::amx_linear`: what the engine runs from
GEMV_MAX_ROWS + 1 to BATCH_MAX_ROWS rows), its speedup over oneDNN last.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.engine.cpu_kernels.gemv import gemv_linear, gemv_linear_int8
from pdserve.engine.layers.int8 import quantize_int8
from pdserve.engine.layers.linear import batch_packed, blocked_onednn_linear, packed_linear

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) per layer
LM_HEAD = (576, 49152)


def read_bandwidth() -> float:
    """GB/s of one pass over 1 GiB of float32 (a sum): what streaming can reach here."""
    a = torch.randn(1 << 28)
    a.sum()
    best = min(_seconds(a.sum) for _ in range(5))
    return a.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,12,16", help="rows of x (comma-separated)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per case (min is kept)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    print(f"threads={torch.get_num_threads()}; read bandwidth {read_bandwidth():.1f} GB/s")
    packed = packed_linear()
    print(f"{'dtype':>8} {'M':>3} | {'oneDNN ms':>9} {'GB/s':>5} | {'GEMV ms':>7} {'GB/s':>5} | "
          f"{'speedup':>7} | {'packed ms':>9} {'GB/s':>5} | {'packed/oneDNN':>13}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for kind in ("float32", "bfloat16", "int8"):
            dtype = torch.float32 if kind == "float32" else torch.bfloat16
            full = [torch.randn(o, i, generator=gen) for _ in range(LAYERS) for i, o in SHAPES]
            full.append(torch.randn(LM_HEAD[1], LM_HEAD[0], generator=gen))
            weights = [w.to(dtype) for w in full]
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            gemv = gemv_linear
            if kind == "int8":  # oneDNN on the de-quantized bfloat16, the GEMV on int8
                quantized = {id(w): quantize_int8(f) for w, f in zip(weights, full)}
                nbytes = sum(q.nbytes for q in quantized.values())

                def gemv(x, w, quantized=quantized):
                    qw = quantized[id(w)]
                    return gemv_linear_int8(x, qw.q, qw.scale)
            del full
            for m in rows:
                xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in (576, 1536)}
                times = {}
                fns = [("onednn", blocked_onednn_linear()), ("gemv", gemv)]
                if kind != "int8" and batch_packed(weights[0]) is not None:
                    fns.append(("packed", packed))
                for name, fn in fns:
                    def step(fn=fn, weights=weights, xs=xs):
                        for w in weights:
                            fn(xs[w.shape[1]], w)
                    step()
                    times[name] = min(_seconds(step) for _ in range(a.rounds))
                o, g = times["onednn"], times["gemv"]
                line = (f"{kind:>8} {m:>3} | {o * 1e3:>9.2f} "
                        f"{nbytes / o / 1e9:>5.1f} | {g * 1e3:>7.2f} {nbytes / g / 1e9:>5.1f} | "
                        f"{o / g:>6.2f}x")
                if "packed" in times:
                    t = times["packed"]
                    line += f" | {t * 1e3:>9.2f} {nbytes / t / 1e9:>5.1f} | {o / t:>12.2f}x"
                print(line, flush=True)

if __name__ == "__main__":
    main()
