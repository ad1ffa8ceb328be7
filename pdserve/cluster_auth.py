"""Cluster credentials: what proves that a caller of an internal RPC is a cluster member.

Two layers, both optional to configure and both enforced once configured:

- the shared cluster token (`--cluster-token`, or env PDSERVE_CLUSTER_TOKEN, or a file named
  by `--cluster-token-file` / PDSERVE_CLUSTER_TOKEN_FILE): sent as the
  `x-pdserve-cluster-token` metadata of every internal call and compared in constant time
  by `TokenInterceptor` on every internal server. Health checks stay open so probes work;
  everything else without the token gets UNAUTHENTICATED.
- mTLS (`--tls-cert/--tls-key/--tls-ca`): every internal server requires a client
  certificate signed by the CA, every internal channel presents its own.

A process bound to a non-loopback address with neither refuses to start (`require_for`):
an open internal port lets anyone steer traffic or write KV. Loopback-only processes (tests,
`pdserve up` without a token) may run open.

The token is a secret: it is never logged, and `pdserve up` hands it to its children in the
environment (not argv, which `ps` shows).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.grpc_refusal import refusing_handler

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_CLUSTER_TOKEN_FILE"
TOKEN_METADATA = "x-pdserve-cluster-token"
# methods any caller may use: the kubelet's and Docker's probes carry no credential
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class ClusterCredentials:
    token: str | None = None
    tls_cert: str | None = None  # PEM paths
    tls_key: str | None = None
    tls_ca: str | None = None
    # the name every cluster certificate carries, checked instead of the dialled host
    # (pods advertise IPs, which certificates rarely list)
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and not self.token:
            raise ValueError("cluster token: must not be empty")
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    @property
    def configured(self) -> bool:
        return self.token is not None or self.tls

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata proving membership (empty without a token)."""
        return ((TOKEN_METADATA, self.token),) if self.token else ()

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))], root_certificates=_read(self.tls_ca),
            require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca),
                                            private_key=_read(self.tls_key),
                                            certificate_chain=_read(self.tls_cert))

    def channel_options(self) -> list[tuple[str, object]]:
        if self.tls and self.tls_server_name:
            return [("grpc.ssl_target_name_override", self.tls_server_name)]
        return []

    def require_for(self, host: str, what: str) -> None:
        """ValueError when `what` would listen beyond loopback without any credential."""
        if not self.configured and not is_loopback(host):
            raise ValueError(
                f"{what} binds {host} with no cluster credential: give --cluster-token (or "
                f"{TOKEN_ENV}) and/or --tls-cert/--tls-key/--tls-ca")


def _read(path: str | None) -> bytes:
    assert path is not None
    return Path(path).read_bytes()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------- flags


def add_credential_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster credentials")
    g.add_argument("--cluster-token", default=None, metavar="TOKEN",
                   help=f"shared secret of the cluster's internal RPCs (prefer env {TOKEN_ENV}: "
                        "argv is visible to every local user)")
    g.add_argument("--cluster-token-file", default=None, metavar="PATH",
                   help=f"read the cluster token from this file (or env {TOKEN_FILE_ENV}), "
                        "e.g. a Docker or Kubernetes secret")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="this process's certificate for mTLS on internal gRPC")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="the CA that signs every cluster member's certificate")
    g.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name to verify in peers' certificates instead of the dialled host")


def credentials_from_args(a: argparse.Namespace,
                          env: dict[str, str] | None = None) -> ClusterCredentials:
    """The flag wins over the file, the file over the environment."""
    env = os.environ if env is None else env
    token = a.cluster_token
    path = a.cluster_token_file or env.get(TOKEN_FILE_ENV)
    if token is None and path:
        token = Path(path).read_text().strip()
    if token is None:
        token = env.get(TOKEN_ENV) or None
    return ClusterCredentials(token=token, tls_cert=a.tls_cert, tls_key=a.tls_key,
                              tls_ca=a.tls_ca, tls_server_name=a.tls_server_name)


# ---------------------------------------------------------------------------- servers


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with the cluster token (health checks always)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA:
                presented = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(presented, self._token):
            return handler
        return refusing_handler(grpc.StatusCode.UNAUTHENTICATED, f"{details.method}: missing "
                                f"or wrong {TOKEN_METADATA} (cluster members only)")


def server_interceptors(creds: ClusterCredentials) -> list[grpc.aio.ServerInterceptor]:
    return [TokenInterceptor(creds.token)] if creds.token else []


# ---------------------------------------------------------------------------- channels


def _with_metadata(details: grpc.aio.ClientCallDetails,
                   extra: tuple[tuple[str, str], ...]) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()), *extra)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md,
                                      details.credentials, details.wait_for_ready)


class _AddMetadata:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._md = metadata


# grpc.aio files an interceptor under the first of the four kinds it is an instance of, so
# each kind of call needs its own class
class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self._md), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self._md), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self._md), request_iterator)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self._md), request_iterator)


def client_interceptors(creds: ClusterCredentials) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the cluster token to every call of a grpc.aio channel."""
    md = creds.metadata()
    if not md:
        return []
    return [cls(md) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
