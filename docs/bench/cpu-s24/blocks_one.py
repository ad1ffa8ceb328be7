"""One projection of the default model (layer 3's gate_up and down) over its Q4_1 blocks
at M = 1, 2, 4, 8 rows, one thread (argv[1] threads): us a call and GFLOP/s. Session 24's
pairs of block rows were measured with it against the one-block-row passes before them.

    python docs/bench/cpu-s24/blocks_one.py [THREADS]
"""

import sys
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_kernels.library import load
from pdserve.engine.llm_engine import LLMEngine

eng = LLMEngine(EngineConfig(model="smollm2-135m", dtype="float32", show_progress=False,
                             kv_cache_memory="64MiB"))
lib, threads = load(), int(sys.argv[1]) if len(sys.argv) > 1 else 1
for name in ("gate_up", "down"):
    n, k = getattr(eng.model.layers[3], name).shape
    blocks = eng.model.gguf_blocks.layers[3][name]
    for m in (1, 2, 4, 8):
        x, y = torch.randn(m, k), torch.empty(m, n)

        def call(x=x, y=y, m=m, n=n, k=k, blocks=blocks):
            lib.blocks_linear(x.data_ptr(), blocks.data_ptr(), 1, y.data_ptr(), m, n, k, 0,
                              threads)

        for _ in range(20):
            call()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                call()
            best = min(best, (time.perf_counter() - t0) / 50)
        print(f"{name} {n}x{k} M={m} threads {threads}: {best * 1e6:.0f} us  "
              f"{2 * m * n * k / best / 1e9:.0f} GF/s", flush=True)
