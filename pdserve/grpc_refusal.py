"""Owns the one way a server turns a call away before its servicer runs: a method handler
that ends a call of any shape with a status, having read none of its requests (so nothing
the caller sent is parsed). Used for calls without the cluster token (UNAUTHENTICATED), for
calls to a worker still loading its model, and for work a worker leaving a tier refuses
(UNAVAILABLE)."""

from __future__ import annotations

import grpc


def refusing_handler(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A stream-stream handler that aborts at once: the server reads no request and writes
    no response, so a client of a unary or a streaming method alike receives `code` and
    `details` as the call's status."""
    async def refuse(_requests, context) -> None:
        await context.abort(code, details)

    return grpc.stream_stream_rpc_method_handler(refuse)
