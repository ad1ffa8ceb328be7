"""The gateway's side of DecodeWorker.Session: one call per decode worker that carries the
token streams of all of this gateway's requests there (decode_worker/session.py).

A `TokenStream` reads like the Decode / Generate call it stands for: `read()` gives the
next TokenChunk, or `grpc.aio.EOF` after the stream ended OK, and raises the stream's
other statuses as `grpc.aio.AioRpcError`; `cancel()` ends it (a read waiting, or any read
after, raises CancelledError) and tells the worker. So the orchestrator's liveness bound,
its drop handling (`inflight.Slot.track`) and its retry policy apply unchanged.

One worker step's tokens for every request reach this gateway in one message; the
reader hands each stream its chunk. When the call breaks (the worker died, the connection
dropped) every stream open on it fails UNAVAILABLE, as their own calls would have, and
the next stream opens a new call. Streams opened before the worker's first message (an
empty one it sends at once) wait for it: a worker that has no Session method (an older one)
answers UNIMPLEMENTED instead, having seen none of them, and those streams are sent again as
their own calls; that worker gets per-request calls from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.protos.pdserve.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger("pdserve.gateway")

OpenRequest = decode_pb2.DecodeRequest | decode_pb2.ColocatedGenerateRequest


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def per_request_call(stub: decode_pb2_grpc.DecodeWorkerStub, request: OpenRequest,
                     timeout: float | None):
    """The stream as a call of its own (Decode or Generate, by the request's type)."""
    if isinstance(request, decode_pb2.DecodeRequest):
        return stub.Decode(request, timeout=timeout)
    return stub.Generate(request, timeout=timeout)


class TokenStream:
    """One request's token stream on a session (see the module docstring)."""

    def __init__(self, session: DecodeSession, stream_id: int, request: OpenRequest,
                 timeout: float | None) -> None:
        self._session = session
        self.stream_id = stream_id
        self._request = request
        self._timeout = timeout
        self._items: deque[decode_pb2.TokenChunk | grpc.aio.AioRpcError | object] = deque()
        self._waiter: asyncio.Future | None = None
        self._cancelled = False
        self._ended = False
        self._call = None  # its own call, once the worker turned out to have no sessions

    async def read(self):
        while self._call is None and not self._items and not self._cancelled:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._call is not None:
            return await self._call.read()
        if self._cancelled:
            raise asyncio.CancelledError
        item = self._items.popleft()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def cancel(self) -> bool:
        if self._call is not None:
            return self._call.cancel()
        if self._cancelled or self._ended:
            return False
        self._cancelled = True
        self._session.cancel(self.stream_id)
        self._wake(cancel=True)
        return True

    # -- the session's side ---------------------------------------------------------------
    def deliver(self, chunk: decode_pb2.TokenChunk) -> None:
        self._items.append(chunk)
        self._wake()

    def end(self, code: grpc.StatusCode, details: str) -> None:
        self._ended = True
        self._items.append(grpc.aio.EOF if code == grpc.StatusCode.OK
                           else _status(code, details))
        self._wake()

    def reopen(self, stub: decode_pb2_grpc.DecodeWorkerStub) -> None:
        """The worker has no sessions: go on as a call of its own."""
        self._call = per_request_call(stub, self._request, self._timeout)
        if self._cancelled:
            self._call.cancel()
        self._wake()

    def _wake(self, cancel: bool = False) -> None:
        w = self._waiter
        if w is not None and not w.done():
            if cancel:
                w.cancel()
            else:
                w.set_result(None)


class DecodeSession:
    """The Session call to one decode worker and the streams open on it."""

    def __init__(self, stub: decode_pb2_grpc.DecodeWorkerStub, address: str,
                 on_closed: Callable[[DecodeSession, grpc.StatusCode | None], None]) -> None:
        self.address = address
        self._stub = stub
        self._on_closed = on_closed
        self._ups: asyncio.Queue[decode_pb2.SessionUp | None] = asyncio.Queue()
        # opens held until the worker's first (empty) message says it has sessions: a
        # server without the method then ends the call before this side wrote anything,
        # which is what makes its UNIMPLEMENTED reliable (a write racing that end can turn
        # the status into an internal error)
        self._held: list[decode_pb2.SessionUp] | None = []
        self._streams: dict[int, TokenStream] = {}
        self._next_id = 1
        self.closed = False
        # no deadline of its own: it lives as long as the channel; each stream's liveness
        # is the orchestrator's idle bound on it, as for a call of its own
        self._call = stub.Session(self._up_messages())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def open(self, request: OpenRequest, timeout: float | None) -> TokenStream:
        sid, self._next_id = self._next_id, self._next_id + 1
        stream = TokenStream(self, sid, request, timeout)
        self._streams[sid] = stream
        up = decode_pb2.SessionUp(stream_id=sid, timeout_s=timeout or 0.0)
        if isinstance(request, decode_pb2.DecodeRequest):
            up.decode.CopyFrom(request)
        else:
            up.generate.CopyFrom(request)
        if self._held is not None:
            self._held.append(up)
        else:
            self._ups.put_nowait(up)
        return stream

    def cancel(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is None or self.closed:
            return
        if self._held is not None:  # never sent: nothing to tell the worker
            self._held = [up for up in self._held if up.stream_id != stream_id]
        else:
            self._ups.put_nowait(decode_pb2.SessionUp(stream_id=stream_id, cancel=True))

    def close(self) -> None:
        """End the call (its streams fail UNAVAILABLE)."""
        self._call.cancel()

    async def _up_messages(self) -> AsyncIterator[decode_pb2.SessionUp]:
        while (up := await self._ups.get()) is not None:
            yield up

    async def _read(self) -> None:
        code: grpc.StatusCode | None = None
        details = "ended the session"
        try:
            async for down in self._call:
                if self._held is not None:  # the worker's greeting: send what waited
                    for up in self._held:
                        self._ups.put_nowait(up)
                    self._held = None
                for e in down.entries:
                    stream = self._streams.get(e.stream_id)
                    if stream is None:
                        continue  # cancelled here: what was on the wire is dropped
                    if e.HasField("chunk"):
                        stream.deliver(e.chunk)
                    if e.end:
                        del self._streams[e.stream_id]
                        stream.end(_CODES.get(e.status_code, grpc.StatusCode.UNKNOWN),
                                   e.status_details)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), f"session failed: {e.details()}"
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "session closed"
        except Exception as e:  # noqa: BLE001 - a stream must never be left waiting
            log.exception("session with decode worker %s failed", self.address)
            code, details = grpc.StatusCode.INTERNAL, f"session failed: {e}"
        finally:
            self.closed = True
            self._ups.put_nowait(None)
            streams, self._streams = list(self._streams.values()), {}
            if code == grpc.StatusCode.UNIMPLEMENTED and self._held is not None:
                for s in streams:  # none was sent
                    s.reopen(self._stub)
            else:
                for s in streams:
                    s.end(grpc.StatusCode.UNAVAILABLE,
                          f"decode worker {self.address}: {details}")
            self._on_closed(self, code)


# grpc status codes by number, as a SessionEntry carries them
_CODES = {c.value[0]: c for c in grpc.StatusCode}
