"""pdserve::silu_mul and pdserve::add_rms_norm on a T-token prefill's shapes (SmolLM2:
intermediate 1536, hidden 576), two threads, float32 and bfloat16, beside torch's silu * up.

    OMP_WAIT_POLICY=PASSIVE python docs/bench/cpu-s20/layer_ops_time.py [T]

Run from outside the checkout with PYTHONPATH=<a tree> to time that tree."""
import sys
import time

import torch

from pdserve.engine.cpu_kernels import layer_ops  # noqa: F401  (registers the ops)

torch.set_num_threads(2)
T = int(sys.argv[1]) if len(sys.argv) > 1 else 512


def ms(f, n=50):
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def row(dt):
    gu = torch.randn(T, 3072, dtype=dt) * 3
    x, d = torch.randn(T, 576, dtype=dt), torch.randn(T, 576, dtype=dt)
    w = torch.randn(576, dtype=dt)
    print(dt, "silu_mul %.3f ms" % ms(lambda: torch.ops.pdserve.silu_mul(gu)),
          "torch silu*up %.3f" % ms(lambda: torch.nn.functional.silu(gu[:, :1536])
                                    * gu[:, 1536:]),
          "add_rms_norm %.3f" % ms(lambda: torch.ops.pdserve.add_rms_norm(x, d, w, 1e-5)))


for dt in (torch.float32, torch.bfloat16):
    row(dt)
