"""The request life cycle across tiers, as the gateway drives it.

    admitted (gateway queue, by priority)
      ├─ colocated: D.Generate(prompt) ─────────────────────────────▶ token stream from D
      └─ disaggregated: D.Reserve(prompt) → D.Decode(reservation) opened
                        → P.Prefill(prompt, dest=D, reservation) ───▶ token stream from D
    → detokenize, apply stop strings → deltas to the client → finished | failed

Decode workers are tried best first (router.py): a Reserve or colocated Generate refused
with RESOURCE_EXHAUSTED or UNAVAILABLE moves on to the next one; when all refuse, the
client gets RESOURCE_EXHAUSTED (or UNAVAILABLE). Prefill workers likewise on
RESOURCE_EXHAUSTED. A failed Prefill cancels the reservation at D. Whenever the request
ends before its stream does — stop string, client gone, deadline, error — D is told to
Cancel it so its blocks free at once. Every request ends in a final delta or a
`GatewayError` (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED,
CANCELLED): the request runs in its own task under its deadline, so nothing hangs.
Metrics are recorded here, where the request is seen end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.gateway import router
from pdserve.gateway.admission import AdmissionController, Overloaded
from pdserve.gateway.channels import WorkerChannels
from pdserve.gateway.convert import logprobs_from_proto
from pdserve.gateway.errors import ErrorKind, GatewayError, from_worker_status
from pdserve.gateway.output import TextOutput
from pdserve.gateway.registry import Role, Worker, WorkerRegistry
from pdserve.gateway.request import GenerationDelta, GenerationRequest, RequestTiming, Usage
from pdserve.metrics import TierMetrics, TokenTimer
from pdserve.protocol import ABORT, STOP, finish_from_proto
from pdserve.protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger("pdserve.gateway")

_RETRY_ON = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


@dataclass
class _Trace:
    """What one request's metrics need, filled in as it goes."""

    gateway_queue_s: float = 0.0
    prefill: prefill_pb2.PrefillResponse | None = None
    final: decode_pb2.TokenChunk | None = None


class _Outbox:
    """One request's deltas on their way to its client: at most `limit` wait unread. A
    client that leaves them unread for `timeout_s` is dropped (CANCELLED), so a slow reader
    holds a bounded buffer and its worker is told to stop."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self._q: asyncio.Queue[GenerationDelta | BaseException] = asyncio.Queue()
        self._room = asyncio.Event()
        self.limit = limit
        self.timeout_s = timeout_s

    async def put(self, d: GenerationDelta) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                while self._q.qsize() >= self.limit:
                    self._room.clear()
                    await self._room.wait()
        except TimeoutError:
            raise GatewayError(ErrorKind.CANCELLED, f"the client read nothing for "
                               f"{self.timeout_s:g}s; request dropped") from None
        self._q.put_nowait(d)

    def fail(self, e: BaseException) -> None:
        """The request's end as an error: never waits (one item past the limit at most)."""
        self._q.put_nowait(e)

    async def get(self) -> GenerationDelta | BaseException:
        item = await self._q.get()
        self._room.set()
        return item


