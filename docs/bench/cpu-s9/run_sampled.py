"""Replay workload a sampled (temperature 0.7, top-p 0.9, ignore_eos) against a running
OpenAI URL.

    python docs/bench/cpu-s9/run_sampled.py http://127.0.0.1:18080
"""
import asyncio
import sys

from pdserve.bench.clients import OpenAIHTTPClient
from pdserve.bench.peers_run import MODEL
from pdserve.bench.peers_workloads import WORKLOADS
from pdserve.bench.runner import run_benchmark
from pdserve.engine.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model


async def main(url: str) -> None:
    w = WORKLOADS["a"]
    reqs = w.requests(load_tokenizer(resolve_model(DEFAULT_MODEL)), 0)
    async with OpenAIHTTPClient(url, MODEL, endpoint="completions",
                                extra_body={"temperature": 0.7, "top_p": 0.9}) as c:
        res = await run_benchmark(c, reqs, label="a", rate=w.rate, time_limit_s=400,
                                  progress=False)
    r = res.report
    print(f"ok {r.completed}/{r.num_requests} {r.output_throughput:.1f} tok/s "
          f"TTFT p50 {r.ttft_ms.p50:.0f} TPOT p50 {r.tpot_ms.p50:.1f}")


asyncio.run(main(sys.argv[1]))
