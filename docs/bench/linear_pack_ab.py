"""The four projections of a SmolLM2 layer through oneDNN with plain and blocked weights
(docs/benchmarks.md section 6): PYTHONPATH=. python docs/bench/linear_pack_ab.py"""

import time

import torch

from pdserve.engine.layers.linear import onednn_linear

torch.set_num_threads(2)


def best(fn, n=7):
    fn()
    b = 1e9
    for _ in range(n):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b


def pointwise(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


for dt in (torch.float32, torch.bfloat16):
    ws = [torch.randn(o, i).to(dt) for i, o in ((576, 960), (576, 576), (576, 3072), (1536, 576))]
    for m in (16, 64, 256, 1024):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]
        r = {}
        for rows, name, fn, weights in ((m, "plain", onednn_linear, ws),
                                        (m, "blocked", pointwise, packed),
                                        (m + 7, "blocked, other M", pointwise, packed)):
            xs = {k: torch.randn(rows, k).to(dt) for k in (576, 1536)}
            seconds = best(lambda fn=fn, weights=weights, xs=xs, ws=ws: [
                fn(xs[w.shape[1]], p) for w, p in zip(ws, weights)])
            r[name] = round(sum(2 * rows * w.numel() for w in ws) / seconds / 1e9, 1)
        print(dt, m, r, "GFLOP/s", flush=True)
