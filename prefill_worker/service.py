"""The PrefillWorker gRPC servicer.

Life of one Prefill call:
    shed (RESOURCE_EXHAUSTED at once when `max_queue` calls are already here)
    -> validate (layout matches the decode worker's, reservation covers the prompt)
    -> open a KV push stream to the decode worker's reservation (through its shared-memory
       segment when it offered one on this host, else payloads over gRPC: the transport
       chooses)
    -> the engine batches the prompt with others (chunked, prefix-cached); in its last
       chunk the engine's KV connector saves KV layer by layer into the stream
       (StreamSaver) and the first token is sampled
    -> commit the transfer with the first token (awaited on the event loop, bounded by
       `commit_timeout_s`: no thread waits on a hung receiver); reply with it and the timing
Any failure aborts the transfer, which frees the reservation at the decode worker; the abort
never blocks the event loop.

The call's deadline, which the gateway sets before the reservation would expire, is the
reservation's liveness: a call already past it is refused before any work, and one whose
deadline passes while its prompt is queued is cancelled, which drops the prompt unprefilled.
An engine failure is INTERNAL with its reason.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from pdserve.convert import kv_spec_from_proto, layouts_match, logprobs_to_proto
from pdserve.deadlines import DEFAULT_RPC_TIMEOUT_S
from pdserve.engine.async_engine import AsyncEngine, EngineFailed, RequestError
from pdserve.kvtransfer.shm import offer_from_proto
from pdserve.kvtransfer.sink import KVCommitInfo
from pdserve.kvtransfer.transport import KVTransferError, KVTransport
from pdserve.metrics import TierMetrics
from pdserve.prefill_worker.kv_pusher import StreamSaver
from pdserve.protocol import SamplingParams, cdiv
from pdserve.protos.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("pdserve.prefill")

DEFAULT_MAX_QUEUE = 64


class PrefillService(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, transport: KVTransport, metrics: TierMetrics,
                 stats, max_queue: int = DEFAULT_MAX_QUEUE,
                 commit_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> None:
        self.aengine = aengine
        self.max_queue = max_queue  # 0: no limit
        self.commit_timeout_s = commit_timeout_s
        self.transport = transport
        self.metrics = metrics
        self._stats = stats
        self.in_flight = 0

    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        t0 = time.monotonic()
        if self.max_queue and self.in_flight >= self.max_queue:
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"prefill queue full ({self.in_flight} of {self.max_queue})")
        left = context.time_remaining()
        if left is not None and left <= 0:
            await self._fail(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                             "the call's deadline (its reservation's) passed before prefill")
        self.in_flight += 1
        try:
            return await self._prefill(request, context, t0)
        finally:
            self.in_flight -= 1

    async def _prefill(self, request, context, t0: float) -> prefill_pb2.PrefillResponse:
        engine = self.aengine.engine
        spec = engine.kv_spec
        ids = list(request.prompt_token_ids)
        request_id = request.request_id or uuid.uuid4().hex
        if not request.decode_address or not request.reservation_id:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                             "decode_address and reservation_id are required")
        if not ids:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                             "prompt_token_ids: must contain at least one token")
        if request.HasField("decode_kv_spec") and not layouts_match(
                spec, kv_spec_from_proto(request.decode_kv_spec)):
            await self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                             "decode_kv_spec: the decode worker's KV layout differs from this "
                             "prefill worker's")
        need = cdiv(len(ids), spec.block_size)
        if request.reserved_blocks and request.reserved_blocks != need:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"reserved_blocks: {request.reserved_blocks} reserved, the prompt "
                             f"fills {need}")
        try:
            # only the first token is sampled here, with the request's own rules
            params = SamplingParams.from_proto(request.sampling, first_token_only=True)
        except ValueError as e:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

        offer = offer_from_proto(request.decode_shm) if request.HasField("decode_shm") else None
        try:
            stream = self.transport.open(request.decode_address, request.reservation_id, spec,
                                         request.reservation_secret, shm=offer)
        except KVTransferError as e:  # --kv-transport shm without a usable segment
            await self._fail(context, e.code or grpc.StatusCode.UNAVAILABLE, str(e))
        committed = False
        try:
            delta = None
            async for d in self.aengine.generate(request_id, ids, params, prefill_only=True,
                                                 kv_saver=StreamSaver(stream)):
                delta = d
            if delta is None or not delta.new_token_ids:
                raise RequestError("prefill was aborted")
            t_first = time.monotonic()
            started = delta.first_scheduled_time or delta.arrival_time
            queue_s = max(0.0, started - t0)
            compute_s = max(0.0, t_first - started)
            lp = delta.new_logprobs[0] if delta.new_logprobs else None
            info = KVCommitInfo(
                num_prompt_tokens=len(ids), first_token_id=delta.new_token_ids[0],
                first_token_logprob=lp.logprob if lp else None,
                first_token_top_logprobs=lp.top if lp else (),
                num_cached_tokens=delta.num_cached_tokens, queue_s=queue_s,
                compute_s=compute_s)
            result = await stream.commit_async(info, self.commit_timeout_s)
            committed = True
            transfer_s = time.monotonic() - t_first  # the part not hidden behind compute
        except ValueError as e:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVTransferError as e:
            self.metrics.kv_transfer_failures.inc()
            code = e.code or grpc.StatusCode.UNAVAILABLE
            await self._fail(context, code, f"KV transfer to {request.decode_address}: {e}")
        except RequestError as e:
            code = (grpc.StatusCode.INTERNAL if isinstance(e, EngineFailed)
                    else grpc.StatusCode.UNAVAILABLE)
            await self._fail(context, code, str(e))
        finally:
            if not committed:
                stream.abort("prefill did not complete")
        m = self.metrics
        m.queue_time.observe(queue_s)
        m.prefill_time.observe(compute_s)
        m.ttft.observe(t_first - t0)
        m.kv_transfer_seconds.observe(transfer_s)
        m.kv_transfer_bytes.observe(result.bytes_sent)
        m.success("prefilled")
        resp = prefill_pb2.PrefillResponse(
            first_token_id=info.first_token_id, num_prompt_tokens=len(ids),
            num_cached_tokens=delta.num_cached_tokens, transfer_bytes=result.bytes_sent,
            timing=common_pb2.PrefillTiming(queue_s=queue_s, compute_s=compute_s,
                                            transfer_s=transfer_s))
        if lp is not None:
            resp.first_token_logprobs.CopyFrom(logprobs_to_proto(lp))
        return resp

    async def _fail(self, context, code: grpc.StatusCode, message: str) -> None:
        self.metrics.error(code.name)
        await context.abort(code, message)

    async def Stats(self, request, context) -> common_pb2.StatsResponse:
        return await self._stats()
