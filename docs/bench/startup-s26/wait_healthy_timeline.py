"""When `LocalCluster.wait_healthy` returns, against when the tiers were up (their logs), for
a tiny random-weight model. Run from the repository root:

    .venv/bin/python docs/bench/startup-s26/wait_healthy_timeline.py

Session 26: 20.8 s before e488158, 5.1-5.4 s after; the tiers logged ready at ~4 s."""

import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())

from pdserve.cluster import ClusterConfig, LocalCluster  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402


def main() -> None:
    model = make_tiny_model(tempfile.mkdtemp() + "/m")
    cluster = LocalCluster(ClusterConfig(model=model, num_prefill=1, num_decode=1,
                                         http_port=0, grpc_port=0,
                                         engine_args=("--kv-cache-memory", "64MiB")))
    t0 = time.monotonic()
    cluster.start()
    try:
        cluster.wait_healthy(120, progress=lambda s: print(f"{time.monotonic() - t0:6.2f} {s}",
                                                           flush=True))
        print(f"{time.monotonic() - t0:6.2f} healthy; tier logs in {cluster.log_dir}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
