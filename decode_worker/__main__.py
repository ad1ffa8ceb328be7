"""`python -m pdserve.decode_worker` and `pdserve decode`: run one decode-tier worker until
SIGTERM. Both go through `build_parser` (the one definition of its flags) and `run`."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import event_loop
from pdserve.kvtransfer.shm import DEFAULT_POOL_BYTES
from pdserve.kvtransfer.shm_sender import KV_TRANSPORT_MODES
from pdserve.worker_runtime import add_worker_args, run_until_signal, worker_config_from_args

DESCRIPTION = ("A pdserve decode worker: reserves KV blocks, receives KV from prefill workers "
               "(KVTransfer service on the same port), continuously batches generation, and "
               "serves colocated requests.")


def build_parser(prog: str = "python -m pdserve.decode_worker") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_worker_args(p)
    p.add_argument("--reservation-timeout", type=float, default=30.0,
                   help="seconds before a reservation whose KV never commits is freed "
                        "(default 30)")
    p.add_argument("--kv-transport", choices=KV_TRANSPORT_MODES, default="auto",
                   help="grpc: KV payloads always in the Push messages; shm/auto: offer "
                        "same-host prefill workers a shared-memory segment per reservation "
                        "(default auto)")
    p.add_argument("--kv-shm-bytes", type=int, default=DEFAULT_POOL_BYTES,
                   help="most bytes of shared-memory segments held at once; reservations "
                        "past it get gRPC payloads (default 2 GiB)")
    return p


def run(a: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 for a bad flag value. Logging is the caller's."""
    from pdserve.decode_worker.server import DecodeWorker

    try:
        config = worker_config_from_args(a, reservation_timeout_s=a.reservation_timeout)
    except ValueError as e:
        print(f"decode worker: {e}", file=sys.stderr)
        return 2
    worker = DecodeWorker(config, kv_transport=a.kv_transport, kv_shm_bytes=a.kv_shm_bytes)
    event_loop.run(run_until_signal(worker.start, worker.stop))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
