"""CUDA graphs of the whole decode step, one per batch-size bucket.

A step of a ~30-layer model at decode batch sizes is a couple of thousand small kernels;
launched one by one from Python the GPU idles most of the time. Captured once, a step is
one graph launch. What a graph reads and writes must stay at fixed addresses: the runner's
DecodeBuffers and SamplingBuffers (filled in place before each replay), the KV cache, and
the graph's own output (the sampler's packed result), which stays valid until the next
replay of that graph.

Life cycle: `capture` runs once at engine start, largest bucket first so every graph shares
one memory pool (smaller graphs fit inside the largest's intermediates); `replay` per pure-
decode step; never re-captured (the buffers' addresses never change). CUDA only: on other
devices the runner runs the same step function eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

StepFn = Callable[[int], torch.Tensor]  # padded batch size -> the step's packed result


class DecodeGraphs:
    def __init__(self) -> None:
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.memory_bytes = 0

    def __contains__(self, bucket: int) -> bool:
        return bucket in self._graphs

    def capture(self, step: StepFn, buckets: list[int], device: torch.device) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        for b in sorted(buckets, reverse=True):
            # warm-up off the default stream: lazy initialisations (cuBLAS handles, Triton
            # autotune and compilation) must not happen during capture
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(b)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = step(b)
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize(device)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s, %.1f MiB",
                 len(self._graphs), ",".join(map(str, sorted(self._graphs))), self.capture_s,
                 self.memory_bytes / 2**20)

    def replay(self, bucket: int) -> torch.Tensor:
        graph, out = self._graphs[bucket]
        graph.replay()
        return out
