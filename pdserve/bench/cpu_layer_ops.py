"""The element-wise ops of a decoder layer on the CPU, one call each: eager torch against
the C ops (the `torch` and `cpu` bundles of `pdserve.engine.layers.registry`), on
SmolLM2-135M's shapes (hidden 576, 9 + 3 heads of 64, intermediate 1536).

    python -m pdserve.bench.cpu_layer_ops [--iters 200] [--threads N]

T is the step's token count: 1-64 for decode steps, up to 2048 for a prefill chunk.
Residual add + RMSNorm works on a copy of the residual each call, so both sides see the
same input.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.engine.layers.registry import LayerOps, build_layer_ops

HIDDEN, HEADS, HEAD_DIM, INTER, MAX_POS = 576, 12, 64, 1536, 8192


def _us(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _time_ops(ops: LayerOps, x, delta, w, qkv, pos, cos, sin, gate_up, iters: int):
    """Microseconds per call of each op: add + RMSNorm, RoPE on the Q/K heads, SiLU * up."""
    t = x.shape[0]
    tabs = ops.rope_tables(pos, cos, sin)
    qk = qkv[:, :HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
    return (_us(lambda: ops.add_rms_norm(x.clone(), delta, w, 1e-5), iters),
            _us(lambda: ops.rope(qk, tabs), iters),
            _us(lambda: ops.silu_mul(gate_up), iters))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    impls = {"torch": build_layer_ops("torch", cpu), "c": build_layer_ops("cpu", cpu)}
    print(f"threads={torch.get_num_threads()}; microseconds per call, torch -> C")
    print(f"{'dtype':>8} {'T':>5} | {'add+rmsnorm':>16} | {'rope (q+k)':>16} | "
          f"{'silu*up':>16}")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for t in (1, 16, 64, 512, 2048):
                x = torch.randn(t, HIDDEN, generator=gen).to(dtype)
                delta = torch.randn(t, HIDDEN, generator=gen).to(dtype)
                w = torch.randn(HIDDEN, generator=gen).to(dtype)
                qkv = torch.randn(t, (HEADS + 3) * HEAD_DIM, generator=gen).to(dtype)
                pos = torch.randint(0, MAX_POS, (t,), generator=gen)
                cos = torch.randn(MAX_POS, HEAD_DIM, generator=gen).to(dtype)
                sin = torch.randn(MAX_POS, HEAD_DIM, generator=gen).to(dtype)
                gate_up = torch.randn(t, 2 * INTER, generator=gen).to(dtype)
                res = {name: _time_ops(ops, x, delta, w, qkv, pos, cos, sin, gate_up, a.iters)
                       for name, ops in impls.items()}
                cells = " | ".join(f"{b:>6.1f} -> {c:>6.1f}"
                                   for b, c in zip(res["torch"], res["c"]))
                print(f"{str(dtype)[6:]:>8} {t:>5} | {cells}", flush=True)


if __name__ == "__main__":
    main()
