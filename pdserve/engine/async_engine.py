"""AsyncEngine: an LLMEngine stepped on its own thread, driven from asyncio.

The engine thread owns every piece of engine state (scheduler, pool, sequences): asyncio
callers never touch it directly but send commands (add, abort, reserve, commit) that the
thread applies between steps, and receive each request's `SeqDelta`s on an asyncio queue.
So RPC handlers stay responsive while the model computes, and a request submitted during a
step joins the running batch at the next one.

A request's stream ends with a delta whose `finished` is True, or with an exception
(`RequestError`) when the engine failed it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.llm_engine import LLMEngine, SeqDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import SequenceStatus, TokenLogprobs

log = logging.getLogger("pdserve.engine")


class RequestError(RuntimeError):
    """The engine could not finish a request (it failed or was shut down)."""


class EngineFailed(RequestError):
    """A step raised: every request in it failed. Until a later step succeeds the engine
    counts as failed (`AsyncEngine.failure`)."""


@dataclass(frozen=True)
class Reservation:
    request_id: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    reserved: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    tokens_per_s: float  # generated tokens/s over the recent window
    steps: int


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = self._snapshot()
        self._rate_window: list[tuple[float, int]] = []
        self.step_listeners: list[Callable[[list[SeqDelta]], None]] = []
        self.failure: str | None = None  # the last step's error; None once a step succeeds

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._cmds.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # -- commands (asyncio side) ------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        return await asyncio.wrap_future(fut)

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, prefill_only: bool = False) -> None:
        """Queue a request; ValueError (naming the field) when it is invalid."""
        self._open_stream(request_id)
        try:
            await self._call(lambda: self.engine.add_request(
                request_id, prompt_token_ids, params, prefill_only) and None)
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, prefill_only: bool = False
                       ) -> AsyncIterator[SeqDelta]:
        """Add a request and stream its deltas; leaving early (cancel, close) aborts it."""
        await self.add_request(request_id, prompt_token_ids, params, prefill_only)
        async for delta in self.stream(request_id):
            yield delta

    async def stream(self, request_id: str) -> AsyncIterator[SeqDelta]:
        q = self._streams.get(request_id)
        if q is None:
            raise KeyError(request_id)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary; its blocks return to the pool and its stream
        ends with finish_reason "abort". Idempotent."""
        self._cmds.put((lambda: self._abort_now(request_id), None))

    async def abort_and_wait(self, request_id: str) -> bool:
        """Like `abort`; True when the request was still live."""
        return await self._call(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> bool:
        delta = self.engine.abort_request(request_id)
        if delta is not None:
            self._publish([delta])
        return delta is not None

    async def reserve(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> Reservation:
        """Blocks for a prompt whose KV is pushed from elsewhere; RuntimeError when full."""
        self._open_stream(request_id)

        def do() -> Reservation:
            seq = self.engine.reserve(request_id, prompt_token_ids, params)
            return Reservation(request_id, tuple(seq.block_table), seq.num_prompt_tokens)
        try:
            return await self._call(do)
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    async def commit(self, request_id: str, first_token: int,
                     logprobs: TokenLogprobs | None = None) -> None:
        """The reserved prompt's KV is written: join the batch with the first token."""
        await self._call(lambda: self._publish(
            [self.engine.commit_remote_kv(request_id, first_token, logprobs)]))

    async def cancel_reservation(self, request_id: str) -> bool:
        """Free a reservation's blocks; a stream waiting on it ends with "abort"."""
        return await self._call(lambda: self._abort_now(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    async def run_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (for inspection in tests)."""
        return await self._call(lambda: fn(self.engine))

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            block = not eng.has_unfinished()
            try:
                cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    self._fail_all(RequestError("engine stopped"))
                    return
                self._apply(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if eng.has_unfinished():
                try:
                    deltas = eng.step()
                except Exception as e:  # a bug or OOM: fail every request, keep serving
                    log.exception("engine step failed")
                    self.failure = f"engine step failed: {e}"
                    self._fail_all(EngineFailed(self.failure))
                    continue
                self.failure = None
                self._publish(deltas)
            self._stats = self._snapshot()

    def _apply(self, cmd: tuple[Callable[[], Any], concurrent.futures.Future | None]) -> None:
        fn, fut = cmd
        try:
            result = fn()
        except Exception as e:
            if fut is not None:
                fut.set_exception(e)
            else:
                log.exception("engine command failed")
            return
        if fut is not None:
            fut.set_result(result)

    def _publish(self, deltas: list[SeqDelta]) -> None:
        if not deltas:
            return
        now = time.monotonic()
        self._rate_window.append((now, len(deltas)))
        for fn in self.step_listeners:
            fn(deltas)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, deltas)

    def _deliver(self, deltas: list[SeqDelta]) -> None:
        for d in deltas:
            q = self._streams.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(self.engine.seqs):
            self.engine.abort_request(rid)  # streams get `err` below instead of a delta
        if self._loop is not None:
            def fail() -> None:
                for q in self._streams.values():
                    q.put_nowait(err)
            self._loop.call_soon_threadsafe(fail)

    def _snapshot(self) -> EngineStats:
        eng = self.engine
        s = eng.scheduler
        ps = eng.pool.stats()
        now = time.monotonic()
        window = getattr(self, "_rate_window", [])
        while window and now - window[0][0] > 5.0:
            window.pop(0)
        rate = sum(n for _, n in window) / 5.0 if window else 0.0
        reserved = sum(1 for q in eng.seqs.values()
                       if q.status == SequenceStatus.WAITING_FOR_KV)
        return EngineStats(len(s.running), len(s.waiting), reserved, ps.free, ps.total,
                           ps.cached, eng.counters.prompt_tokens,
                           eng.counters.generation_tokens, ps.prefix_queries, ps.prefix_hits,
                           s.num_preemptions, rate, eng.counters.steps)
