"""`python -m pdserve.prefill_worker`: run one prefill-tier worker until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pdserve.prefill_worker.service import DEFAULT_MAX_QUEUE
from pdserve.worker_runtime import add_worker_args, run_until_signal, worker_config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.prefill_worker",
        description="A pdserve prefill worker: batches prompts (chunked, prefix-cached), "
                    "samples each one's first token and pushes its KV, layer by layer, to the "
                    "decode worker that reserved it.")
    add_worker_args(p)
    p.add_argument("--max-chunk-bytes", type=int, default=1 << 20,
                   help="largest KV payload per transfer message (default 1 MiB)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="Prefill calls queued or computing at once; more are refused at once "
                        f"with RESOURCE_EXHAUSTED (the gateway tries another prefill worker; "
                        f"default {DEFAULT_MAX_QUEUE}, 0 = no limit)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.prefill_worker.server import PrefillWorker

    worker = PrefillWorker(worker_config_from_args(a), max_chunk_bytes=a.max_chunk_bytes,
                           max_queue=a.max_queue)
    asyncio.run(run_until_signal(worker.start, worker.stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
