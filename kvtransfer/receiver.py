"""`KVTransferService`: the `KVTransfer.Push` servicer hosted by a decode worker.

Life cycle of one transfer (one Push stream, one reservation):

    Reserve (decode worker)  -> reservation open: blocks set aside, nothing written
    stream opens             -> its `x-pdserve-reservation-secret` metadata compared with
                                the reservation's secret: a stranger gets PERMISSION_DENIED
                                and the reservation stays as it was
    KVChunk*                 -> each chunk's header validated in full (reservation, seq,
                                layers, dtype, shape, block indices, size), then written
                                through `KVSink.write_kv`, which checks the payload's
                                crc32c as it copies; a mismatch refuses the stream at
                                the next message, at the commit, or at the stream's end
    KVCommit                 -> chunk count and coverage of every (layer, block) checked,
                                then `KVSink.commit_kv` (awaited; the engine checks the
                                token ids); the sequence joins the decode batch
    | KVAbort / error / cancel -> `KVSink.abort_kv`: the reservation's blocks are freed and
                                the call ends with a status (below)
    | expiry (decode worker) -> the sink forgets the reservation; the next chunk or the
                                commit gets NOT_FOUND

Statuses: NOT_FOUND (unknown, expired or already finished reservation), PERMISSION_DENIED
(wrong or missing secret), INVALID_ARGUMENT
(malformed chunk or commit; the details start with the field's name), FAILED_PRECONDITION
(another stream feeds the same reservation; that one is left alone), CANCELLED (the sender
sent KVAbort), INTERNAL (the sink failed).

Trust. Nothing is written before its header has passed validation, so a chunk can only
ever address its own reservation's blocks. Its payload's CRC-32C is checked as the sink
copies it (one pass over the bytes, `pdserve.engine.kv_blocks.ingest_blocks`), so a corrupt
payload may land in the reservation's own blocks — which no other sequence holds or reads,
and which are not in any prefix cache — before the verdict; the verdict refuses the stream
(INVALID_ARGUMENT, "crc32c: ...") and aborts the reservation, so those blocks are freed
without ever being read. Bad bytes never reach a block anything else can read.

Payload source: a chunk carries its payload in the message (gRPC transport) or, when the
decode worker offered the reservation a shared-memory segment, a descriptor of where the
payload lies in it (`KVChunk.shm`; `pdserve.kvtransfer.shm`). Either way the same bytes go
through the same `decode_chunk` checks and the same sink write; a descriptor must start
where the stream's previous one ended and lie inside the reservation's own segment. The
segment goes back to the pool for reuse after a commit, and is dropped on any other end.

Messages reach `Push` already split by `pdserve.kvtransfer.wire.parse_message` (registered as the
method's deserializer in `add_to_server`): the chunk header parsed, the payload a view into
the bytes gRPC received. From there to the cache the payload is read once: the copy into
the cache, which takes the CRC-32C as it goes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from pdserve.engine.kv_blocks import ChecksumMismatch
from pdserve.kvtransfer.malloc_tuning import keep_freed_memory
from pdserve.kvtransfer.shm import ShmSegmentPool
from pdserve.kvtransfer.sink import KVSink
from pdserve.kvtransfer.wire import (
    KVChunkError,
    WireMessage,
    commit_from_proto,
    decode_chunk,
    parse_message,
)
from pdserve.protos.pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

log = logging.getLogger(__name__)

SECRET_METADATA = "x-pdserve-reservation-secret"


class _Reject(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, abort_reservation: bool) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.abort_reservation = abort_reservation


@dataclass
class _Transfer:
    """What one Push stream has delivered so far."""

    reservation_id: str
    num_blocks: int
    received: np.ndarray  # bool [num_layers, num_blocks]
    num_chunks: int = 0
    num_bytes: int = 0
    shm_next: int = 0  # where the next shared-memory payload must start
    done: bool = field(default=False)
    # writes the sink applies later, oldest first: (seq, its verdict)
    pending: list[tuple[int, concurrent.futures.Future]] = field(default_factory=list)


class KVTransferService(kvtransfer_pb2_grpc.KVTransferServicer):
    """Receives KV into a `KVSink`; runs on the decode worker's event loop."""

    def __init__(self, sink: KVSink, shm: ShmSegmentPool | None = None) -> None:
        """shm: the pool whose segments this worker offers at Reserve, if any."""
        self._sink = sink
        self._shm = shm
        self._spec = sink.kv_spec
        keep_freed_memory()
        self._active: set[str] = set()  # reservations with a live Push stream
        # counters for metrics
        self.num_committed = 0
        self.num_rejected = 0
        self.bytes_received = 0

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers `Push` with `pdserve.kvtransfer.wire.parse_message` as its request
        deserializer instead of the generated `KVMessage.FromString`, so chunk payloads
        are read in place rather than copied out of a parsed message."""
        service = kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
        push = grpc.stream_unary_rpc_method_handler(
            self.Push, request_deserializer=parse_message,
            response_serializer=kvtransfer_pb2.PushAck.SerializeToString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"Push": push}),))

    async def Push(
        self, request_iterator: AsyncIterator[WireMessage],
        context: grpc.aio.ServicerContext,
    ) -> kvtransfer_pb2.PushAck:
        state: list[_Transfer] = []  # the stream's transfer once its first message arrived
        secret = next((v for k, v in context.invocation_metadata() or ()
                       if k == SECRET_METADATA), "")
        try:
            return await self._serve(request_iterator, state, secret)
        except _Reject as r:
            reject = r
        except KVChunkError as e:
            reject = _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e), abort_reservation=True)
        except asyncio.CancelledError:
            self._finish(state, "push cancelled by the sender or its deadline")
            raise
        except Exception as e:  # the sink failed: still free the blocks, report INTERNAL
            log.exception("KV push failed in the sink")
            reject = _Reject(grpc.StatusCode.INTERNAL, f"sink error: {e!r}", True)
        self.num_rejected += 1
        rid = state[0].reservation_id if state else "?"
        log.warning("KV push for reservation %s rejected: %s %s", rid, reject.code.name,
                    reject.details)
        if reject.abort_reservation:
            self._finish(state, f"{reject.code.name}: {reject.details}")
        elif state:
            self._active.discard(state[0].reservation_id)
        await context.abort(reject.code, reject.details)
        raise AssertionError("unreachable: context.abort raises")

    async def _serve(
        self, request_iterator: AsyncIterator[WireMessage], state: list[_Transfer],
        secret: str,
    ) -> kvtransfer_pb2.PushAck:
        async for msg in request_iterator:
            kind, body = msg.kind, msg.body
            if kind is None or body is None:
                raise KVChunkError("msg", msg.error or "empty KVMessage")
            if not state:
                state.append(self._open(body.reservation_id, secret))
            transfer = state[0]
            if body.reservation_id != transfer.reservation_id:
                raise KVChunkError(
                    "reservation_id",
                    f"{body.reservation_id!r} in a stream for {transfer.reservation_id!r}",
                )
            self._check_open(transfer)
            self._check_verdicts(transfer)
            if kind == "chunk":
                self._write(transfer, body, self._payload(transfer, body, msg.payload))
            elif kind == "commit":
                return await self._commit(transfer, body)
            else:  # abort
                raise _Reject(grpc.StatusCode.CANCELLED,
                              f"sender aborted: {body.reason}", abort_reservation=True)
        if state:  # a chunk's failed checksum is the better reason, as if seen in time
            await self._await_verdicts(state[0])
        raise KVChunkError("commit", "stream ended without a KVCommit")

    def _open(self, reservation_id: str, secret: str) -> _Transfer:
        num_blocks = self._sink.reservation_num_blocks(reservation_id)
        expected = self._sink.reservation_secret(reservation_id)
        if num_blocks is None or expected is None:
            raise _Reject(grpc.StatusCode.NOT_FOUND,
                          f"reservation {reservation_id!r} is unknown, expired or finished",
                          abort_reservation=False)
        if not hmac.compare_digest(secret.encode(), expected.encode()):
            raise _Reject(grpc.StatusCode.PERMISSION_DENIED,
                          f"{SECRET_METADATA}: not the secret of reservation {reservation_id!r}",
                          abort_reservation=False)
        if reservation_id in self._active:
            raise _Reject(grpc.StatusCode.FAILED_PRECONDITION,
                          f"reservation {reservation_id!r} is already being pushed",
                          abort_reservation=False)
        self._active.add(reservation_id)
        received = np.zeros((self._spec.num_layers, num_blocks), dtype=bool)
        return _Transfer(reservation_id, num_blocks, received)

    def _check_open(self, transfer: _Transfer) -> None:
        # the decode worker may expire a reservation while its stream is open
        if self._sink.reservation_num_blocks(transfer.reservation_id) != transfer.num_blocks:
            raise _Reject(grpc.StatusCode.NOT_FOUND,
                          f"reservation {transfer.reservation_id!r} expired during the push",
                          abort_reservation=True)

    def _check_verdicts(self, transfer: _Transfer) -> None:
        """Raises for the first write the sink has finished that failed."""
        while transfer.pending and transfer.pending[0][1].done():
            seq, verdict = transfer.pending.pop(0)
            error = verdict.exception()
            if isinstance(error, ChecksumMismatch):
                raise KVChunkError("crc32c", f"chunk {seq}: payload checksum mismatch")
            if isinstance(error, KeyError):
                raise _Reject(grpc.StatusCode.NOT_FOUND,
                              f"reservation {transfer.reservation_id!r} vanished during the "
                              "push", abort_reservation=True)
            if error is not None:
                raise error

    async def _await_verdicts(self, transfer: _Transfer) -> None:
        """Waits for every write the sink has not finished, then `_check_verdicts`."""
        for _, verdict in transfer.pending:
            done = asyncio.wrap_future(verdict)
            await asyncio.wait([done])
            if not done.cancelled():
                done.exception()  # read here, judged below: an unread one the loop logs
        self._check_verdicts(transfer)

    def _payload(self, transfer: _Transfer, chunk: kvtransfer_pb2.KVChunk,
                 payload: memoryview | bytes) -> memoryview | bytes:
        """The chunk's payload: the message's own, or the bytes its descriptor names."""
        if not chunk.HasField("shm"):
            return payload
        if len(payload):
            raise KVChunkError("payload", "set together with shm; a chunk has one payload")
        d = chunk.shm
        if self._shm is None:
            raise KVChunkError("shm", "this worker offers no shared memory")
        if d.offset != transfer.shm_next:
            raise KVChunkError("shm", f"offset {d.offset}, expected {transfer.shm_next} "
                                      "(payloads are packed in stream order)")
        view = self._shm.payload(transfer.reservation_id, d.offset, d.length)
        if view is None:
            raise KVChunkError("shm", f"[{d.offset}, {d.offset + d.length}) is not inside "
                                      "the reservation's segment")
        transfer.shm_next = d.offset + d.length
        return view

    def _write(self, transfer: _Transfer, chunk: kvtransfer_pb2.KVChunk,
               payload: memoryview | bytes) -> None:
        if chunk.seq != transfer.num_chunks:
            raise KVChunkError("seq", f"{chunk.seq}, expected {transfer.num_chunks}")
        decoded = decode_chunk(chunk, self._spec, transfer.num_blocks, payload,
                               check_crc32c=False)  # the sink's copy checks it
        rows = transfer.received[decoded.layer:decoded.layer + decoded.num_layers]
        idx = np.asarray(decoded.block_indices, dtype=np.intp)  # one conversion, used twice
        seen = rows[:, idx]
        if seen.any():
            layer = int(np.argwhere(seen)[0][0])
            already = idx[seen[layer]].tolist()
            raise KVChunkError(
                "block_indices",
                f"layer {decoded.layer + layer} blocks {already[:8]} sent twice")
        try:
            verdict = self._sink.write_kv(transfer.reservation_id, decoded.layer,
                                          decoded.block_indices, decoded.k, decoded.v,
                                          decoded.crc32c)
        except ChecksumMismatch:
            raise KVChunkError("crc32c", f"chunk {chunk.seq}: payload checksum mismatch"
                               ) from None
        except KeyError:
            raise _Reject(grpc.StatusCode.NOT_FOUND,
                          f"reservation {transfer.reservation_id!r} vanished during the push",
                          abort_reservation=True) from None
        if verdict is not None:
            transfer.pending.append((chunk.seq, verdict))
        rows[:, idx] = True
        transfer.num_chunks += 1
        transfer.num_bytes += decoded.num_bytes
        self.bytes_received += decoded.num_bytes

    async def _commit(self, transfer: _Transfer, commit: kvtransfer_pb2.KVCommit
                      ) -> kvtransfer_pb2.PushAck:
        if commit.num_chunks != transfer.num_chunks:
            raise KVChunkError(
                "num_chunks", f"commit says {commit.num_chunks}, received {transfer.num_chunks}"
            )
        if not transfer.received.all():
            layers, blocks = np.nonzero(~transfer.received)
            missing = [f"(layer {la}, block {b})" for la, b in zip(layers[:8], blocks[:8])]
            raise KVChunkError(
                "commit", f"{len(layers)} (layer, block) pairs never sent: {', '.join(missing)}"
            )
        bs = self._spec.block_size
        lo, hi = (transfer.num_blocks - 1) * bs + 1, transfer.num_blocks * bs
        if not lo <= commit.num_prompt_tokens <= hi:
            raise KVChunkError(
                "num_prompt_tokens",
                f"{commit.num_prompt_tokens} tokens do not fill {transfer.num_blocks} blocks "
                f"of {bs} (expected {lo}..{hi})",
            )
        info = commit_from_proto(commit)
        try:
            await self._sink.commit_kv(transfer.reservation_id, info)
        except KeyError:
            raise _Reject(grpc.StatusCode.NOT_FOUND,
                          f"reservation {transfer.reservation_id!r} vanished before its commit",
                          abort_reservation=True) from None
        except ValueError as e:  # the engine refused a field, e.g. first_token_id
            self._check_verdicts(transfer)  # a failed checksum, named with its chunk
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e), True) from None
        transfer.done = True
        self._active.discard(transfer.reservation_id)
        if self._shm is not None:  # the engine has copied every chunk: reusable
            self._shm.finish(transfer.reservation_id, clean=True)
        self.num_committed += 1
        return kvtransfer_pb2.PushAck(reservation_id=transfer.reservation_id,
                                      num_chunks=transfer.num_chunks,
                                      num_bytes=transfer.num_bytes)

    def _finish(self, state: list[_Transfer], reason: str) -> None:
        """Aborts the stream's reservation unless it was committed."""
        if not state or state[0].done:
            return
        transfer = state[0]
        self._active.discard(transfer.reservation_id)
        transfer.done = True
        self._sink.abort_kv(transfer.reservation_id, reason)
        if self._shm is not None:
            self._shm.finish(transfer.reservation_id, clean=False)
