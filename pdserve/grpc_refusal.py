"""Owns the one way a server turns a call away before its servicer runs: a method handler
that ends a call of any shape with a status, having read none of its requests (so nothing
the caller sent is parsed). Used for calls without the cluster token (UNAUTHENTICATED), for
calls to a server still starting (a worker loading its model, a gateway its tokenizer:
`LateServices`), and for work a worker leaving a tier refuses (UNAVAILABLE)."""

from __future__ import annotations

from collections.abc import Callable

import grpc


def refusing_handler(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A stream-stream handler that aborts at once: the server reads no request and writes
    no response, so a client of a unary or a streaming method alike receives `code` and
    `details` as the call's status."""
    async def refuse(_requests, context) -> None:
        await context.abort(code, details)

    return grpc.stream_stream_rpc_method_handler(refuse)


class LateServices(grpc.GenericRpcHandler):
    """Servicers added after the server started, so that a server listens only once it
    answers: a port bound but not yet served holds a client's connection attempt until
    gRPC's connect timeout (20 s by default), where a started one answers at once. Installed
    before start as one generic handler. Until `opened()`, a call to any method not there
    yet is turned away with UNAVAILABLE and `starting` as its details: a worker restarted on
    the address the gateway still routes to must not answer UNIMPLEMENTED, which callers
    take for "this server lacks the method" (the gateway's sessions fall back to a call per
    request on it) rather than "try again or elsewhere". After `opened()` an unknown method
    is UNIMPLEMENTED. `refuse(method)` may name a reason to turn a call away with
    UNAVAILABLE (a worker leaving a tier refuses that tier's new work), which the gateway's
    retry policy passes on to the next worker."""

    def __init__(self, starting: str) -> None:
        self._handlers: list[grpc.GenericRpcHandler] = []
        self._starting: grpc.RpcMethodHandler | None = refusing_handler(
            grpc.StatusCode.UNAVAILABLE, starting)
        self.refuse: Callable[[str], str | None] = lambda method: None

    def opened(self) -> None:
        """Every servicer is in: unknown methods are UNIMPLEMENTED from now on."""
        self._starting = None

    def service(self, handler_call_details):
        for h in self._handlers:
            handler = h.service(handler_call_details)
            if handler is not None:
                reason = self.refuse(handler_call_details.method)
                return handler if reason is None else refusing_handler(
                    grpc.StatusCode.UNAVAILABLE, reason)
        return self._starting

    # what the generated add_*Servicer_to_server functions call on a "server"
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._handlers.extend(handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        pass  # the generic handler above already routes these methods
