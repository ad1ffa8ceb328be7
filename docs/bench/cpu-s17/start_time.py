"""Seconds from spawning a local cluster (`pdserve.cluster.LocalCluster`, as `pdserve up`)
to healthy, and to stopped: MODEL with NUM_PREFILL prefill workers, one decode worker and
the gateway.
    python docs/bench/cpu-s17/start_time.py MODEL NUM_PREFILL
"""
import sys
import time

from pdserve.cluster import ClusterConfig, LocalCluster

t0 = time.perf_counter()
cluster = LocalCluster(ClusterConfig(model=sys.argv[1], num_prefill=int(sys.argv[2]),
                                     num_decode=1, http_port=0, grpc_port=0))
cluster.start()
cluster.wait_healthy(timeout=300)
t1 = time.perf_counter()
cluster.stop()
print(f"healthy after {t1 - t0:.2f} s, stopped {time.perf_counter() - t1:.2f} s later")
