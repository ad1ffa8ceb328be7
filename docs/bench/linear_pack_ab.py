# The four projections of a SmolLM2 layer through oneDNN with plain and blocked weights
# (docs/benchmarks.md section 6): PYTHONPATH=. python docs/bench/linear_pack_ab.py
import time, torch
from pdserve.engine.layers.linear import onednn_linear
torch.set_num_threads(2)
def best(fn, n=7):
    fn(); b=1e9
    for _ in range(n):
        t=time.perf_counter(); fn(); b=min(b,time.perf_counter()-t)
    return b
for dt in (torch.float32, torch.bfloat16):
    ws=[torch.randn(o,i).to(dt) for i,o in ((576,960),(576,576),(576,3072),(1536,576))]
    for M in (16, 64, 256, 1024):
        xs={k: torch.randn(M,k).to(dt) for k in (576,1536)}
        packed=[torch.ops.mkldnn._reorder_linear_weight(w, M) for w in ws]
        def plain(): [onednn_linear(xs[w.shape[1]], w) for w in ws]
        def pk(): [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w,p in zip(ws,packed)]
        def Fl(): [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws]
        flops=sum(2*M*w.numel() for w in ws)
        r={n: flops/best(f)/1e9 for n,f in (("onednn",plain),("packed",pk),("F",Fl))}
        # packed weight used at another M
        xs2={k: torch.randn(M+7,k).to(dt) for k in (576,1536)}
        def pk2(): [torch.ops.mkldnn._linear_pointwise(xs2[w.shape[1]], p, None, "none", [], "") for w,p in zip(ws,packed)]
        r["packed@M+7"]=sum(2*(M+7)*w.numel() for w in ws)/best(pk2)/1e9
        print(dt, M, {k: round(v,1) for k,v in r.items()}, "GFLOP/s", flush=True)
