"""`python -m pdserve.gateway` and `pdserve gateway`: run the gateway (gRPC + OpenAI HTTP)
until SIGTERM/SIGINT. Both go through `build_parser` (the one definition of its flags) and
`run`.

The gateway needs no advertised address: it hands its own address to no one (workers dial
the one they were given with --gateway, clients the one they were told), so --host is both
what it binds and what it reports."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pdserve import event_loop
from pdserve.cluster_auth import add_credential_args, credentials_from_args
from pdserve.engine.model_files import hide_torch, resolve_model
from pdserve.gateway.planner import PlannerConfig, PlannerMode
from pdserve.gateway.server import Gateway, GatewayConfig

_D = GatewayConfig(model="")
_P = PlannerConfig()


DESCRIPTION = ("The pdserve gateway: the gRPC Gateway API and an OpenAI-compatible HTTP API in "
               "one process. It tokenizes, admits, routes each request to a decode worker "
               "(and a prefill worker), and streams the tokens back. Workers register "
               "themselves over gRPC, or are listed with --prefill and --decode. Loads the "
               "tokenizer and config only, never weights.")


def build_parser(prog: str = "python -m pdserve.gateway") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    p.add_argument("--model", required=True,
                   help="model id served, as the workers were given it: the alias "
                        "'smollm2-135m', a Hugging Face directory or a .gguf file")
    p.add_argument("--host", default=_D.host,
                   help=f"address both servers bind to (default {_D.host})")
    p.add_argument("--http-port", type=int, default=_D.http_port,
                   help=f"OpenAI HTTP port, 0 picks a free one (default {_D.http_port})")
    p.add_argument("--grpc-port", type=int, default=_D.grpc_port,
                   help=f"gRPC port, 0 picks a free one (default {_D.grpc_port})")
    p.add_argument("--registry-port", type=int, default=None,
                   help="internal gRPC port where workers register (their --gateway); the "
                        "cluster credential is required there. Keep it off the public "
                        "network. 0 picks a free one (default: --grpc-port + 1)")
    p.add_argument("--prefill", default="", metavar="ADDRS",
                   help="static prefill workers, host:port,... (polled via Stats)")
    p.add_argument("--decode", default="", metavar="ADDRS",
                   help="static decode workers, host:port,... (polled via Stats)")
    p.add_argument("--disagg-threshold", type=int, default=_D.disagg_threshold, metavar="N",
                   help="prompts shorter than N tokens run colocated on a decode worker; "
                        "0 always disaggregates (default 0). Without prefill workers every "
                        "request runs colocated")
    p.add_argument("--max-queue", type=int, default=_D.max_queue, metavar="N",
                   help="requests waiting for admission, all priorities together; more are "
                        f"refused with 429 / RESOURCE_EXHAUSTED (default {_D.max_queue})")
    p.add_argument("--max-body-bytes", type=int, default=_D.max_body_bytes, metavar="N",
                   help="largest HTTP request body; larger ones are refused with 413 before "
                        f"they are read (default {_D.max_body_bytes})")
    p.add_argument("--max-inflight", type=int, default=_D.max_inflight, metavar="N",
                   help=f"requests in flight to the workers at once (default {_D.max_inflight})")
    p.add_argument("--heartbeat-timeout", type=float, default=_D.heartbeat_timeout_s,
                   metavar="S", help="a worker silent this many seconds gets no more traffic "
                                     f"(default {_D.heartbeat_timeout_s:g})")
    p.add_argument("--default-max-tokens", type=int, default=_D.default_max_tokens,
                   metavar="N", help="max_tokens when a request sets none (capped by the "
                                     f"context left; default {_D.default_max_tokens})")
    p.add_argument("--grace", type=float, default=_D.grace_s, metavar="S",
                   help=f"on SIGTERM, seconds in-flight requests get to finish "
                        f"(default {_D.grace_s:g})")
    add_credential_args(p)
    p.add_argument("--rpc-timeout", type=float, default=_D.rpc_timeout_s, metavar="S",
                   help="deadline of every unary call to a worker (Reserve, Prefill, ...), "
                        "or the request's own time left when shorter; a worker that does not "
                        f"answer in time is passed over (default {_D.rpc_timeout_s:g})")
    p.add_argument("--stream-idle-timeout", type=float, default=_D.stream_idle_s, metavar="S",
                   help="a worker's token stream that shows nothing (no token, no keepalive) "
                        f"for S seconds fails with 503 / UNAVAILABLE (default "
                        f"{_D.stream_idle_s:g})")
    p.add_argument("--decode-streams", choices=("session", "per-request"), default="session",
                   help="how a decode worker's token streams reach this gateway: 'session' "
                        "(default) carries all of this gateway's requests at one worker on "
                        "one call, a step's tokens in one message; 'per-request' opens a "
                        "call per request, a message per token (the cost per token that "
                        "sessions remove; also what a worker without sessions gets)")
    g = p.add_argument_group("planner (moves switchable workers between the tiers)")
    g.add_argument("--planner", choices=[m.value for m in PlannerMode], default=_P.mode.value,
                   help="off: never move a worker; queue: follow prefill queue depth and "
                        "decode KV usage; slo: also TTFT vs --ttft-slo and TPOT vs "
                        "--tpot-slo (default off). Only workers started with "
                        "`python -m pdserve.role_worker` are moved")
    g.add_argument("--ttft-slo", type=float, default=_P.ttft_slo_s, metavar="S",
                   help=f"time-to-first-token objective, seconds (default {_P.ttft_slo_s:g})")
    g.add_argument("--tpot-slo", type=float, default=_P.tpot_slo_s, metavar="S",
                   help=f"time-per-output-token objective, seconds (default {_P.tpot_slo_s:g})")
    g.add_argument("--planner-sustain", type=float, default=_P.sustain_s, metavar="S",
                   help="a tier's pressure must hold this long before a worker moves "
                        f"(default {_P.sustain_s:g})")
    g.add_argument("--planner-min-prefill", type=int, default=_P.min_prefill, metavar="N",
                   help="prefill workers the planner always leaves; 0 lets the last one go "
                        f"(decode workers then prefill colocated; default {_P.min_prefill})")
    g.add_argument("--planner-dwell", type=float, default=_P.dwell_s, metavar="S",
                   help=f"at least S seconds between two switches (default {_P.dwell_s:g})")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    return p


def config_from_args(a: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        model=a.model, host=a.host, http_port=a.http_port, grpc_port=a.grpc_port,
        registry_port=a.registry_port, credentials=credentials_from_args(a),
        prefill=tuple(filter(None, a.prefill.split(","))),
        decode=tuple(filter(None, a.decode.split(","))), disagg_threshold=a.disagg_threshold,
        max_queue=a.max_queue, max_inflight=a.max_inflight,
        heartbeat_timeout_s=a.heartbeat_timeout, default_max_tokens=a.default_max_tokens,
        max_body_bytes=a.max_body_bytes, grace_s=a.grace, rpc_timeout_s=a.rpc_timeout,
        stream_idle_s=a.stream_idle_timeout, decode_sessions=a.decode_streams == "session",
        planner=PlannerConfig(mode=PlannerMode(a.planner), ttft_slo_s=a.ttft_slo,
                              tpot_slo_s=a.tpot_slo, sustain_s=a.planner_sustain,
                              dwell_s=a.planner_dwell, min_prefill=a.planner_min_prefill))


async def serve(config: GatewayConfig) -> None:
    gw = Gateway(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await gw.start()
    print(f"gateway ready: grpc={gw.grpc_address} http={gw.http_url} "
          f"registry={gw.registry_address}", file=sys.stderr, flush=True)
    await stop.wait()
    await gw.stop()


def run(a: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 for a bad flag value. Logging is the caller's."""
    try:
        config = config_from_args(a)
        resolve_model(config.model)  # a model that is not there is a flag error
    except (ValueError, OSError) as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    # this process runs no model: keep transformers from loading torch for the config and
    # tokenizer (a GGUF's are read from their export, made by a child process that may)
    hide_torch()
    event_loop.run(serve(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
