"""One Session call at the decode worker: many Decode / Generate streams multiplexed on it.

Each stream the gateway opens runs in its own task over the same chunk generators the
per-request calls use (`DecodeService.decode_chunks` / `generate_chunks`), so a stream
carries exactly what its own call would, keepalives and `--stream-interval` included. What
changes is the wire: every chunk ready is queued as an entry, and the writer sends all the
entries queued when it runs as one message. The engine hands a step's deltas to every
stream in one event-loop callback, so the streams' tasks all run before the writer does:
a decode step's tokens for every request of that gateway leave in one message, where the
per-request calls cost one message each through this worker, the wire and the gateway.

The call opens with an empty message, so the gateway knows this worker has sessions before
it sends any stream (one without the method answers UNIMPLEMENTED, having seen none).
A stream ends with an entry marked `end` carrying the status its call would have ended
with (OK, or the refusal: NOT_FOUND, INVALID_ARGUMENT, INTERNAL, UNAVAILABLE, or
DEADLINE_EXCEEDED when its own timeout passed). A stream the gateway cancels ends without
one, as a cancelled call does. The call ending (the gateway gone, the connection broken)
cancels every stream on it, which aborts each request or releases its reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from pdserve.protos.pdserve.v1 import decode_pb2

if TYPE_CHECKING:
    from pdserve.decode_worker.service import DecodeService


class StreamRefused(Exception):
    """A stream's end with a status other than OK: what its call would abort with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _set_end(entry: decode_pb2.SessionEntry, code: grpc.StatusCode, details: str) -> None:
    entry.end, entry.status_code, entry.status_details = True, code.value[0], details


class StreamSession:
    def __init__(self, service: DecodeService,
                 colocated_refusal: Callable[[], str | None]) -> None:
        self._service = service
        self._colocated_refusal = colocated_refusal
        self._tasks: dict[int, asyncio.Task] = {}
        self._next = decode_pb2.SessionDown()  # the entries the writer sends next
        self._wake = asyncio.Event()
        self._reading = True  # the gateway may open more streams
        self._ending = False  # the worker is stopping: no new streams

    def end(self) -> None:
        """Refuse new streams and end the call once the open ones have ended."""
        self._ending = True
        self._wake.set()

    async def run(self, ups: AsyncIterator[decode_pb2.SessionUp]
                  ) -> AsyncIterator[decode_pb2.SessionDown]:
        """The call's messages: every entry queued since the last one, until the gateway
        stops opening streams (or the worker stops) and the open ones have ended."""
        reader = asyncio.get_running_loop().create_task(self._read(ups))
        try:
            # at once, empty: tells the gateway this worker has sessions before it sends any
            # stream (gateway/decode_session.py)
            yield decode_pb2.SessionDown()
            while True:
                if not self._next.entries:
                    if not self._tasks and (self._ending or not self._reading):
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                down, self._next = self._next, decode_pb2.SessionDown()
                yield down
        finally:
            reader.cancel()
            tasks = list(self._tasks.values())
            for t in tasks:
                t.cancel()  # each aborts its request or releases its reservation
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    def _entry(self, stream_id: int) -> decode_pb2.SessionEntry:
        """A new entry in the next message, for the caller to fill."""
        self._wake.set()
        return self._next.entries.add(stream_id=stream_id)

    def _end(self, stream_id: int, code: grpc.StatusCode, details: str = "") -> None:
        _set_end(self._entry(stream_id), code, details)

    async def _read(self, ups: AsyncIterator[decode_pb2.SessionUp]) -> None:
        try:
            async for up in ups:
                self._apply(up)
        finally:
            self._reading = False
            self._wake.set()

    def _apply(self, up: decode_pb2.SessionUp) -> None:
        sid = up.stream_id
        action = up.WhichOneof("action")
        if action == "cancel":
            task = self._tasks.get(sid)
            if task is not None:
                task.cancel()
            return
        if sid in self._tasks:
            self._end(sid, grpc.StatusCode.INVALID_ARGUMENT,
                      f"stream_id: {sid} is already open on this session")
            return
        if self._ending:
            self._end(sid, grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
            return
        if action == "generate":
            reason = self._colocated_refusal()
            if reason is not None:
                self._end(sid, grpc.StatusCode.UNAVAILABLE, reason)
                return
            chunks = self._service.generate_chunks(up.generate)
        elif action == "decode":
            chunks = self._service.decode_chunks(up.decode)
        else:
            self._end(sid, grpc.StatusCode.INVALID_ARGUMENT,
                      "action: open a stream with decode or generate, or cancel one")
            return
        task = asyncio.get_running_loop().create_task(
            self._serve(sid, chunks, up.timeout_s or None))
        self._tasks[sid] = task
        task.add_done_callback(lambda _: self._closed(sid))

    def _closed(self, sid: int) -> None:
        self._tasks.pop(sid, None)
        self._wake.set()

    async def _serve(self, sid: int, chunks: AsyncIterator[decode_pb2.TokenChunk],
                     timeout_s: float | None) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            async with contextlib.aclosing(chunks), asyncio.timeout(timeout_s):
                async for chunk in chunks:
                    self._entry(sid).chunk.CopyFrom(chunk)
        except StreamRefused as e:
            code, details = e.code, e.details
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        entries = self._next.entries
        if entries and entries[-1].stream_id == sid and not entries[-1].end:
            # the stream's last chunk has not left yet: it carries the end
            _set_end(entries[-1], code, details)
        else:
            self._end(sid, code, details)
