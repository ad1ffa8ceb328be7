"""The served TPOT of S streams (128-token prompts, 256 output tokens) through `pdserve up`'s
colocated layout, and each tier's CPU per output token (pdserve.bench.served_overhead's
count), R rounds on one cluster. Extra arguments go to the workers; CENV="K=V ..." sets
environment variables for every process of the cluster.

    python docs/bench/cpu-s16/served_streams.py bfloat16 64 2
"""
import asyncio
import json
import os
import sys

from pdserve.bench.served_overhead import served_side
from pdserve.bench.workloads import fixed
from pdserve.cluster import ClusterConfig, LocalCluster
from pdserve.engine.model_files import load_tokenizer, resolve_model

dtype, streams, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
env = tuple(tuple(e.split("=", 1)) for e in os.environ.get("CENV", "").split())
c = LocalCluster(ClusterConfig(model="smollm2-135m", num_prefill=0, num_decode=1, http_port=0,
                               grpc_port=0, cpus="auto",
                               engine_args=("--dtype", dtype, *sys.argv[4:]), env=env))
try:
    c.start()
    ep = c.wait_healthy(timeout=600)
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    asyncio.run(served_side(ep, "smollm2-135m", fixed(tok, 2, seed=99)))
    for r in range(rounds):
        reqs = fixed(tok, streams, seed=r, input_len=128, output_len=256)
        tpot, lost, cpu = asyncio.run(served_side(ep, "smollm2-135m", reqs))
        print(json.dumps({"tpot_ms": round(tpot, 2), "lost": lost,
                          "gateway_us": round(cpu.gateway_us), "worker_us": round(cpu.worker_us),
                          "client_us": round(cpu.client_us)}), flush=True)
finally:
    c.stop()
