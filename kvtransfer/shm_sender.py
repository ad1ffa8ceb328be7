"""`ShmKVTransport`: KV push through the decode worker's shared-memory segment when both
run on one host, over the gRPC Push stream's payloads otherwise.

The stream is the gRPC one (`pdserve.kvtransfer.grpc_sender`) with one difference: each
chunk's payload is copied into the reservation's segment (`pdserve.kvtransfer.shm`, which
gives the segment's life cycle) and the Push message carries only its descriptor. Commit,
abort, status codes and the receiver's checks are the gRPC transport's own.

Choosing, per transfer, at `open` (`mode`, the workers' `--kv-transport`):

    grpc   payloads always in the messages; offers are ignored
    auto   shm when the decode worker made an offer, its host id is this host's, and the
           segment maps; gRPC payloads otherwise (the reason is logged at debug level)
    shm    as auto, but a transfer that cannot use shm fails at open with
           FAILED_PRECONDITION instead of falling back

Mappings: the sender maps an offered segment at open and keeps the mapping after its
stream ends, because the decode worker's pool hands the same segment to its next
reservation after a clean commit, and a fresh mapping's page faults (~100 MB for a 4k-token
prompt) cost more than copying the KV into it. A kept mapping is reused
only while its file is the one the offer names (same inode); at every open the mappings
whose files the decode worker has dropped are closed, and those beyond
`max_mapped_bytes` (least recently used first). It never creates or unlinks a segment.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc

from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer.grpc_sender import GrpcKVPushStream, GrpcKVTransport, _Layer
from pdserve.kvtransfer.shm import SHM_DIR, ShmOffer, ShmSegment, host_id
from pdserve.kvtransfer.transport import KVPushStream, KVTransferError
from pdserve.kvtransfer.wire import (
    EncodedChunk,
    encode_layer_descriptors,
    encode_layers_descriptor,
)

log = logging.getLogger(__name__)

KV_TRANSPORT_MODES = ("grpc", "shm", "auto")
# Descriptors are tiny whatever the payload, so chunks can be large: fewer messages and
# per-chunk checks, while a layer of a long prompt still spans a few chunks.
SHM_MAX_CHUNK_BYTES = 16 << 20
# the decode worker's default pool size: every segment it may hold stays mapped here
MAX_MAPPED_BYTES = 2 << 30


class ShmKVPushStream(GrpcKVPushStream):
    """A Push stream whose payloads go through `segment`, packed from offset 0."""

    def __init__(self, segment: ShmSegment, *args, **kwargs) -> None:
        self.segment = segment  # set first: the base class starts the request stream
        # the stream's own view: the transport may close its mapping while this stream
        # still writes (evicted, or dropped by the decode worker); the mapping then lasts
        # until this view is released
        self._view = segment.view[:]
        self._offset = 0  # written only by the consumer thread
        super().__init__(*args, **kwargs)

    def _gather(self, first: _Layer) -> tuple[list[_Layer], object]:
        """`first` and the layers queued right behind it that can share its chunk: the next
        layer up, the same blocks, the payload within `max_chunk_bytes`. A push that lags
        the prefill (a long prompt's layers come faster than one core copies them) thus
        sends fewer, larger chunks; one that keeps up sends a chunk per layer as before."""
        layers, size = [first], _payload_bytes(first)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return layers, None
            if not (isinstance(item, _Layer) and item.layer == layers[-1].layer + 1
                    and item.block_indices == first.block_indices):
                return layers, item
            size += _payload_bytes(item)
            if size > self._max_chunk_bytes:
                return layers, item
            layers.append(item)

    def _encode(self, layers: list[_Layer]) -> Iterator[EncodedChunk]:
        chunks: Iterable[EncodedChunk]
        if len(layers) > 1:
            chunks = [encode_layers_descriptor(
                self.reservation_id, layers[0].layer, layers[0].block_indices,
                [(item.k, item.v) for item in layers], self._view, offset=self._offset,
                seq=self._num_chunks)]
        else:
            (item,) = layers
            chunks = encode_layer_descriptors(
                self.reservation_id, item.layer, item.block_indices, item.k, item.v,
                self._view, offset=self._offset, first_seq=self._num_chunks,
                max_chunk_bytes=self._max_chunk_bytes)
        for chunk in chunks:
            self._offset += chunk.payload_bytes
            yield chunk

    def _requests_done(self) -> None:
        self._view.release()


def _payload_bytes(item: _Layer) -> int:
    return 2 * item.k.numel() * item.k.element_size()


class ShmKVTransport(GrpcKVTransport):
    """Thread-safe; one instance per prefill worker. `num_shm_streams` and
    `num_grpc_streams` count the transfers each way."""

    def __init__(
        self,
        mode: str = "auto",
        *,
        host: str | None = None,
        directory: Path = SHM_DIR,
        shm_max_chunk_bytes: int = SHM_MAX_CHUNK_BYTES,
        max_mapped_bytes: int = MAX_MAPPED_BYTES,
        **grpc_kwargs,
    ) -> None:
        """host: this host's id (default `pdserve.kvtransfer.shm.host_id()`); the other
        keyword arguments are `GrpcKVTransport`'s."""
        if mode not in KV_TRANSPORT_MODES:
            raise ValueError(f"mode must be one of {KV_TRANSPORT_MODES}, got {mode!r}")
        if shm_max_chunk_bytes < 1:
            raise ValueError(f"shm_max_chunk_bytes must be >= 1, got {shm_max_chunk_bytes}")
        super().__init__(**grpc_kwargs)
        self.mode = mode
        self.host_id = host if host is not None else host_id()
        self.directory = Path(directory)
        self.shm_max_chunk_bytes = shm_max_chunk_bytes
        self.max_mapped_bytes = max_mapped_bytes
        self._mapped: OrderedDict[str, ShmSegment] = OrderedDict()  # name -> mapping, LRU
        self._count_lock = threading.Lock()
        self.num_shm_streams = 0
        self.num_grpc_streams = 0

    def open(self, dest_address: str, reservation_id: str, spec: KVCacheSpec,
             secret: str = "", shm: ShmOffer | None = None) -> KVPushStream:
        segment = self._map(shm, reservation_id)
        with self._count_lock:
            if segment is None:
                self.num_grpc_streams += 1
            else:
                self.num_shm_streams += 1
        if segment is None:
            return super().open(dest_address, reservation_id, spec, secret)
        return ShmKVPushStream(
            segment, self._push_method(dest_address), dest_address, reservation_id, spec,
            self.shm_max_chunk_bytes, self._timeout_s, self._abort_wait_s,
            self._push_metadata(secret))

    def _map(self, offer: ShmOffer | None, reservation_id: str) -> ShmSegment | None:
        """The offered segment, mapped; None to send payloads over gRPC."""
        if self.mode == "grpc":
            return None
        if offer is None:
            why = "the decode worker offered no shared memory"
        elif self.host_id is None or offer.host_id != self.host_id:
            why = "the decode worker runs on another host"
        else:
            try:
                return self._mapping(offer)
            except (OSError, ValueError) as e:
                why = f"its segment did not open: {e}"
        if self.mode == "shm":
            raise KVTransferError(f"KV push of {reservation_id} needs shared memory, but {why}",
                                  grpc.StatusCode.FAILED_PRECONDITION)
        log.debug("KV push of %s over gRPC: %s", reservation_id, why)
        return None


    def _mapping(self, offer: ShmOffer) -> ShmSegment:
        """The offered segment: a kept mapping of the same file, or a new one (kept)."""
        with self._count_lock:
            for name, seg in list(self._mapped.items()):
                if not seg.is_current():
                    del self._mapped[name]
                    seg.close()
            seg = self._mapped.pop(offer.segment, None)
            if seg is not None and seg.size != offer.size:
                seg.close()
                seg = None
            if seg is None:
                seg = ShmSegment.open(offer.segment, offer.size, self.directory)
            self._mapped[offer.segment] = seg
            while len(self._mapped) > 1 and sum(
                    s.size for s in self._mapped.values()) > self.max_mapped_bytes:
                self._mapped.popitem(last=False)[1].close()
            return seg

    @property
    def num_mapped(self) -> int:
        return len(self._mapped)

    def close(self) -> None:
        super().close()
        with self._count_lock:
            segs, self._mapped = list(self._mapped.values()), OrderedDict()
        for seg in segs:
            seg.close()
