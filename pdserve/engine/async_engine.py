"""AsyncEngine: an LLMEngine stepped on its own thread, driven from asyncio.

The engine thread owns every piece of engine state (scheduler, pool, sequences, the KV
cache): asyncio callers never touch it directly but send commands (add, abort, and the KV
connector's reserve / write / commit / abort) that the thread applies between steps, in
the order sent, and receive each request's `SeqDelta`s on an asyncio queue. So RPC
handlers stay responsive while the model computes, and a request submitted during a step
joins the running batch at the next one. What callers may read is the `EngineStats`
snapshot the thread publishes after every step (prefix hashes included).

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
from collections import deque
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.deadlines import IdleWatch
from pdserve.engine.cpu_kernels.build import KernelBuildError
from pdserve.engine.cpu_kernels.team_affinity import pin_team
from pdserve.engine.kv_connector import KVReservation, KVSaver
from pdserve.engine.llm_engine import LLMEngine, SeqDelta
from pdserve.engine.sequence import SequenceStatus
from pdserve.os_thread import ENGINE_THREAD_NAME, name_this_thread
from pdserve.protocol import SamplingParams, TokenLogprobs

log = logging.getLogger("pdserve.engine")


class RequestError(RuntimeError):
    """The engine could not finish a request (it failed or was shut down)."""


class EngineFailed(RequestError):
    """A step raised: every request in it failed. Until a later step succeeds the engine
    counts as failed (`AsyncEngine.failure`)."""


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
    step_seconds: float  # engine steps' wall time, summed (schedule to bookkeeping)
    forward_seconds: float  # the model forwards alone within them
    # hashes of the cached prefix blocks, newest last, at most `max_prefix_hashes`
    prefix_hashes: tuple[int, ...] = ()


_STOP = object()


def _pin_team(cores: Seq[int]) -> None:
    try:
        size = pin_team(cores)
    except (KernelBuildError, OSError, ValueError) as e:
        log.warning("engine threads left unpinned: %s", e)
        return
    log.info("engine step thread on core %d, its %d other thread(s) on cores %s", cores[0],
             size - 1, ",".join(map(str, cores[1:])))


# queued on a stream by its IdleWatch: "nothing for idle_s", read as an empty batch
_KEEPALIVE = object()


class AsyncEngine:
    RATE_WINDOW_S = 5.0  # EngineStats.tokens_per_s: the tokens delivered over this long

    def __init__(self, engine: LLMEngine, max_prefix_hashes: int = 0) -> None:
        """max_prefix_hashes: how many cached prefix hashes the stats carry (0: none)."""
        self.engine = engine
        self.max_prefix_hashes = max_prefix_hashes
        self._cmds: queue.Queue[Any] = queue.Queue()
        # KV writes wait here, not in _cmds: one drain command applies all that are queued
        self._kv_writes: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._kv_lock = threading.Lock()
        self._kv_drain_queued = False  # a _drain_kv_writes is in _cmds or running
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._rate_window: deque[tuple[float, int]] = deque()
        self._rate_sum = 0  # tokens in _rate_window
        self._hashes: tuple[int, ...] = ()
        self._hash_version = -1
        self._stats = self._snapshot()
        self.step_listeners: list[Callable[[list[SeqDelta]], None]] = []
        self.failure: str | None = None  # the last step's error; None once a step succeeds

    # -- life cycle -------------------------------------------------------------------------
    def start(self, pin_cores: Seq[int] | None = None) -> None:
        """Start the engine thread. pin_cores (two or more): it runs on pin_cores[0] and
        its OpenMP team's other threads on the rest (`cpu_kernels.team_affinity`); where
        they cannot be pinned it says so once and runs unpinned."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, args=(pin_cores,), name="engine-loop",
                                        daemon=True)
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
                          params: SamplingParams, prefill_only: bool = False,
                          kv_saver: KVSaver | None = None) -> None:
        """Queue a request; ValueError (naming the field) when it is invalid. A
        `kv_saver` receives the prompt's KV layer by layer (the KV connector's save side)."""
        self._open_stream(request_id)
        try:
            await self._call(lambda: self.engine.add_request(
                request_id, prompt_token_ids, params, prefill_only, kv_saver) and None)
        except BaseException as e:
            self._streams.pop(request_id, None)
            if not isinstance(e, Exception):
                # cancelled: the engine thread may be adding it now, with nobody left to
                # read it; an abort queued behind the add takes it out (a no-op otherwise)
                self.abort(request_id)
            raise

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, prefill_only: bool = False,
                       kv_saver: KVSaver | None = None) -> AsyncIterator[SeqDelta]:
        """Add a request and stream its deltas; leaving early (cancel, close) aborts it."""
        await self.add_request(request_id, prompt_token_ids, params, prefill_only, kv_saver)
        async for delta in self.stream(request_id):
            yield delta

    async def stream(self, request_id: str) -> AsyncIterator[SeqDelta]:
        """A request's deltas one by one (`stream_batches`, flattened)."""
        async for batch in self.stream_batches(request_id):
            for delta in batch:
                yield delta

    async def stream_batches(self, request_id: str, idle_s: float | None = None
                             ) -> AsyncIterator[list[SeqDelta]]:
        """A request's deltas, every one queued when the reader comes back taken at once
        (a reader slower than the engine gets several steps per batch, so it pays its
        per-message cost once for all of them); with `idle_s`, an empty batch whenever that
        long passes without one. The last batch ends with the finished delta. Leaving
        early aborts the request."""
        q = self._streams.get(request_id)
        if q is None:
            raise KeyError(request_id)

        def keepalive() -> bool:  # idle_s without a batch: an empty one, and go on
            q.put_nowait(_KEEPALIVE)
            return True

        idle = IdleWatch(idle_s, keepalive, armed=True) if idle_s is not None else None
        finished = False
        try:
            while not finished:
                item = await q.get()
                batch: list[SeqDelta] = []
                while not isinstance(item, BaseException):
                    if item is not _KEEPALIVE:
                        batch.append(item)
                        if item.finished:
                            break
                    if q.empty():
                        break
                    item = q.get_nowait()
                if batch:
                    finished = batch[-1].finished
                    if idle is not None:
                        idle.arm()
                    yield batch
                elif item is _KEEPALIVE:
                    yield []
                if isinstance(item, BaseException):
                    raise item
        finally:
            if idle is not None:
                idle.cancel()
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

    def _abort_now(self, request_id: str,
                   abort: Callable[[str], SeqDelta | None] | None = None) -> bool:
        delta = (abort or self.engine.abort_request)(request_id)
        if delta is not None:
            # as after a step: the stats that count its freed blocks before its last delta
            self._stats = self._snapshot()
            self._publish([delta])
        return delta is not None

    # -- the KV connector's load side: every call is applied on the engine thread --------
    async def reserve(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> KVReservation:
        """Blocks for a prompt whose KV is pushed from elsewhere; ValueError: an invalid
        request, RuntimeError: no room."""
        self._open_stream(request_id)
        try:
            return await self._call(lambda: self.engine.kv_connector.reserve(
                request_id, prompt_token_ids, params))
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    def write_kv(self, request_id: str, layer: int, block_indices: Seq[int],
                 k: torch.Tensor, v: torch.Tensor, crc32c: int | None = None
                 ) -> concurrent.futures.Future:
        """Queue a write of KV into a reservation's blocks (logical indices; k and v
        `[L, n, ...]` for layers `layer` ..), checked against `crc32c` (the connector's
        `write`), and return at once: the engine thread applies
        it at the next step boundary, before any later command. k and v must stay
        unchanged until then. The future resolves when it was applied (None), or with its
        error (ChecksumMismatch, KeyError, ...); a failed write also makes the
        reservation's commit fail, so nobody has to wait for the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        write = (lambda: self.engine.kv_connector.write(
            request_id, layer, block_indices, k, v, crc32c), fut)
        with self._kv_lock:
            self._kv_writes.append(write)
            if self._kv_drain_queued:
                return fut  # the queued drain takes it
            self._kv_drain_queued = True
        self._cmds.put((self._drain_kv_writes, None))
        return fut

    def _drain_kv_writes(self) -> None:
        """Applies every queued KV write, those queued while it runs included: one engine
        command (one queue hand-off, one wake-up) for however many chunks arrived
        meanwhile. A write queued before another command is applied before it (a drain
        was queued ahead of that command, or is running and finds it); one queued after
        may be applied sooner, which is safe: `KVConnector.write` checks that the
        reservation is still waiting for KV when it runs."""
        while True:
            with self._kv_lock:
                if not self._kv_writes:
                    self._kv_drain_queued = False
                    return
                write = self._kv_writes.popleft()
            self._apply(write)

    async def commit(self, request_id: str, first_token: int,
                     logprobs: TokenLogprobs | None = None) -> None:
        """The reserved prompt's KV is written (every `write_kv` before this is applied
        first): join the batch with the first token. ValueError (naming the field) when a
        token id is out of range, KeyError when the reservation is gone; either way the
        engine is unchanged."""
        await self._call(lambda: self._publish(
            [self.engine.kv_connector.commit(request_id, first_token, logprobs)]))

    async def cancel_reservation(self, request_id: str) -> bool:
        """Free a reservation's blocks; a stream waiting on it ends with "abort"."""
        return await self._call(
            lambda: self._abort_now(request_id, self.engine.kv_connector.abort))

    def stats(self) -> EngineStats:
        return self._stats

    # -- the engine thread ------------------------------------------------------------------
    def _run(self, pin_cores: Seq[int] | None) -> None:
        name_this_thread(ENGINE_THREAD_NAME)
        if pin_cores:
            _pin_team(pin_cores)
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
            deltas: list[SeqDelta] = []
            if eng.has_unfinished():
                try:
                    deltas = eng.step()
                except Exception as e:  # a bug or OOM: fail every request, keep serving
                    log.exception("engine step failed")
                    self.failure = f"engine step failed: {e}"
                    self._fail_all(EngineFailed(self.failure))
                    continue
                self.failure = None
            # the stats first: a client that has seen its request finish must not then read
            # stats from before the step that freed its blocks
            self._stats = self._snapshot()
            self._publish(deltas)

    def _apply(self, cmd: tuple[Callable[[], Any], concurrent.futures.Future | None]) -> None:
        fn, fut = cmd
        if fut is not None and not fut.set_running_or_notify_cancel():
            return  # the caller gave up before the command ran: do nothing
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
        self._rate_sum += len(deltas)
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
        window = self._rate_window
        while window and now - window[0][0] > self.RATE_WINDOW_S:
            self._rate_sum -= window.popleft()[1]
        rate = self._rate_sum / self.RATE_WINDOW_S
        reserved = sum(1 for q in eng.seqs.values()
                       if q.status == SequenceStatus.WAITING_FOR_KV)
        if self.max_prefix_hashes and eng.pool.hash_version != self._hash_version:
            self._hashes = tuple(eng.pool.cached_hashes(self.max_prefix_hashes))
            self._hash_version = eng.pool.hash_version
        return EngineStats(len(s.running), len(s.waiting), reserved, ps.free, ps.total,
                           ps.cached, eng.counters.prompt_tokens,
                           eng.counters.generation_tokens, ps.prefix_queries, ps.prefix_hits,
                           s.num_preemptions, rate, eng.counters.steps,
                           eng.counters.step_seconds, eng.counters.forward_seconds,
                           self._hashes)
