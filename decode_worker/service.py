"""The DecodeWorker gRPC servicer: translates messages to engine calls and back.

    Reserve   -> ReservationTable.reserve   (RESOURCE_EXHAUSTED when the pool has no room),
                 plus a shared-memory segment offer for same-host senders when enabled
    Decode    -> stream the reserved request's tokens; starts when its KV commits
    Generate  -> colocated: this worker prefills and decodes
    Session   -> many Decode / Generate streams on one call, one message per batch of
                 chunks ready together (session.py)
    Cancel    -> release a reservation or abort a running request; blocks free next step
    Stats     -> load for the gateway's router

A stream that ends early (client gone, cancelled) aborts its request, so blocks never leak.
A stream with nothing to say for `keepalive_s` (waiting for KV, queued, a slow prefill)
sends an empty TokenChunk, so the gateway can tell a quiet worker from a stalled one.
With `stream_interval` N > 1 a request's tokens go out N at a time (its first token, its
end, and whatever is held when a keepalive is due go out at once): N tokens then cost one
message through this worker, the gateway and the client's stream.
Engine failures end a stream with INTERNAL and the reason; an engine stopped under it with
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from pdserve.convert import kv_spec_to_proto, logprobs_to_proto
from pdserve.deadlines import STREAM_KEEPALIVE_S
from pdserve.decode_worker.reservations import ReservationTable
from pdserve.decode_worker.session import StreamRefused, StreamSession
from pdserve.engine.async_engine import AsyncEngine, EngineFailed, RequestError
from pdserve.engine.llm_engine import SeqDelta
from pdserve.kvtransfer.shm import ShmSegmentPool, kv_bytes, offer_to_proto
from pdserve.metrics import TierMetrics, TokenTimer
from pdserve.protocol import ABORT, SamplingParams, finish_to_proto
from pdserve.protos.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("pdserve.decode")


class DecodeService(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, aengine: AsyncEngine, table: ReservationTable, metrics: TierMetrics,
                 stats: Callable[[], Awaitable[common_pb2.StatsResponse]],
                 shm: ShmSegmentPool | None = None,
                 keepalive_s: float = STREAM_KEEPALIVE_S, stream_interval: int = 1,
                 colocated_refusal: Callable[[], str | None] = lambda: None) -> None:
        """colocated_refusal(): why the worker turns new colocated work away now (None: it
        takes it); the server's own check on Generate, which a Session's Generate streams
        go through too."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, not {stream_interval}")
        self.aengine = aengine
        self.shm = shm
        self.keepalive_s = keepalive_s
        self.stream_interval = stream_interval
        self.table = table
        self.metrics = metrics
        self._stats = stats
        self._colocated_refusal = colocated_refusal
        self._sessions: set[StreamSession] = set()

    async def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> decode_pb2.ReserveResponse:
        try:
            params = SamplingParams.from_proto(request.sampling)
            rid, nblocks, secret = await self.table.reserve(
                request.request_id or uuid.uuid4().hex, list(request.prompt_token_ids), params)
        except ValueError as e:
            self.metrics.error("INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            self.metrics.error("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        resp = decode_pb2.ReserveResponse(reservation_id=rid, num_blocks=nblocks,
                                          kv_spec=kv_spec_to_proto(self.table.kv_spec),
                                          reservation_secret=secret)
        if self.shm is not None:  # None when full: that transfer sends gRPC payloads
            offer = self.shm.offer(rid, kv_bytes(self.table.kv_spec, nblocks))
            if offer is not None:
                resp.shm.CopyFrom(offer_to_proto(offer))
        return resp

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[decode_pb2.TokenChunk]:
        async for chunk in self._answer(self.decode_chunks(request), context):
            yield chunk

    async def Generate(self, request: decode_pb2.ColocatedGenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.TokenChunk]:
        async for chunk in self._answer(self.generate_chunks(request), context):
            yield chunk

    async def Session(self, request_iterator: AsyncIterator[decode_pb2.SessionUp],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[decode_pb2.SessionDown]:
        session = StreamSession(self, self._colocated_refusal)
        self._sessions.add(session)
        try:
            async for message in session.run(request_iterator):
                yield message
        finally:
            self._sessions.discard(session)

    def end_sessions(self) -> None:
        """The worker is stopping: each session ends once its streams have (opening new
        ones is refused), so the server's stop does not wait for the gateways to hang up."""
        for session in self._sessions:
            session.end()

    @staticmethod
    async def _answer(chunks: AsyncIterator[decode_pb2.TokenChunk],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.TokenChunk]:
        """A stream's chunks as a call's messages; a refusal ends the call with its status."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        except StreamRefused as e:
            await context.abort(e.code, e.details)

    async def decode_chunks(self, request: decode_pb2.DecodeRequest
                            ) -> AsyncIterator[decode_pb2.TokenChunk]:
        """A reserved request's chunks, from its KV commit on; StreamRefused: NOT_FOUND for
        an unknown reservation, the engine's failure."""
        rid = request.reservation_id
        request_id = self.table.request_id(rid)
        if request_id is None:
            raise StreamRefused(grpc.StatusCode.NOT_FOUND, f"reservation_id: {rid!r} unknown "
                                "(expired, cancelled or never made)")
        timer = TokenTimer(self.metrics, time.monotonic())
        try:
            async for chunk in self._stream(request_id, timer, rid):
                yield chunk
        except RequestError as e:
            raise self._engine_error(e) from None
        finally:
            # a stream that ends before KV committed frees the reservation
            self.table.release(rid, "decode stream closed before commit")
            self.table.forget(rid)

    async def generate_chunks(self, request: decode_pb2.ColocatedGenerateRequest
                              ) -> AsyncIterator[decode_pb2.TokenChunk]:
        """A colocated request's chunks; StreamRefused: INVALID_ARGUMENT for a request the
        engine refuses, the engine's failure."""
        request_id = request.request_id or uuid.uuid4().hex
        timer = TokenTimer(self.metrics, time.monotonic())
        try:
            params = SamplingParams.from_proto(request.sampling)
            # the engine thread takes the request between steps: behind a long one (a big
            # prefill chunk on a slow CPU) the stream keeps its keepalives going, or the
            # gateway would take the wait for a stall and move the request
            added = asyncio.ensure_future(self.aengine.add_request(
                request_id, list(request.prompt_token_ids), params))
            try:
                while not (await asyncio.wait([added], timeout=self.keepalive_s))[0]:
                    yield decode_pb2.TokenChunk()  # keepalive: no tokens, not finished
            finally:
                added.cancel()  # the stream left first: the request is taken back
            added.result()
        except ValueError as e:
            self.metrics.error("INVALID_ARGUMENT")
            raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        try:
            async for chunk in self._stream(request_id, timer, None):
                yield chunk
        except RequestError as e:
            raise self._engine_error(e) from None

    def _engine_error(self, e: RequestError) -> StreamRefused:
        code = (grpc.StatusCode.INTERNAL if isinstance(e, EngineFailed)
                else grpc.StatusCode.UNAVAILABLE)
        self.metrics.error(code.name)
        return StreamRefused(code, str(e))

    async def _stream(self, request_id: str, timer: TokenTimer, reservation_id: str | None
                      ) -> AsyncIterator[decode_pb2.TokenChunk]:
        """One TokenChunk per batch of deltas: when the engine is ahead of this stream (a
        burst, a slow reader) every token already produced goes out in one message; with a
        stream interval, batches are held until that many tokens are ready."""
        held: list[SeqDelta] = []
        sent_first = False
        async for batch in self.aengine.stream_batches(request_id, self.keepalive_s):
            if not batch:
                if held:  # a keepalive is due: what is held goes instead
                    yield self._chunk(held, timer, reservation_id)
                    held = []
                else:
                    yield decode_pb2.TokenChunk()  # keepalive: no tokens, not finished
                continue
            held += batch
            if (sent_first and not held[-1].finished
                    and sum(len(d.new_token_ids) for d in held) < self.stream_interval):
                continue
            sent_first = True
            yield self._chunk(held, timer, reservation_id)
            held = []

    def _chunk(self, batch: list[SeqDelta], timer: TokenTimer, reservation_id: str | None
               ) -> decode_pb2.TokenChunk:
        last = batch[-1]
        if len(batch) == 1:
            ids, lps = last.new_token_ids, last.new_logprobs
        else:
            ids = [t for d in batch for t in d.new_token_ids]
            lps = [lp for d in batch for lp in d.new_logprobs]
        timer.arrived(len(ids))
        chunk = decode_pb2.TokenChunk(
            token_ids=ids, num_prompt_tokens=last.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens,
            num_cached_tokens=last.num_cached_tokens)
        if lps:
            chunk.logprobs.extend(logprobs_to_proto(lp) for lp in lps)
        if last.finished:
            chunk.finish_reason = finish_to_proto(last.finish_reason or ABORT)
            chunk.timing.CopyFrom(self._timing(last, timer, reservation_id))
            self._finished(timer, last.finish_reason or ABORT)
        return chunk

    def _finished(self, timer: TokenTimer, reason: str) -> None:
        m = self.metrics
        m.e2e.observe(time.monotonic() - timer.start)
        timer.observe_tpot()
        if timer.count > 1:
            m.decode_time.observe(timer.last - timer.first)
        m.success(reason)

    def _timing(self, d: SeqDelta, timer: TokenTimer, reservation_id: str | None
                ) -> common_pb2.Timing:
        now = time.monotonic()
        started = d.first_scheduled_time or d.arrival_time
        if reservation_id is None:  # colocated: queue, then prefill up to the first token
            first = timer.first or now
            queue_s = started - d.arrival_time
            self.metrics.queue_time.observe(queue_s)
            self.metrics.prefill_time.observe(max(0.0, first - started))
            return common_pb2.Timing(queue_s=queue_s, prefill_s=max(0.0, first - started),
                                     decode_s=now - first)
        commit = self.table.commits.pop(d.request_id, None)
        t = common_pb2.Timing(decode_s=now - started)
        if commit is not None:
            t.queue_s = commit.queue_s
            t.prefill_s = commit.compute_s
            t.transfer_s = commit.transfer_s
        return t

    async def Cancel(self, request: decode_pb2.CancelRequest, context: grpc.aio.ServicerContext
                     ) -> decode_pb2.CancelResponse:
        which = request.WhichOneof("target")
        if which == "reservation_id":
            rid = request.reservation_id
            if self.table.release(rid, request.reason or "cancelled"):
                return decode_pb2.CancelResponse(found=True)
            request_id = self.table.request_id(rid)
            if request_id is None:
                return decode_pb2.CancelResponse(found=False)
        elif which == "request_id":
            request_id = request.request_id
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "target: give a request_id or a reservation_id")
        return decode_pb2.CancelResponse(found=await self.aengine.abort_and_wait(request_id))

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.StatsResponse:
        return await self._stats()
