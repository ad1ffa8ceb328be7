"""What the served path adds per token: the engine's TPOT in-process against the TPOT a
streaming OpenAI client sees through `pdserve up`, in one run, with their ratio.

One run:

1. start a local cluster in the layout `pdserve up` would pick here (or the one asked), on
   the cores `--cpus` names as `pdserve up --cpus` takes them (default: as it would pick);
2. for each round and each stream count N (interleaved, so both sides see the same load
   from whatever else shares the machine): the engine in this process, pinned to the decode
   worker's cores with as many threads, runs N fixed-length requests at once and times each
   request's tokens step by step; then the same N requests go through the gateway's
   OpenAI HTTP API, streamed, all at once;
3. print, per N, the engine's TPOT and pure decode-step time, the served TPOT, and
   served / engine; for N = 1 also the weight bytes a decode step reads and the achieved
   GB/s (the bandwidth a batch-1 decode reaches; the machine's bound is the comparison);
4. and, over the served side, the CPU each tier spent per output token (/proc): the
   gateway, the workers outside their engine threads (event loop, gRPC, stream plumbing),
   the engine threads, and this client. On cores shared with the engine, what the tiers
   and the client spend is what the served TPOT pays on top of the engine's.

TPOT is measured the same way on both sides: (last token - first token) / (tokens - 1)
per request, the mean over requests. Both sides sample alike: greedy by default,
`--sampling temperature=1.0,top_p=0.95` (say) for sampled streams.
`python -m pdserve.bench.served_overhead --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from pdserve.bench.clients import OpenAIHTTPClient
from pdserve.bench.metrics import tpot_s
from pdserve.bench.runner import run_benchmark
from pdserve.bench.thread_cpu import ThreadCPU, cpu_between, threads_cpu
from pdserve.bench.workloads import BenchRequest, fixed
from pdserve.cli_up import usable_cores
from pdserve.cluster import (
    ClusterConfig,
    Endpoints,
    Layout,
    LocalCluster,
    assign_cpus,
    choose_layout,
    shared_core_openmp_env,
)
from pdserve.os_thread import ENGINE_THREAD_NAME


@dataclass(frozen=True)
class EngineSide:
    tpot_ms: float  # mean over requests, as a client would count it
    decode_step_ms: float  # mean of the steps that decoded all N and prefilled nothing
    weight_bytes: int  # what one decode step streams from memory (linears + lm_head)


@dataclass(frozen=True)
class TierCPU:
    """CPU microseconds per output token over the served side, by where it was spent."""

    gateway_us: float
    worker_us: float  # the workers' threads other than the engine's
    engine_us: float  # the engine threads (and their OpenMP teams)
    client_us: float  # this benchmark's own HTTP client

    @classmethod
    def between(cls, before: list[ThreadCPU], after: list[ThreadCPU], gateway_pid: int,
                client_pid: int, tokens: int) -> TierCPU:
        us = {"gateway": 0.0, "worker": 0.0, "engine": 0.0, "client": 0.0}
        for t in cpu_between(before, after):
            where = ("gateway" if t.pid == gateway_pid else "client" if t.pid == client_pid
                     else "engine" if t.name == ENGINE_THREAD_NAME else "worker")
            us[where] += t.cpu_s
        n = max(tokens, 1)
        return cls(**{f"{k}_us": 1e6 * v / n for k, v in us.items()})


@dataclass(frozen=True)
class Row:
    streams: int
    round: int
    engine_tpot_ms: float
    engine_decode_step_ms: float
    served_tpot_ms: float
    served_lost: int
    weight_gb_per_s: float | None  # batch 1 only
    cpu: TierCPU

    @property
    def ratio(self) -> float:
        return self.served_tpot_ms / self.engine_tpot_ms


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads in full: every layer's linears and the
    output projection (the embedding is read one row per token, the norms are tiny); their
    int8 copies where the model is quantized, their GGUF blocks where it streams those
    (pdserve.engine.gguf_blocks; the head's own rows where it has no blocks)."""
    if model.lm_head_int8 is not None:
        return model.lm_head_int8.nbytes + sum(q.nbytes for lw in model.layers
                                               for q in lw.int8.values())
    n = model.lm_head.numel() * model.lm_head.element_size()
    blocks = model.gguf_blocks
    if blocks is not None:
        return blocks.nbytes + (n if blocks.head is None else 0)
    for lw in model.layers:
        for t in (lw.qkv, lw.o, lw.gate_up, lw.down):
            n += t.numel() * t.element_size()
    return n


