"""`python -m pdserve.prefill_worker`: run one decode-tier worker until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pdserve.kvtransfer.shm_sender import KV_TRANSPORT_MODES
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
    p.add_argument("--kv-transport", choices=KV_TRANSPORT_MODES, default="auto",
                   help="grpc: KV payloads in the Push messages; auto: through the decode "
                        "worker's shared memory when it offers it on this host, gRPC "
                        "otherwise; shm: shared memory or fail the request (default auto)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.prefill_worker.server import PrefillWorker

    worker = PrefillWorker(worker_config_from_args(a), max_chunk_bytes=a.max_chunk_bytes,
                           kv_transport=a.kv_transport)
    asyncio.run(run_until_signal(worker.start, worker.stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
