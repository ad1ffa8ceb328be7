"""Replay one peers workload (greedy, ignore_eos) against a running OpenAI URL.

    python docs/bench/cpu-s9/run_workload.py http://127.0.0.1:18080 a
"""
import asyncio
import resource
import sys

from pdserve.bench.clients import OpenAIHTTPClient
from pdserve.bench.peers_run import GREEDY, MODEL
from pdserve.bench.peers_workloads import WORKLOADS
from pdserve.bench.runner import run_benchmark
from pdserve.engine.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model


async def main(url: str, key: str) -> None:
    w = WORKLOADS[key]
    reqs = w.requests(load_tokenizer(resolve_model(DEFAULT_MODEL)), 0)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    async with OpenAIHTTPClient(url, MODEL, endpoint="completions", extra_body=GREEDY) as c:
        res = await run_benchmark(c, reqs, label=key, rate=w.rate, time_limit_s=300,
                                  ttft_slo_s=w.ttft_slo_s, tpot_slo_s=w.tpot_slo_s,
                                  progress=False)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    r = res.report
    print(f"{key}: ok {r.completed}/{r.num_requests} {r.output_throughput:.1f} tok/s "
          f"TTFT p50 {r.ttft_ms.p50:.0f} TPOT p50 {r.tpot_ms.p50:.1f} p95 {r.tpot_ms.p95:.1f} "
          f"client cpu {cpu:.2f} s")


asyncio.run(main(sys.argv[1], sys.argv[2]))