GREEDY = {"temperature": 0.0}
SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                 "repetition_penalty": float, "presence_penalty": float,
                 "frequency_penalty": float}


def sampling_fields(text: str) -> dict[str, float | int]:
    """`temperature=1.0,top_p=0.95` -> {"temperature": 1.0, "top_p": 0.95}."""
    out: dict[str, float | int] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in SAMPLING_KEYS:
            raise argparse.ArgumentTypeError(
                f"{part!r}: expected KEY=VALUE with KEY one of {', '.join(SAMPLING_KEYS)}")
        try:
            out[key] = SAMPLING_KEYS[key](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: {value!r} is not a number") from None
    return out


def engine_side(engine, requests: list[BenchRequest], sampling: dict[str, float | int]
                ) -> EngineSide:
    """Run `requests` at once in `engine`, timing each request's tokens per step."""
    from pdserve.protocol import SamplingParams

    times: dict[str, list[float]] = {}
    for r in requests:
        rid = f"bench-{time.monotonic_ns()}-{r.request_id}"
        engine.add_request(rid, r.prompt, SamplingParams(
            max_tokens=r.output_tokens, ignore_eos=True, **sampling))
        times[rid] = []
    engine.trace = []
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.request_id in times and d.new_token_ids:
                times[d.request_id].append(now)
    n = len(requests)
    decode_steps = [t.total_seconds for t in engine.trace
                    if len(t.scheduled) == n and all(k == 1 for _, k in t.scheduled)]
    engine.trace = None
    tpots = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    return EngineSide(1e3 * statistics.mean(tpots),
                      1e3 * statistics.mean(decode_steps) if decode_steps else float("nan"),
                      weight_bytes(engine.model))


def _cluster_threads(endpoints: Endpoints) -> list[ThreadCPU]:
    pids = [endpoints.gateway_pid, os.getpid(), *(w.pid for w in endpoints.workers)]
    return [t for pid in pids for t in threads_cpu(pid)]


async def served_side(endpoints: Endpoints, model: str, requests: list[BenchRequest],
                      sampling: dict[str, float | int] = GREEDY
                      ) -> tuple[float, int, TierCPU]:
    """(mean TPOT ms, requests lost, CPU per token by tier) of `requests` sent at once
    through the gateway."""
    before = _cluster_threads(endpoints)
    async with OpenAIHTTPClient(endpoints.http_url, model, endpoint="completions",
                                extra_body=sampling) as client:
        result = await run_benchmark(client, requests, label="served", progress=False)
    ok = [r for r in result.records if r.ok]
    cpu = TierCPU.between(before, _cluster_threads(endpoints), endpoints.gateway_pid,
                          os.getpid(), sum(r.output_tokens for r in ok))
    tpots = [v for v in map(tpot_s, ok) if v is not None]
    return 1e3 * statistics.mean(tpots), len(result.records) - len(ok), cpu


def _layout(a: argparse.Namespace) -> Layout:
    cores = usable_cores(a.cpus)
    if a.layout == "colocated":
        return choose_layout(cores, 0, 1)
    if a.layout == "disaggregated":
        return choose_layout(cores, 1, 1)
    return choose_layout(cores)


def run(a: argparse.Namespace) -> list[Row]:
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    layout = _layout(a)
    engine_args = ("--dtype", a.dtype, "--kv-cache-memory", a.kv_cache_memory,
                   "--quantization", a.quantization)
    cluster = LocalCluster(ClusterConfig(
        model=a.model, num_prefill=layout.num_prefill, num_decode=layout.num_decode,
        http_port=0, grpc_port=0, cpus=a.cpus, engine_args=engine_args,
        decode_args=("--stream-interval", str(a.stream_interval)),
        gateway_args=("--decode-streams", a.decode_streams)))
    print(f"layout: {layout.describe()}", file=sys.stderr)
    rows: list[Row] = []
    own = os.sched_getaffinity(0)
    try:
        cluster.start()
        endpoints = cluster.wait_healthy(timeout=600)
        decode = next(w for w in endpoints.workers if w.tier == "decode")
        cores = set(decode.cpus or own)
        engine = LLMEngine(EngineConfig(model=a.model, dtype=a.dtype,
                                        kv_cache_memory=a.kv_cache_memory,
                                        quantization=None if a.quantization == "none"
                                        else a.quantization,
                                        num_threads=len(cores), show_progress=False))
        print(f"engine in-process: {torch.get_num_threads()} thread(s) on cores "
              f"{sorted(cores)}; dtype {engine.config.dtype}", file=sys.stderr)
        for rnd in range(a.rounds):
            for n in a.streams:
                reqs = fixed(engine.tokenizer, n, seed=rnd, input_len=a.prompt_tokens,
                             output_len=a.output_tokens)
                os.sched_setaffinity(0, cores)
                try:
                    eng = engine_side(engine, reqs, a.sampling)
                finally:
                    os.sched_setaffinity(0, own)
                served, lost, cpu = asyncio.run(served_side(endpoints, a.model, reqs,
                                                                a.sampling))
                gbs = None
                if n == 1:
                    gbs = eng.weight_bytes / (eng.decode_step_ms / 1e3) / 1e9
                row = Row(n, rnd, eng.tpot_ms, eng.decode_step_ms, served, lost, gbs, cpu)
                rows.append(row)
                print(_line(row), flush=True)
    finally:
        cluster.stop()
    return rows


def _line(r: Row) -> str:
    gbs = f"   weights {r.weight_gb_per_s:.1f} GB/s" if r.weight_gb_per_s is not None else ""
    c = r.cpu
    return (f"streams {r.streams:>3} round {r.round}: engine TPOT {r.engine_tpot_ms:7.1f} ms "
            f"(decode step {r.engine_decode_step_ms:7.1f} ms)   served TPOT "
            f"{r.served_tpot_ms:7.1f} ms   served/engine {r.ratio:.3f}   lost "
            f"{r.served_lost}{gbs}\n    CPU us per output token: gateway {c.gateway_us:.0f}, "
            f"workers outside the engine {c.worker_us:.0f}, engine {c.engine_us:.0f}, "
            f"client {c.client_us:.0f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.served_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--quantization", default="none", choices=["none", "int8"])
    p.add_argument("--layout", default="auto", choices=["auto", "colocated", "disaggregated"],
                   help="auto: what `pdserve up` picks on this machine")
    p.add_argument("--cpus", default="auto", metavar="auto|none|SPEC",
                   help="the cluster's cores, as `pdserve up --cpus` takes them (default auto); "
                        "the engine side runs on the decode worker's cores with as many threads")
    p.add_argument("--streams", default="1,64",
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="stream counts to measure, comma-separated (default 1,64)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="interleaved repetitions")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="the decode worker's --stream-interval (default 1)")
    p.add_argument("--decode-streams", default="session", choices=["session", "per-request"],
                   help="the gateway's --decode-streams (default session)")
    p.add_argument("--sampling", default=GREEDY, type=sampling_fields,
                   metavar="KEY=VALUE,...",
                   help=f"how both sides sample ({', '.join(SAMPLING_KEYS)}; default greedy, "
                        f"temperature=0)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    return p


def _same_wait_policy(a: argparse.Namespace, argv: list[str]) -> None:
    """Re-run this process with the OpenMP wait policy the decode worker gets (the runtime
    reads it once, at load), so the engine side is timed as the worker computes."""
    layout = _layout(a)
    cpus = assign_cpus(a.cpus, layout.num_prefill, layout.num_decode)
    extra = () if LocalCluster._cores_exclusive(cpus) else shared_core_openmp_env(os.environ)
    if extra:
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *argv],
                  {**os.environ, **dict(extra)})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    _same_wait_policy(a, argv)
    print(" ".join(f"{k}={os.environ.get(k, '(unset)')}"
                   for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")), file=sys.stderr)
    rows = run(a)
    for n in a.streams:
        mine = [r for r in rows if r.streams == n]
        # the engine's in-process step wanders between rounds on a shared VM: the ratio of
        # the two sides' medians beside the median of the per-round ratios
        served = statistics.median(r.served_tpot_ms for r in mine)
        engine = statistics.median(r.engine_tpot_ms for r in mine)
        print(f"streams {n}: median served/engine TPOT "
              f"{statistics.median(r.ratio for r in mine):.3f} over {len(mine)} round(s); "
              f"median served {served:.2f} ms / median engine {engine:.2f} ms = "
              f"{served / engine:.3f}")
    if a.json:
        # the run took minutes: a --json into a folder not made yet must not lose it
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([{**asdict(r), "ratio": r.ratio} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
