"""The request life cycle across tiers, as the gateway drives it.

    admitted (gateway queue, by priority)
      ├─ colocated: D.Generate(prompt) ─────────────────────────────▶ token stream from D
      └─ disaggregated: a place in the prefill backlog (waits while the prefill tier is
                        busy, holding nothing that expires; prefill_backlog.py)
                        → D.Reserve(prompt) → D.Decode(reservation) opened
                        → P.Prefill(prompt, dest=D, reservation) ───▶ token stream from D
           └─ P failed: cancel the reservation, next P with a fresh one; none left: colocated
      └─ D's stream broke: re-admit colocated, prompt + tokens streamed (migration.py), ≤ 3×
    → detokenize, apply stop strings → deltas to the client → finished | failed

Decode workers are tried best first (router.py), prefill workers likewise, under one retry
policy (`_may_retry`): a worker that refused before doing any work (RESOURCE_EXHAUSTED, or
UNAVAILABLE / no answer in time before anything started) is passed over for the next one;
when all refuse, the client gets the last refusal. Once work began, a failure is migration's
business (gateway/migration.py): a failed prefill fails over to the next prefill worker or
to colocated; a broken token stream is re-admitted elsewhere from what it already streamed,
so the client's stream continues and greedy output is unchanged. Each move counts in
`pdserve:request_migrations_total{reason=prefill_failover|decode_migration}`. A worker the
registry drops (heartbeats stopped) fails its requests' calls there at once (`drop_worker`,
inflight.py), not at their deadlines: a Prefill call fails over when its prefill worker is
dropped and migrates when its decode worker is, since its KV has nowhere to go.

A prefill worker is paired only with decode workers of its KV layout (router.py), and the
decode_address it is sent, which it dials and pushes KV to, is always a decode worker
registered here (`_check_destination`): the gateway is the only caller a worker trusts (the
cluster credential), so it never hands out an address from anywhere else.

Nothing waits without bound (pdserve.deadlines): every unary call runs under
min(rpc timeout, the request's time left); a token stream that shows nothing — no token, no
keepalive — for the stream idle timeout ends in UNAVAILABLE. An engine failure at a worker
(INTERNAL) reaches the client as INTERNAL / HTTP 500 with its reason. Whenever the request
ends before its stream does — stop string, client gone, deadline, error — D is told to
Cancel it so its blocks free at once. Every request ends in a final delta or a
`GatewayError` (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED,
CANCELLED, INTERNAL): the request runs in its own task under its deadline, so nothing hangs.
Metrics are recorded here, where the request is seen end to end. Workers know a request by
its `cluster_id`, minted by the gateway; the client's `request_id` never leaves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.deadlines import (
    DEFAULT_RPC_TIMEOUT_S,
    DEFAULT_STREAM_IDLE_S,
    IdleWatch,
    call_timeout,
)
from pdserve.gateway import migration, router
from pdserve.gateway.admission import AdmissionController, Overloaded
from pdserve.gateway.channels import WorkerChannels
from pdserve.gateway.convert import logprobs_from_proto
from pdserve.gateway.errors import ErrorKind, GatewayError, from_worker_status
from pdserve.gateway.inflight import InFlight, Slot, WorkerLost, ended_by_drop
from pdserve.gateway.output import TextOutput
from pdserve.gateway.prefill_backlog import PrefillBacklog
from pdserve.gateway.registry import Role, Worker, WorkerRegistry
from pdserve.gateway.request import GenerationDelta, GenerationRequest, RequestTiming, Usage
from pdserve.metrics import TierMetrics, TokenTimer
from pdserve.protocol import STOP, finish_from_proto
from pdserve.protos.pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger("pdserve.gateway")



def _may_retry(code: grpc.StatusCode, work_started: bool) -> bool:
    """The one retry policy: another worker may take the request when this one refused it
    for capacity, or failed before any work for the request began (a prefill has begun its
    work, the push into the reservation, as soon as it is sent)."""
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED or (
        code == grpc.StatusCode.UNAVAILABLE and not work_started)


def _past_deadline(req: GenerationRequest) -> bool:
    return req.deadline is not None and time.monotonic() >= req.deadline


def _deadline_passed(req: GenerationRequest) -> GatewayError:
    return GatewayError(ErrorKind.DEADLINE, f"timeout: the request's deadline of "
                        f"{req.timeout_s:g}s passed", "timeout")


@dataclass
class _Trace:
    """What one request's metrics need, filled in as it goes."""

    gateway_queue_s: float = 0.0
    prefill: prefill_pb2.PrefillResponse | None = None
    final: decode_pb2.TokenChunk | None = None
    decode: Worker | None = None  # the decode worker of the current attempt
    migrations: int = 0


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
        if self._q.qsize() < self.limit:  # room: no timer to arm for a wait that cannot come
            self._q.put_nowait(d)
            return
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
                 disagg_threshold: int = 0, rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                 stream_idle_s: float = DEFAULT_STREAM_IDLE_S, max_pending_deltas: int = 64,
                 reader_timeout_s: float = 30.0) -> None:
        self.max_pending_deltas = max_pending_deltas
        self.reader_timeout_s = reader_timeout_s
        self.registry = registry
        self.channels = channels
        self.admission = admission
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.disagg_threshold = disagg_threshold
        self.rpc_timeout_s = rpc_timeout_s
        self.stream_idle_s = stream_idle_s
        self.inflight = InFlight()  # this gateway's requests at each worker, their calls
        self.streaming: set[TokenTimer] = set()  # the token timers of requests streaming now
        self.prefill_backlog = PrefillBacklog()
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
    async def _run(self, req: GenerationRequest, out: _Outbox) -> None:
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
                raise _deadline_passed(req) from None
        except GatewayError as e:
            m.error(e.code)
            out.fail(e)
        except asyncio.CancelledError:
            m.error(grpc.StatusCode.CANCELLED.name)
            raise
        except Exception as e:  # a bug: the client still gets an explicit status
            log.exception("request %s (cluster id %s) failed", req.request_id, req.cluster_id)
            m.error(grpc.StatusCode.INTERNAL.name)
            out.fail(GatewayError(ErrorKind.INTERNAL, f"internal error: {e}"))

    async def _admit(self, req: GenerationRequest) -> None:
        try:
            await self.admission.acquire(req.priority)
        except Overloaded as e:
            raise GatewayError(ErrorKind.OVERLOADED, str(e),
                               retry_after_s=e.retry_after_s) from None

    async def _serve(self, req: GenerationRequest, trace: _Trace,
                     emit: Callable[[GenerationDelta], Awaitable[None]]) -> None:
        out = TextOutput(self.tokenizer, req.prompt_token_ids, req.stop)
        timer = TokenTimer(self.metrics, req.arrival)
        chunks = self._migrating(req, trace)
        self.streaming.add(timer)  # its TPOT so far feeds the planner's decode signal
        try:
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
                            text += out.finish()
                            trace.final = ch
                        await emit(self._finish(req, trace, text, ids, lps, reason, ch, timer))
                        return
                    if ids or text:
                        await emit(GenerationDelta(text, ids, lps))
        finally:
            self.streaming.discard(timer)
        raise GatewayError(ErrorKind.UNAVAILABLE, "the worker's stream ended unfinished")

    async def _migrating(self, req: GenerationRequest, trace: _Trace
                         ) -> AsyncIterator[decode_pb2.TokenChunk]:
        """The request's token stream, whichever workers it takes (migration.py): each
        attempt's chunks pass through; a broken attempt is re-admitted from the tokens
        streamed so far, at most MAX_MIGRATIONS times."""
        streamed: list[int] = []
        failed: dict[str, ErrorKind] = {}  # decode worker id -> how it failed this request
        attempt = req
        while True:
            trace.decode = None
            try:
                # closed explicitly when this generator is: left to the garbage collector, an
                # attempt's cleanup (leaving its worker, cancelling its reservation) waited
                # for a cycle collection whenever a traceback held its frame
                async with contextlib.aclosing(self._attempt(
                        attempt, trace, failed, resumed=bool(streamed))) as chunks:
                    async for ch in chunks:
                        if ch.finish_reason == common_pb2.FINISH_REASON_ABORT:
                            who = trace.decode.address if trace.decode else "?"
                            raise GatewayError(ErrorKind.UNAVAILABLE,
                                               f"decode worker {who} aborted the request")
                        streamed.extend(ch.token_ids)
                        yield ch
                        if ch.finish_reason:
                            return
                raise GatewayError(ErrorKind.UNAVAILABLE, "the worker's stream ended unfinished")
            except GatewayError as e:
                if _past_deadline(req):
                    # the worker call ran out of the request's own time (its gRPC deadline
                    # is the request's): the request is over, no worker failed
                    raise _deadline_passed(req) from None
                if trace.decode is None or not migration.may_migrate(e, len(streamed)):
                    raise
                failed[trace.decode.worker_id] = e.kind
                if not migration.candidates(self.registry.alive(Role.DECODE), failed)[0]:
                    raise  # e.g. an engine failure with no other worker: the client gets it
                if trace.migrations == migration.MAX_MIGRATIONS:
                    raise GatewayError(ErrorKind.UNAVAILABLE, f"gave up after "
                                       f"{trace.migrations} migrations: {e.message}") from None
                trace.migrations += 1
                self.metrics.migrated("decode_migration")
                log.warning("request %s (cluster id %s): %s; migrating (%d of at most %d) "
                            "with %d tokens streamed", req.request_id, req.cluster_id,
                            e.message, trace.migrations, migration.MAX_MIGRATIONS,
                            len(streamed))
            if len(streamed) >= req.params.max_tokens:  # all there: only the end was lost
                yield decode_pb2.TokenChunk(finish_reason=common_pb2.FINISH_REASON_LENGTH)
                return
            attempt = migration.resumed(req, streamed, trace.migrations)

    async def _attempt(self, req: GenerationRequest, trace: _Trace,
                       failed: dict[str, ErrorKind], resumed: bool
                       ) -> AsyncIterator[decode_pb2.TokenChunk]:
        """One attempt at the request: disaggregated or colocated on the workers left to
        try. A resumed request is recomputed colocated (its prompt holds what was
        streamed)."""
        decodes, again = migration.candidates(self.registry.alive(Role.DECODE), failed)
        if not decodes:
            raise GatewayError(ErrorKind.UNAVAILABLE, "no decode worker is available")
        if again:
            await asyncio.sleep(migration.backoff_s(trace.migrations))
        # only prefill workers whose KV some decode worker here can take: none, colocated
        prefills = router.pairable_prefills(self.registry.alive(Role.PREFILL), decodes)
        n = len(req.prompt_token_ids)
        if not resumed and router.disaggregate(n, self.disagg_threshold, len(prefills)):
            chunks = self._disaggregated(req, decodes, prefills, trace)
        else:
            chunks = self._colocated(req, decodes, trace)
        async with contextlib.aclosing(chunks):
            async for ch in chunks:
                yield ch

    def _finish(self, req: GenerationRequest, trace: _Trace, text: str, ids: tuple[int, ...],
                lps: tuple, reason: str, last: decode_pb2.TokenChunk, timer: TokenTimer
                ) -> GenerationDelta:
        m, now = self.metrics, time.monotonic()
        num_out = timer.count
        final = trace.final or last
        pf = trace.prefill
        # the client's prompt, whatever a migrated attempt's prompt grew to
        num_prompt = len(req.prompt_token_ids)
        cached = min(num_prompt, final.num_cached_tokens or (pf.num_cached_tokens if pf else 0))
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
    def drop_worker(self, w: Worker, reason: str) -> None:
        """The registry dropped `w` (its heartbeats stopped): the calls requests have open
        there end now, each request failing over or migrating (inflight.py)."""
        n = self.inflight.drop(w.worker_id, reason)
        if n:
            log.warning("%s worker %s at %s dropped (%s): ending the calls of %d request(s) "
                        "there", w.role.value, w.worker_id, w.address, reason, n)

    @staticmethod
    def _remaining(req: GenerationRequest) -> float | None:
        """A token stream's deadline: none of its own (the idle bound watches it), only the
        request's, a little late so that the request's own fires first with its message."""
        d = req.deadline
        return None if d is None else max(0.001, d - time.monotonic()) + 0.5

    def _unary_timeout(self, req: GenerationRequest) -> float:
        return call_timeout(self.rpc_timeout_s, req.deadline)

    def _error(self, e: grpc.aio.AioRpcError, who: str) -> tuple[grpc.StatusCode, GatewayError]:
        """A worker call's failure: its effective status and the client's error. Our own rpc
        timeout firing (the request's deadline fires first, in `_run`) means the worker did
        not answer: UNAVAILABLE, so the next worker may be tried."""
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.UNAVAILABLE, GatewayError(
                ErrorKind.UNAVAILABLE, f"{who} did not answer within its deadline "
                f"({self.rpc_timeout_s:g}s)")
        return code, from_worker_status(code, e.details(), who)

    async def _chunks(self, call, slot: Slot) -> AsyncIterator[decode_pb2.TokenChunk]:
        """A token stream's messages under the liveness bound: each must arrive within
        `stream_idle_s` of the read that waits for it (keepalive chunks count), else
        UNAVAILABLE; at once `WorkerLost` when the registry drops the worker."""
        who = f"decode worker {slot.worker.address}"

        def stalled() -> bool:  # a read waited the bound: end the call, stop watching
            call.cancel()
            return False

        # armed only while a read waits: time the reader spends away from the call (the
        # client slower than the worker) does not count; `fired` tells this cancellation
        # from others
        watch = IdleWatch(self.stream_idle_s, stalled)
        # around the whole stream, not each read: this loop runs per token message
        try:
            with ended_by_drop(slot):
                while True:
                    watch.arm()
                    try:
                        ch = await call.read()
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if watch.fired and not (task is not None and task.cancelling()):
                            raise GatewayError(ErrorKind.UNAVAILABLE, f"{who} sent nothing for "
                                               f"{self.stream_idle_s:g}s (stalled?)") from None
                        raise
                    watch.disarm()
                    if ch is grpc.aio.EOF:
                        return
                    yield ch
        finally:
            watch.cancel()

    async def _colocated(self, req: GenerationRequest, decodes: list[Worker], trace: _Trace
                         ) -> AsyncIterator[decode_pb2.TokenChunk]:
        msg = decode_pb2.ColocatedGenerateRequest(
            request_id=req.cluster_id, prompt_token_ids=req.prompt_token_ids,
            sampling=req.params.to_proto())
        last: GatewayError | None = None
        for w in router.rank_decode(self._routable(decodes), len(req.prompt_token_ids),
                                    self.inflight):
            call = self.channels.token_stream(w.address, msg, self._remaining(req))
            slot = self.inflight.open(w)
            slot.track(call)
            trace.decode = w
            who = f"decode worker {w.address}"
            started = finished = False
            try:
                async for ch in self._chunks(call, slot):
                    started = started or bool(ch.token_ids)
                    finished = bool(ch.finish_reason)
                    yield ch
                    if finished:
                        return
                raise GatewayError(ErrorKind.UNAVAILABLE, f"{who} ended the stream unfinished")
            except grpc.aio.AioRpcError as e:
                code, err = self._error(e, who)
                if not _may_retry(code, started):
                    raise err from None
                last = err
            finally:
                self.inflight.close(slot)
                if not finished:  # harmless when the worker never admitted it
                    call.cancel()
                    self.channels.cancel(w.address, request_id=req.cluster_id,
                                         reason="gateway: request ended")
        raise last or GatewayError(ErrorKind.UNAVAILABLE, "no decode worker is available")

    def _routable(self, workers: list[Worker]) -> list[Worker]:
        """Those of an attempt's workers the registry still routes to: one dropped since the
        attempt began would leave a new call there to its deadline."""
        if not workers:
            return workers
        alive = {w.worker_id for w in self.registry.alive(workers[0].role)}
        return [w for w in workers if w.worker_id in alive]

    async def _reserve(self, req: GenerationRequest, decodes: list[Worker]
                       ) -> tuple[Slot, decode_pb2.ReserveResponse]:
        """A reservation at the best decode worker that grants one, and the request's slot
        there (the caller closes it when the request leaves the worker)."""
        msg = decode_pb2.ReserveRequest(request_id=req.cluster_id,
                                        prompt_token_ids=req.prompt_token_ids,
                                        sampling=req.params.to_proto())
        last: GatewayError | None = None
        ranked = router.rank_decode(self._routable(decodes), len(req.prompt_token_ids),
                                    self.inflight)
        for i, w in enumerate(ranked):
            if i and not self._routable([w]):
                continue  # dropped while an earlier Reserve hung: a call there would too
            # counted from the moment it is chosen, not once the reservation returns: requests
            # routed while this Reserve is on the wire must see it, or a burst all lands on
            # the one worker that looked idle
            slot = self.inflight.open(w)
            try:
                with ended_by_drop(slot):
                    resp = await slot.track(self.channels.get(w.address).decode.Reserve(
                        msg, timeout=self._unary_timeout(req)))
                return slot, resp
            except (grpc.aio.AioRpcError, WorkerLost) as e:
                self.inflight.close(slot)
                lost = isinstance(e, WorkerLost)
                if lost or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # unanswered (timed out, or the worker was dropped): it may still
                    # reserve once it wakes, so free that at once (its expiry is the
                    # backstop should the Cancel overtake the Reserve)
                    self.channels.cancel(w.address, request_id=req.cluster_id,
                                         reason="gateway: Reserve unanswered")
                code, err = ((grpc.StatusCode.UNAVAILABLE, e) if lost
                             else self._error(e, f"decode worker {w.address}"))
                if not _may_retry(code, work_started=False):
                    raise err from None
                last = err
                # a capacity refusal is routine under load; a lost or silent worker is not
                then = (f"trying decode worker {ranked[i + 1].address}" if i + 1 < len(ranked)
                        else "no other decode worker to try")
                log.log(logging.INFO if code == grpc.StatusCode.RESOURCE_EXHAUSTED
                        else logging.WARNING, "request %s (cluster id %s): Reserve at decode "
                        "worker %s failed: %s; %s", req.request_id, req.cluster_id, w.address,
                        err.message, then)
            except BaseException:
                self.inflight.close(slot)
                raise
        if last is None:
            raise GatewayError(ErrorKind.UNAVAILABLE, "no decode worker is available")
        raise last

    def _check_destination(self, d: Worker) -> None:
        """A prefill worker pushes KV to the decode_address this gateway gives it, so that is
        only ever the address of a decode worker registered here now (the worker's own check
        is the cluster credential on the call). One that left since it was chosen is a
        failed attempt like any other."""
        w = self.registry.get(d.worker_id)
        if w is None or w.role is not Role.DECODE or w.address != d.address:
            raise GatewayError(ErrorKind.UNAVAILABLE, f"decode_address: {d.address} is no "
                               "longer a registered decode worker")

    async def _prefill(self, req: GenerationRequest, p: Slot, d: Slot,
                       resv: decode_pb2.ReserveResponse) -> prefill_pb2.PrefillResponse:
        """The Prefill call at p's worker, pushing KV into d's reservation. It ends at once
        when either worker is dropped: `WorkerLost` naming d's first (the request's decode
        worker is gone: migration's business), else p's (a prefill failover)."""
        self._check_destination(d.worker)
        msg = prefill_pb2.PrefillRequest(
            request_id=req.cluster_id, prompt_token_ids=req.prompt_token_ids,
            # max_tokens goes to the decode worker only: prefill samples the first token
            sampling=req.params.to_proto(with_max_tokens=False),
            decode_address=d.worker.address,
            reservation_id=resv.reservation_id, reserved_blocks=resv.num_blocks,
            decode_kv_spec=resv.kv_spec, reservation_secret=resv.reservation_secret)
        if resv.HasField("shm"):  # the decode worker's same-host shared-memory offer
            msg.decode_shm.CopyFrom(resv.shm)
        # its deadline also bounds how long the prompt may queue there: the worker drops it
        # unprefilled once the call is gone, before the reservation expires
        call = p.track(self.channels.get(p.worker.address).prefill.Prefill(
            msg, timeout=self._unary_timeout(req)))
        d.track(call)
        with ended_by_drop(d, p):
            return await call

    def _prefill_failed(self, e: grpc.aio.AioRpcError | WorkerLost, p: Worker) -> GatewayError:
        """A failed Prefill call's error when the next prefill worker may take the prompt;
        re-raised when none may: the request's own fault, or its decode worker was lost."""
        if isinstance(e, WorkerLost):
            if e.worker_id != p.worker_id:
                raise e
            return e
        code, err = self._error(e, f"prefill worker {p.address}")
        if not migration.prefill_may_fail_over(code):
            raise err from None
        return err

    async def _disaggregated(self, req: GenerationRequest, decodes: list[Worker],
                             prefills: list[Worker], trace: _Trace
                             ) -> AsyncIterator[decode_pb2.TokenChunk]:
        """Prefill failover: each prefill worker, best first, gets the prompt with a fresh
        reservation (the failed one's is cancelled: KV may have half arrived); when every
        one failed, the prompt runs colocated. The decode stream's own failures are
        `_migrating`'s. Each try has its own cluster id: what a failed one left at a worker
        (a late commit, a reservation not yet cancelled) cannot collide with the next.

        Nothing is reserved before the prefill tier can start the prompt soon: a request
        that waits, waits in the backlog, holding nothing that could expire
        (prefill_backlog.py)."""
        first = req
        n = len(first.prompt_token_ids)
        await self.prefill_backlog.acquire(n, len(prefills))
        in_backlog = True
        try:
            for i, p in enumerate(router.rank_prefill(prefills, first.prompt_token_ids,
                                                      self.inflight)):
                if not self._routable([p]):
                    continue  # dropped since the attempt began
                req = first if i == 0 else dataclasses.replace(
                    first, cluster_id=f"{first.cluster_id}-p{i}")
                # d counts as in flight from here
                ds, resv = await self._reserve(req, router.decodes_for(p, decodes))
                d = trace.decode = ds.worker
                call = None
                finished = False
                try:
                    call = ds.track(self.channels.token_stream(
                        d.address, decode_pb2.DecodeRequest(reservation_id=resv.reservation_id),
                        self._remaining(req)))
                    try:
                        with self.inflight.hold(p) as ps:
                            trace.prefill = await self._prefill(req, ps, ds, resv)
                    except (grpc.aio.AioRpcError, WorkerLost) as e:
                        err = self._prefill_failed(e, p)
                        self.metrics.migrated("prefill_failover")
                        log.warning("request %s (cluster id %s): %s; failing over",
                                    req.request_id, req.cluster_id, err.message)
                        continue  # the finally below cancels the reservation
                    in_backlog = False
                    self.prefill_backlog.release(n)
                    async for ch in self._chunks(call, ds):
                        finished = bool(ch.finish_reason)
                        yield ch
                        if finished:
                            return
                    raise GatewayError(ErrorKind.UNAVAILABLE,
                                       f"decode worker {d.address} ended the stream unfinished")
                except grpc.aio.AioRpcError as e:
                    raise self._error(e, f"decode worker {d.address}")[1] from None
                finally:
                    self.inflight.close(ds)
                    if not finished:
                        if call is not None:
                            call.cancel()
                        self.channels.cancel(d.address, reservation_id=resv.reservation_id,
                                             reason="gateway: request ended")
        finally:
            if in_backlog:  # no prefill completed: failed, cancelled, or none left
                self.prefill_backlog.release(n, drained=False)
        trace.prefill = None
        log.warning("request %s (cluster id %s): no prefill worker left; running it colocated",
                    first.request_id, first.cluster_id)
        colocated = dataclasses.replace(first, cluster_id=f"{first.cluster_id}-c")
        async with contextlib.aclosing(self._colocated(colocated, decodes, trace)) as chunks:
            async for ch in chunks:
                yield ch
