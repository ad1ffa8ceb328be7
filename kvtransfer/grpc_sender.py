"""`GrpcKVTransport`: KV push over a gRPC client stream (`KVTransfer.Push`).

One channel per destination address (`pdserve.rpc.sync_channel`: the cluster's TLS and
keepalive), shared by every stream to it. Each call carries the cluster token and the
reservation's one-time secret as metadata. Each stream is one
`Push` call started with `.future()`: gRPC's request-consumer thread pulls from a queue
fed by `push_layer`, encodes each layer into chunks and sends them, so the compute thread
only enqueues. Chunks are handed to gRPC as ready-made bytes
(`pdserve.kvtransfer.wire.encode_layer_messages`: CRC-32C and one copy of the tensors), not as
protobuf objects, whose construction and serialization copy the payload twice more.

gRPC sends one message at a time and asks for the next once it is written, so encoding
chunk i+1 overlaps the receiver's work on chunk i. A separate encoder thread working
further ahead was tried and measured: no gain on loopback, and more CPU on the sender's
core from the extra thread switches. Messages of `max_chunk_bytes` payload must fit the
receiving server's `grpc.max_receive_message_length` (4 MiB by default).

Nothing waits without bound: the whole push (open to ack) runs under the transport's
deadline, `commit_async` awaits the ack through the call's done-callback (no thread is held
while a receiver hangs), and `abort` only enqueues the abort message and arms a timer that
cancels the call if the receiver does not end it within `abort_wait_s`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch

from pdserve import rpc
from pdserve.cluster_auth import ClusterCredentials
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer.malloc_tuning import keep_freed_memory
from pdserve.kvtransfer.receiver import SECRET_METADATA
from pdserve.kvtransfer.shm import ShmOffer
from pdserve.kvtransfer.sink import KVCommitInfo
from pdserve.kvtransfer.transport import KVPushStream, KVTransferError, KVTransport, PushResult
from pdserve.kvtransfer.wire import (
    DEFAULT_MAX_CHUNK_BYTES,
    EncodedChunk,
    commit_to_proto,
    encode_layer_messages,
)
from pdserve.protos.pdserve.v1 import kvtransfer_pb2

log = logging.getLogger(__name__)

_END = object()  # queue sentinel: half-close the request stream
_PUSH_METHOD = "/{}/Push".format(
    kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name)


@dataclass(frozen=True)
class _Layer:
    layer: int
    block_indices: list[int]
    k: torch.Tensor
    v: torch.Tensor
    wait: Callable[[], None] | None


class GrpcKVPushStream(KVPushStream):
    def __init__(
        self, push: grpc.StreamUnaryMultiCallable, dest_address: str,
        reservation_id: str, spec: KVCacheSpec, max_chunk_bytes: int,
        timeout_s: float | None, abort_wait_s: float,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.dest_address = dest_address
        self.reservation_id = reservation_id
        self._spec = spec
        self._max_chunk_bytes = max_chunk_bytes
        self._abort_wait_s = abort_wait_s
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = False  # commit() or abort() was called
        self._aborting = False
        self._encode_error: BaseException | None = None
        self._num_chunks = 0  # written only by the consumer thread
        self._bytes_sent = 0
        self._t_open = time.perf_counter()
        self._future = push.future(self._requests(), timeout=timeout_s, metadata=metadata)
        # unblock the consumer thread whatever ends the call
        self._future.add_done_callback(lambda _: self._queue.put(_END))

    # -- runs on gRPC's request-consumer thread ------------------------------------------

    def _requests(self) -> Iterator[bytes]:
        held: object = None  # taken from the queue by `_gather`, not yet handled
        try:
            while (item := self._queue.get() if held is None else held) is not _END:
                held = None
                if isinstance(item, _Layer):
                    if self._aborting:
                        continue
                    # the tensors' copies have landed; the first before gathering, so
                    # layers queued while it landed can join it
                    if item.wait is not None:
                        item.wait()
                    layers, held = self._gather(item)
                    for layer in layers[1:]:
                        if layer.wait is not None:
                            layer.wait()
                    for chunk in self._encode(layers):
                        self._num_chunks += 1
                        self._bytes_sent += chunk.payload_bytes
                        yield chunk.data
                elif isinstance(item, KVCommitInfo):
                    yield kvtransfer_pb2.KVMessage(
                        commit=commit_to_proto(self.reservation_id, self._num_chunks, item)
                    ).SerializeToString()
                else:
                    assert isinstance(item, kvtransfer_pb2.KVAbort)
                    yield kvtransfer_pb2.KVMessage(abort=item).SerializeToString()
        except Exception as e:  # gRPC would only say "Exception iterating requests"
            self._encode_error = e
            raise
        finally:
            self._requests_done()

    def _gather(self, first: _Layer) -> tuple[list[_Layer], object]:
        """The layers to encode together, starting with `first`, and the queue item taken
        meanwhile that did not join them (None if none). Here: `first` alone, since a
        payload-carrying message is bounded by the receiver's message size anyway."""
        return [first], None

    def _encode(self, layers: list[_Layer]) -> Iterator[EncodedChunk]:
        """The layers `_gather` chose as ready-to-send messages (payloads in the messages)."""
        (item,) = layers
        return encode_layer_messages(
            self.reservation_id, item.layer, item.block_indices, item.k, item.v,
            first_seq=self._num_chunks, max_chunk_bytes=self._max_chunk_bytes)

    def _requests_done(self) -> None:
        """The request stream ended (nothing more is encoded); a subclass's hook."""

    # -- KVPushStream --------------------------------------------------------------------

    def push_layer(
        self, layer: int, block_indices: Sequence[int], k_blocks: torch.Tensor,
        v_blocks: torch.Tensor, wait: Callable[[], None] | None = None,
    ) -> None:
        if self._closed:
            raise RuntimeError(f"push_layer after commit/abort of {self.reservation_id}")
        spec = self._spec
        n = len(block_indices)
        shape = (n, *spec.block_shape)
        if not 0 <= layer < spec.num_layers:
            raise ValueError(f"layer {layer} not in [0, {spec.num_layers})")
        for name, t in (("k_blocks", k_blocks), ("v_blocks", v_blocks)):
            if tuple(t.shape) != shape or t.dtype != spec.torch_dtype:
                raise ValueError(
                    f"{name} is {tuple(t.shape)} {t.dtype}, expected {shape} {spec.torch_dtype}"
                )
        if self._future.done():
            return  # already failed; commit() reports why
        self._queue.put(_Layer(layer, [int(i) for i in block_indices], k_blocks, v_blocks,
                               wait))

    def _send_commit(self, info: KVCommitInfo) -> None:
        if self._closed:
            raise RuntimeError(f"commit after commit/abort of {self.reservation_id}")
        self._closed = True
        self._queue.put(info)
        self._queue.put(_END)

    def _no_ack(self, timeout_s: float | None) -> KVTransferError:
        self._future.cancel()
        return KVTransferError(
            f"KV push of {self.reservation_id} to {self.dest_address}: no ack within "
            f"{timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED)

    def commit(self, info: KVCommitInfo, timeout_s: float | None = None) -> PushResult:
        self._send_commit(info)
        try:
            ack = self._future.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise self._no_ack(timeout_s) from None
        except grpc.RpcError as e:
            raise self._error(e) from e
        return self._result(ack)

    async def commit_async(self, info: KVCommitInfo, timeout_s: float) -> PushResult:
        self._send_commit(info)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake(_) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        self._future.add_done_callback(wake)  # runs at once when already done
        try:
            await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            raise self._no_ack(timeout_s) from None
        except asyncio.CancelledError:
            self._future.cancel()  # the Prefill call went away: so does the push
            raise
        try:
            ack = self._future.result(timeout=0)
        except grpc.RpcError as e:
            raise self._error(e) from e
        except grpc.FutureCancelledError:
            raise KVTransferError(f"KV push of {self.reservation_id} to {self.dest_address} "
                                  "was cancelled", grpc.StatusCode.CANCELLED) from None
        return self._result(ack)

    def _result(self, ack: kvtransfer_pb2.PushAck) -> PushResult:
        return PushResult(
            reservation_id=ack.reservation_id,
            num_chunks=self._num_chunks,
            bytes_sent=self._bytes_sent,
            push_s=time.perf_counter() - self._t_open,
        )

    def abort(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._aborting = True
        if self._future.done():
            return
        self._queue.put(kvtransfer_pb2.KVAbort(reservation_id=self.reservation_id,
                                               reason=reason))
        self._queue.put(_END)
        # the receiver answers KVAbort with CANCELLED; one that does not within abort_wait_s
        # has the call cancelled under it, which frees the reservation there too
        timer = threading.Timer(self._abort_wait_s, self._future.cancel)
        timer.daemon = True
        timer.start()
        self._future.add_done_callback(lambda _: timer.cancel())

    @property
    def failed(self) -> bool:
        if not self._future.done():
            return False
        return self._future.cancelled() or self._future.exception() is not None

    def _error(self, e: grpc.RpcError) -> KVTransferError:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        if self._encode_error is not None:
            details = f"{details} (encoding failed: {self._encode_error!r})"
        name = code.name if code is not None else "UNKNOWN"
        return KVTransferError(
            f"KV push of {self.reservation_id} to {self.dest_address} failed: {name}: "
            f"{details}", code,
        )


class GrpcKVTransport(KVTransport):
    """Thread-safe; one instance per prefill worker."""

    def __init__(
        self,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        *,
        timeout_s: float | None = None,
        abort_wait_s: float = 5.0,
        channel_options: Sequence[tuple[str, object]] = (),
        credentials: ClusterCredentials = ClusterCredentials(),
    ) -> None:
        """timeout_s: deadline of a whole push (open to ack); None for none."""
        if max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
        self.max_chunk_bytes = max_chunk_bytes
        keep_freed_memory()
        self._timeout_s = timeout_s
        self._abort_wait_s = abort_wait_s
        self._options = [("grpc.max_send_message_length", -1), *channel_options]
        self._credentials = credentials
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, grpc.StreamUnaryMultiCallable]] = {}

    def _push_method(self, address: str) -> grpc.StreamUnaryMultiCallable:
        with self._lock:
            entry = self._channels.get(address)
            if entry is None:
                channel = rpc.sync_channel(address, self._credentials,
                                           options=self._options)
                # requests go out as the bytes `_requests` made (no serializer): chunks are
                # serialized by `encode_layer_messages` without a protobuf payload copy
                push = channel.stream_unary(
                    _PUSH_METHOD, request_serializer=None,
                    response_deserializer=kvtransfer_pb2.PushAck.FromString)
                entry = (channel, push)
                self._channels[address] = entry
            return entry[1]

    def open(self, dest_address: str, reservation_id: str, spec: KVCacheSpec,
             secret: str = "", shm: ShmOffer | None = None) -> KVPushStream:
        return GrpcKVPushStream(
            self._push_method(dest_address), dest_address, reservation_id, spec,
            self.max_chunk_bytes, self._timeout_s, self._abort_wait_s,
            self._push_metadata(secret),
        )

    def _push_metadata(self, secret: str) -> tuple[tuple[str, str], ...]:
        """The cluster credential and the reservation's one-time secret."""
        return (*self._credentials.metadata(), (SECRET_METADATA, secret))

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()
