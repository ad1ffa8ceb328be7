"""pdserve.event_loop: the tiers run on uvloop where it is installed, on asyncio's loop when
`PDSERVE_EVENT_LOOP=asyncio` says so; and gRPC's I/O runs on its iomgr poller
(`pdserve.GRPC_EXPERIMENTS`)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys

import pytest

import pdserve
from pdserve import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_uvloop_by_default(monkeypatch):
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_asyncio_when_asked(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.loop_name() == "asyncio"
    assert event_loop.run(_loop_module()).startswith("asyncio")


_GRPC_PROBE = """
import os, sys
import pdserve
print(os.environ["GRPC_EXPERIMENTS"])
import asyncio, grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=10)
    await server.stop(None)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

asyncio.run(main())
"""


def _probe(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _GRPC_PROBE], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    # a name grpc does not know is logged (an ERROR line at every start) and ignored
    assert "Unknown experiment" not in out.stderr, out.stderr
    return out.stdout.split()


def test_grpc_runs_on_iomgr_unless_the_user_chose():
    """Importing pdserve puts grpc on its iomgr poller (pdserve.GRPC_EXPERIMENTS) before
    grpc starts, grpc knows every name in it, and a grpc.aio call works there; a
    GRPC_EXPERIMENTS the user set wins."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _probe(env) == [pdserve.GRPC_EXPERIMENTS, "SERVING"]
    assert _probe({**env, "GRPC_EXPERIMENTS": "event_engine_client"}) == [
        "event_engine_client", "SERVING"]
