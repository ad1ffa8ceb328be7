"""Harness for the gateway's end-to-end tests (no tests here): real workers and a real
gateway on 127.0.0.1, served from one asyncio loop on a background thread so that
synchronous clients (the `openai` package, urllib) can drive them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any

from conftest import tiny_engine

from pdserve.gateway.server import Gateway, GatewayConfig
from pdserve.worker_runtime import WorkerConfig


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class Cluster:
    """A gateway plus workers that register with it, all in this process."""

    def __init__(self, model_dir: str, **gateway_kw) -> None:
        self.model_dir = model_dir
        self.lt = LoopThread()
        gateway_kw.setdefault("heartbeat_timeout_s", 2.0)
        self.gateway = Gateway(GatewayConfig(model=model_dir, http_port=0, grpc_port=0,
                                             **gateway_kw))
        self.lt.run(self.gateway.start())
        self.workers: list[Any] = []

    @property
    def base_url(self) -> str:
        return self.gateway.http_url + "/v1"

    def add_worker(self, kind: str, register: bool = True, **engine_kw) -> Any:
        from pdserve.decode_worker.server import DecodeWorker
        from pdserve.prefill_worker.server import PrefillWorker

        engine_kw.setdefault("num_threads", 1)
        engine = tiny_engine(self.model_dir, **engine_kw)
        cls = DecodeWorker if kind == "decode" else PrefillWorker
        cfg = WorkerConfig(engine=engine.config, heartbeat_interval_s=0.3,
                           gateways=(self.gateway.registry_address,) if register else ())
        w = cls(cfg, engine=engine)
        self.lt.run(w.start())
        if register:
            self.wait_for(lambda: any(x.address == w.address
                                      for x in self.gateway.registry.all()))
        self.workers.append(w)
        return w

    def crash(self, w: Any) -> None:
        """Stop a worker the way a crash would: no Deregister, heartbeats just stop."""
        async def kill() -> None:
            for r in w.registrations:
                r._task.cancel()
            await w.grpc.stop(0)
        self.lt.run(kill())
        self.workers.remove(w)

    def wait_for(self, pred, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < end, "condition not met in time"
            time.sleep(0.05)

    def blocks(self, w: Any) -> tuple[int, int]:
        s = self.lt.run(w.stats())
        return s.load.free_blocks, s.load.total_blocks

    def assert_no_leaks(self, timeout: float = 10.0) -> None:
        """Every worker's free blocks back to its total (cancels are asynchronous), and the
        gateway counts no request in flight anywhere (its routing load)."""
        end = time.monotonic() + timeout
        while self.gateway.orchestrator.inflight:
            assert time.monotonic() < end, f"in flight: {self.gateway.orchestrator.inflight}"
            time.sleep(0.05)
        for w in self.workers:
            while True:
                free, total = self.blocks(w)
                if free == total:
                    break
                assert time.monotonic() < end, f"{w.worker_id}: {total - free} blocks held"
                time.sleep(0.05)

    def close(self) -> None:
        for w in self.workers:
            self.lt.run(w.stop(0.5))
        self.lt.run(self.gateway.stop(1.0))
        self.lt.close()
