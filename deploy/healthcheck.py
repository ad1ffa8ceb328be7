"""Container health check: exit 0 when the gRPC health service on localhost:PORT (service
"") reports SERVING, 1 otherwise. Usage: python deploy/healthcheck.py PORT"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    port = int(argv[1])
    with grpc.insecure_channel(f"localhost:{port}") as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                     timeout=2.0)
        except grpc.RpcError:
            return 1
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