class Orchestrator:
    def __init__(self, registry: WorkerRegistry, channels: WorkerChannels,
                 admission: AdmissionController, metrics: TierMetrics, tokenizer: Any | None,
                 disagg_threshold: int = 0, max_pending_deltas: int = 64,
                 reader_timeout_s: float = 30.0) -> None:
        self.max_pending_deltas = max_pending_deltas
        self.reader_timeout_s = reader_timeout_s
        self.registry = registry
        self.channels = channels
        self.admission = admission
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.disagg_threshold = disagg_threshold
        self.inflight: dict[str, int] = {}  # worker_id -> this gateway's requests there
        self._tasks: set[asyncio.Task] = set()

    # -- the public entry -------------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream a request's deltas; raises GatewayError. Leaving early cancels it."""
        out = _Outbox(self.max_pending_deltas, self.reader_timeout_s)
        task = asyncio.get_running_loop().create_task(self._run(req, out))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        ended = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
                if item.finished:
                    ended = True
                    return
        finally:
            if not ended:
                task.cancel()  # the client left: the task cancels it at the worker

    async def drain(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    # -- one request, in its own task -------------------------------------------------------
    async def _run(self, req: GenerationRequest,
                   out: _Outbox) -> None:
        m = self.metrics
        try:
            try:
                async with asyncio.timeout_at(req.deadline):
                    await self._admit(req)
                    t_admit = time.monotonic()
                    try:
                        trace = _Trace(gateway_queue_s=t_admit - req.arrival)
                        await self._serve(req, trace, out.put)
                    finally:
                        self.admission.release(time.monotonic() - t_admit)
            except TimeoutError:
                raise GatewayError(ErrorKind.DEADLINE, f"timeout: the request's deadline of "
                                   f"{req.timeout_s:g}s passed", "timeout") from None
        except GatewayError as e:
            m.error(e.code)
            out.fail(e)
        except asyncio.CancelledError:
            m.error(grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as e:  # a bug: the client still gets an explicit status
            log.exception("request %s failed", req.request_id)
            m.error(grpc.StatusCode.UNAVAILABLE.name)
            out.fail(GatewayError(ErrorKind.UNAVAILABLE, f"internal error: {e}"))

    async def _admit(self, req: GenerationRequest) -> None:
        try:
            await self.admission.acquire(req.priority)
        except Overloaded as e:
            raise GatewayError(ErrorKind.OVERLOADED, str(e),
                               retry_after_s=e.retry_after_s) from None

    async def _serve(self, req: GenerationRequest, trace: _Trace,
                     emit: Callable[[GenerationDelta], Awaitable[None]]) -> None:
        decodes = self.registry.alive(Role.DECODE)
        if not decodes:
            raise GatewayError(ErrorKind.UNAVAILABLE, "no decode worker is available")
        prefills = self.registry.alive(Role.PREFILL)
        n = len(req.prompt_token_ids)
        if router.disaggregate(n, self.disagg_threshold, len(prefills)):
            chunks = self._disaggregated(req, decodes, prefills, trace)
        else:
            chunks = self._colocated(req, decodes)
        out = TextOutput(self.tokenizer, req.prompt_token_ids, req.stop)
        timer = TokenTimer(self.metrics, req.arrival)
        async with contextlib.aclosing(chunks):
            async for ch in chunks:
                ids = tuple(ch.token_ids)
                timer.arrived(len(ids))
                text = out.add(ids)
                lps = logprobs_from_proto(ch.logprobs)
                if out.stopped or ch.finish_reason:
                    if out.stopped:
                        reason = "stop"  # leaving the loop cancels the request at D
                    else:
                        reason = finish_from_proto(ch.finish_reason) or STOP
                        if reason == ABORT:
                            raise GatewayError(ErrorKind.UNAVAILABLE,
                                               "the decode worker aborted the request")
                        text += out.finish()
                        trace.final = ch
                    await emit(self._finish(req, trace, text, ids, lps, reason, ch, timer))
                    return
                if ids or text:
                    await emit(GenerationDelta(text, ids, lps))
        raise GatewayError(ErrorKind.UNAVAILABLE, "the worker's stream ended unfinished")

    def _finish(self, req: GenerationRequest, trace: _Trace, text: str, ids: tuple[int, ...],
                lps: tuple, reason: str, last: decode_pb2.TokenChunk, timer: TokenTimer
                ) -> GenerationDelta:
        m, now = self.metrics, time.monotonic()
        num_out = timer.count
        final = trace.final or last
        pf = trace.prefill
        num_prompt = final.num_prompt_tokens or len(req.prompt_token_ids)
        cached = final.num_cached_tokens or (pf.num_cached_tokens if pf else 0)
        dt = final.timing if trace.final is not None else common_pb2.Timing()
        if pf is not None:  # the prefill worker's own account of its part is authoritative
            timing = RequestTiming(trace.gateway_queue_s + pf.timing.queue_s,
                                   pf.timing.compute_s, pf.timing.transfer_s, dt.decode_s)
            m.kv_transfer_seconds.observe(timing.transfer_s)
            m.kv_transfer_bytes.observe(pf.transfer_bytes)
        else:
            timing = RequestTiming(trace.gateway_queue_s + dt.queue_s, dt.prefill_s,
                                   dt.transfer_s, dt.decode_s)
        m.e2e.observe(now - req.arrival)
        m.queue_time.observe(timing.queue_s)
        m.prefill_time.observe(timing.prefill_s)
        m.decode_time.observe(timing.decode_s)
        timer.observe_tpot()
        m.prompt_tokens.inc(num_prompt)
        m.generation_tokens.inc(num_out)
        m.success(reason)
        return GenerationDelta(text, ids, lps, reason, Usage(num_prompt, num_out, cached),
                               timing)

    # -- worker streams ---------------------------------------------------------------------
    def _enter(self, w: Worker) -> None:
        self.inflight[w.worker_id] = self.inflight.get(w.worker_id, 0) + 1

    def _leave(self, w: Worker) -> None:
        n = self.inflight.get(w.worker_id, 0) - 1
        if n > 0:
            self.inflight[w.worker_id] = n
        else:
            self.inflight.pop(w.worker_id, None)

    @staticmethod
    def _remaining(req: GenerationRequest) -> float | None:
        d = req.deadline
        # a little after the request's own deadline, which fires first with a clear message
        return None if d is None else max(0.001, d - time.monotonic()) + 0.5

    async def _colocated(self, req: GenerationRequest, decodes: list[Worker]
                         ) -> AsyncIterator[decode_pb2.TokenChunk]:
        msg = decode_pb2.ColocatedGenerateRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling=req.params.to_proto())
        last: GatewayError | None = None
        for w in router.rank_decode(decodes, len(req.prompt_token_ids), self.inflight):
            call = self.channels.get(w.address).decode.Generate(
                msg, timeout=self._remaining(req))
            self._enter(w)
            started = finished = False
            try:
                async for ch in call:
                    started = True
                    finished = bool(ch.finish_reason)
                    yield ch
                    if finished:
                        return
                raise GatewayError(ErrorKind.UNAVAILABLE,
                                   f"decode worker {w.address} ended the stream unfinished")
            except grpc.aio.AioRpcError as e:
                err = from_worker_status(e.code(), e.details(), f"decode worker {w.address}")
                if started or e.code() not in _RETRY_ON:
                    raise err from None
                last = err
            finally:
                self._leave(w)
                if not finished:  # harmless when the worker never admitted it
                    call.cancel()
                    self.channels.cancel(w.address, request_id=req.request_id,
                                         reason="gateway: request ended")
        raise last or GatewayError(ErrorKind.UNAVAILABLE, "no decode worker is available")

    async def _reserve(self, req: GenerationRequest, decodes: list[Worker]
                       ) -> tuple[Worker, decode_pb2.ReserveResponse]:
        msg = decode_pb2.ReserveRequest(request_id=req.request_id,
                                        prompt_token_ids=req.prompt_token_ids,
                                        sampling=req.params.to_proto())
        last: GatewayError | None = None
        for w in router.rank_decode(decodes, len(req.prompt_token_ids), self.inflight):
            # counted from the moment it is chosen, not once the reservation returns: requests
            # routed while this Reserve is on the wire must see it, or a burst all lands on
            # the one worker that looked idle
            self._enter(w)
            try:
                resp = await self.channels.get(w.address).decode.Reserve(
                    msg, timeout=self._remaining(req))
                return w, resp  # the caller leaves w when the request ends
            except grpc.aio.AioRpcError as e:
                self._leave(w)
                err = from_worker_status(e.code(), e.details(), f"decode worker {w.address}")
                if e.code() not in _RETRY_ON:
                    raise err from None
                last = err
            except BaseException:
                self._leave(w)
                raise
        assert last is not None
        raise last

    async def _prefill(self, req: GenerationRequest, d: Worker,
                       resv: decode_pb2.ReserveResponse, prefills: list[Worker]
                       ) -> prefill_pb2.PrefillResponse:
        msg = prefill_pb2.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            # max_tokens goes to the decode worker only: prefill samples the first token
            sampling=req.params.to_proto(with_max_tokens=False), decode_address=d.address,
            reservation_id=resv.reservation_id, reserved_blocks=resv.num_blocks,
            decode_kv_spec=resv.kv_spec)
        last: GatewayError | None = None
        for p in router.rank_prefill(prefills, req.prompt_token_ids, self.inflight):
            self._enter(p)
            try:
                return await self.channels.get(p.address).prefill.Prefill(
                    msg, timeout=self._remaining(req))
            except grpc.aio.AioRpcError as e:
                err = from_worker_status(e.code(), e.details(), f"prefill worker {p.address}")
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise err from None
                last = err
            finally:
                self._leave(p)
        assert last is not None
        raise last

    async def _disaggregated(self, req: GenerationRequest, decodes: list[Worker],
                             prefills: list[Worker], trace: _Trace
                             ) -> AsyncIterator[decode_pb2.TokenChunk]:
        d, resv = await self._reserve(req, decodes)  # d counts as in flight from here
        call = None
        finished = False
        try:
            call = self.channels.get(d.address).decode.Decode(
                decode_pb2.DecodeRequest(reservation_id=resv.reservation_id),
                timeout=self._remaining(req))
            trace.prefill = await self._prefill(req, d, resv, prefills)
            async for ch in call:
                finished = bool(ch.finish_reason)
                yield ch
                if finished:
                    return
            raise GatewayError(ErrorKind.UNAVAILABLE,
                               f"decode worker {d.address} ended the stream unfinished")
        except grpc.aio.AioRpcError as e:
            raise from_worker_status(e.code(), e.details(),
                                     f"decode worker {d.address}") from None
        finally:
            self._leave(d)
            if not finished:
                if call is not None:
                    call.cancel()
                self.channels.cancel(d.address, reservation_id=resv.reservation_id,
                                     reason="gateway: request ended")
