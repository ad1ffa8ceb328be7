"""gRPC channels to workers, one per address, opened on first use and shared by every
request to that worker. Made by `pdserve.rpc.aio_channel`: each call carries the cluster
credential, and the keepalive agrees with what the workers' servers accept. Token streams
from a decode worker go on one Session call per worker (decode_session.py) unless this
gateway was told to open a call per request."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from pdserve import rpc
from pdserve.cluster_auth import ClusterCredentials
from pdserve.gateway.decode_session import (
    DecodeSession,
    OpenRequest,
    TokenStream,
    per_request_call,
)
from pdserve.protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("pdserve.gateway")


@dataclass(frozen=True)
class WorkerStubs:
    channel: grpc.aio.Channel
    decode: decode_pb2_grpc.DecodeWorkerStub
    prefill: prefill_pb2_grpc.PrefillWorkerStub


class WorkerChannels:
    def __init__(self, credentials: ClusterCredentials = ClusterCredentials(),
                 keepalive: rpc.Keepalive = rpc.DEFAULT_KEEPALIVE,
                 sessions: bool = True) -> None:
        """sessions: token streams on one Session call per decode worker (False: a call
        per request)."""
        self.credentials = credentials
        self.keepalive = keepalive
        self.sessions = sessions
        self._stubs: dict[str, WorkerStubs] = {}
        self._sessions: dict[str, DecodeSession] = {}
        self._no_sessions: set[str] = set()  # workers that answered UNIMPLEMENTED
        self._tasks: set[asyncio.Task] = set()

    def get(self, address: str) -> WorkerStubs:
        s = self._stubs.get(address)
        if s is None:
            ch = rpc.aio_channel(address, self.credentials, self.keepalive)
            s = WorkerStubs(ch, decode_pb2_grpc.DecodeWorkerStub(ch),
                            prefill_pb2_grpc.PrefillWorkerStub(ch))
            self._stubs[address] = s
        return s

    def token_stream(self, address: str, request: OpenRequest, timeout: float | None
                     ) -> TokenStream | grpc.aio.Call:
        """A Decode (reserved) or Generate (colocated) token stream at the decode worker
        at `address`: on its Session call, or as a call of its own. Read either with
        `read()`, end either with `cancel()`."""
        stub = self.get(address).decode
        if not self.sessions or address in self._no_sessions:
            return per_request_call(stub, request, timeout)
        session = self._sessions.get(address)
        if session is None or session.closed:
            session = self._sessions[address] = DecodeSession(stub, address,
                                                              self._session_closed)
        return session.open(request, timeout)

    def _session_closed(self, session: DecodeSession, code: grpc.StatusCode | None) -> None:
        if self._sessions.get(session.address) is session:
            del self._sessions[session.address]
        if code == grpc.StatusCode.UNIMPLEMENTED:
            log.info("decode worker %s has no Session method: a call per request there",
                     session.address)
            self._no_sessions.add(session.address)

    def cancel(self, address: str, request_id: str = "", reservation_id: str = "",
               reason: str = "") -> None:
        """Fire-and-forget DecodeWorker.Cancel, so the worker frees the request's blocks
        now. Safe to call from a `finally` while the caller is being cancelled."""
        if reservation_id:
            req = decode_pb2.CancelRequest(reservation_id=reservation_id, reason=reason)
        else:
            req = decode_pb2.CancelRequest(request_id=request_id, reason=reason)
        stub = self.get(address).decode

        async def send() -> None:
            try:
                await stub.Cancel(req, timeout=5.0)
            except grpc.aio.AioRpcError as e:
                log.debug("Cancel at %s failed: %s", address, e.code().name)

        t = asyncio.get_running_loop().create_task(send())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def close_soon(self, address: str) -> None:
        """Close a channel from synchronous code (a worker left the registry)."""
        t = asyncio.get_running_loop().create_task(self.close(address))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for outstanding Cancel calls (at shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def close(self, address: str) -> None:
        session = self._sessions.pop(address, None)
        if session is not None:
            session.close()
        self._no_sessions.discard(address)
        s = self._stubs.pop(address, None)
        if s is not None:
            await s.channel.close()

    async def close_all(self) -> None:
        await self.drain()
        for addr in list(self._stubs):
            await self.close(addr)
