"""`python -m pdserve.prefill_worker` and `pdserve prefill`: run one prefill-tier worker until
SIGTERM. Both go through `build_parser` (the one definition of its flags) and `run`."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import event_loop
from pdserve.kvtransfer.shm_sender import KV_TRANSPORT_MODES
from pdserve.prefill_worker.service import DEFAULT_MAX_QUEUE
from pdserve.worker_runtime import add_worker_args, run_until_signal, worker_config_from_args

DESCRIPTION = ("A pdserve prefill worker: batches prompts (chunked, prefix-cached), samples "
               "each one's first token and pushes its KV, layer by layer, to the decode "
               "worker that reserved it.")


def build_parser(prog: str = "python -m pdserve.prefill_worker") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_worker_args(p)
    p.add_argument("--max-chunk-bytes", type=int, default=1 << 20,
                   help="largest KV payload per transfer message (default 1 MiB)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="Prefill calls queued or computing at once; more are refused at once "
                        f"with RESOURCE_EXHAUSTED (the gateway tries another prefill worker; "
                        f"default {DEFAULT_MAX_QUEUE}, 0 = no limit)")
    p.add_argument("--kv-transport", choices=KV_TRANSPORT_MODES, default="auto",
                   help="grpc: KV payloads in the Push messages; auto: through the decode "
                        "worker's shared memory when it offers it on this host, gRPC "
                        "otherwise; shm: shared memory or fail the request (default auto)")
    return p


def run(a: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 for a bad flag value. Logging is the caller's."""
    from pdserve.prefill_worker.server import PrefillWorker

    try:
        config = worker_config_from_args(a)
    except ValueError as e:
        print(f"prefill worker: {e}", file=sys.stderr)
        return 2
    worker = PrefillWorker(config, max_chunk_bytes=a.max_chunk_bytes, max_queue=a.max_queue,
                           kv_transport=a.kv_transport)
    event_loop.run(run_until_signal(worker.start, worker.stop))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
