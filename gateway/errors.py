"""How a request fails: one error type, one table mapping each kind to its gRPC status, its
HTTP status and its OpenAI error `type`, so both client APIs report a failure the same way."""

from __future__ import annotations

import enum

import grpc


class ErrorKind(enum.Enum):
    # value: (gRPC status, HTTP status, OpenAI error type)
    INVALID = (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")
    UNKNOWN_MODEL = (grpc.StatusCode.INVALID_ARGUMENT, 404, "invalid_request_error")
    TOO_LARGE = (grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error")
    OVERLOADED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error")
    DEADLINE = (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error")
    CANCELLED = (grpc.StatusCode.CANCELLED, 499, "cancelled_error")
    INTERNAL = (grpc.StatusCode.INTERNAL, 500, "server_error")  # an engine failed

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]


class GatewayError(Exception):
    """A request the gateway refuses or cannot finish. `param` names the offending field."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def code(self) -> str:
        """The gRPC status name (metrics label, OpenAI `code`)."""
        return self.kind.grpc_code.name

    def __repr__(self) -> str:
        return f"GatewayError({self.kind.name}, {self.message!r}, param={self.param!r})"


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorKind.INVALID, message, param)


_FROM_WORKER = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID,
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind.INVALID,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.DEADLINE,
    grpc.StatusCode.CANCELLED: ErrorKind.CANCELLED,
    grpc.StatusCode.INTERNAL: ErrorKind.INTERNAL,
}


def from_worker_status(code: grpc.StatusCode, details: str | None, who: str) -> GatewayError:
    """A worker RPC's failure as the client sees it. Anything that is not the client's fault
    or a capacity/deadline matter means the worker could not serve it: UNAVAILABLE. No
    `param`: the gateway validated every client field before any worker saw it."""
    kind = _FROM_WORKER.get(code, ErrorKind.UNAVAILABLE)
    msg = details or code.name
    if kind in (ErrorKind.UNAVAILABLE, ErrorKind.INTERNAL):
        msg = f"{who} failed ({code.name}): {msg}"
    return GatewayError(kind, msg)
