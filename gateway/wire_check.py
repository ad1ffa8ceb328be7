"""Malformed client messages answered as the client's fault. A gRPC request whose bytes do
not parse (a string field that is not UTF-8, a truncated message) would fail inside gRPC's
deserializer and reach the client as UNKNOWN; this server interceptor parses it itself and
answers INVALID_ARGUMENT instead, before any servicer code runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _safe(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Malformed(e)
    return parse


def _message(m: _Malformed) -> str:
    return f"request: not a valid message ({m.error})"


def _guard_unary(behavior):
    async def run(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        return await behavior(request, context)
    return run


def _guard_stream(behavior):
    async def run(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
        async for item in behavior(request, context):
            yield item
    return run


class MalformedRequests(grpc.aio.ServerInterceptor):
    """For unary-request methods (the gateway has no client-streaming ones)."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        safe = _safe(handler.request_deserializer)
        if handler.response_streaming:
            return handler._replace(request_deserializer=safe,
                                    unary_stream=_guard_stream(handler.unary_stream))
        return handler._replace(request_deserializer=safe,
                                unary_unary=_guard_unary(handler.unary_unary))
