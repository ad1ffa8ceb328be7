"""The sending side's interface: prefill workers push KV through a `KVTransport`.

    stream = transport.open(dest_address, reservation_id, spec, secret)
    for each layer, right after its forward:   stream.push_layer(layer, idx, k, v)  # no wait
    on success:                                result = stream.commit(info)      # waits for ack
      (from asyncio:                           result = await stream.commit_async(info, t))
    on failure or cancellation:                stream.abort(reason)

gRPC streaming (`pdserve.kvtransfer.grpc_sender`) is the default implementation; same-host shared
memory (`pdserve.kvtransfer.shm_sender`) implements the same two classes, taking the decode
worker's `ShmOffer` at `open` (a transport that cannot use an offer ignores it); RDMA
transports would plug in the same way.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer.shm import ShmOffer
from pdserve.kvtransfer.sink import KVCommitInfo


@dataclass(frozen=True)
class PushResult:
    """A committed transfer, as the sender saw it."""

    reservation_id: str
    num_chunks: int
    bytes_sent: int  # payload bytes
    push_s: float  # from open() to the receiver's acknowledgement of the commit


class KVTransferError(RuntimeError):
    """A transfer that did not commit; `code` is the receiver's gRPC status if it gave one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class KVPushStream(ABC):
    """One transfer into one reservation. Not reusable after commit or abort."""

    @abstractmethod
    def push_layer(
        self, layer: int, block_indices: Sequence[int], k_blocks: torch.Tensor,
        v_blocks: torch.Tensor, wait: Callable[[], None] | None = None,
    ) -> None:
        """Queues a layer's blocks and returns at once; sending overlaps later compute.

        k_blocks, v_blocks: [n, block_size, kv_heads, head_dim] of the spec's dtype, owned
        by the stream from now on (pass copies), readable from another thread once `wait`
        (when given: a copy's CUDA event, `KVLayerCopy.wait`) has returned, which the
        stream calls on its sending thread before reading them. block_indices are the
        logical indices within the reservation. Raises ValueError on a shape/dtype/layer
        mismatch; a failure of the transfer itself surfaces in `commit`.
        """

    @abstractmethod
    def commit(self, info: KVCommitInfo, timeout_s: float | None = None) -> PushResult:
        """Sends everything queued, then the commit; blocks until the receiver acks.

        Raises KVTransferError (with the gRPC status code) if the receiver refused any
        chunk, the commit, or could not be reached.
        """

    async def commit_async(self, info: KVCommitInfo, timeout_s: float) -> PushResult:
        """`commit` for an event loop: waits at most timeout_s (then KVTransferError
        DEADLINE_EXCEEDED). This default spends a thread on the wait; transports that can
        be awaited directly override it."""
        return await asyncio.to_thread(self.commit, info, timeout_s)

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Drops what is still queued and tells the receiver to free the reservation.
        Never raises and never blocks (it is called on event loops); a no-op after commit or
        a previous abort."""

    @property
    @abstractmethod
    def failed(self) -> bool:
        """True once the transfer ended without a commit (checked without blocking)."""


class KVTransport(ABC):
    """Opens push streams to decode workers; owns the connections."""

    @abstractmethod
    def open(self, dest_address: str, reservation_id: str, spec: KVCacheSpec,
             secret: str = "", shm: ShmOffer | None = None) -> KVPushStream:
        """Starts a transfer; spec is the sender's layout (equal to the receiver's but for
        num_blocks); secret is the reservation's, from ReserveResponse; shm: the decode
        worker's shared-memory offer for this reservation, if it made one
        (ReserveResponse.shm), which a transport may use or ignore."""

    @abstractmethod
    def close(self) -> None:
        """Closes every connection; open streams fail."""
