"""The standard gRPC health (`grpc.health.v1`) and reflection services on a server, set up
one way for the gateway and the workers.

Life cycle: `GrpcHealth(server, names)` registers both before the server starts, with every
name NOT_SERVING; `set_serving(True)` once requests would be served, `set_serving(False)`
before stopping.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class GrpcHealth:
    def __init__(self, server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        # "" is the whole server; reflection copies the list: every name is known up front
        self.names = ("", *service_names)
        reflection.enable_server_reflection(
            (*service_names, HEALTH_SERVICE, reflection.SERVICE_NAME), server)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.names:
            await self.servicer.set(name, status)
