"""The one place internal gRPC servers and channels are made: message limits, keepalive
settings that agree between the two ends, and the cluster credentials
(`pdserve.cluster_auth`). Every tier uses these factories — the gateway's channels to
workers and its registry listener, the workers' servers and their registration client, the
prefill worker's KV push channel — so a server never polices a ping rate its clients were
configured to exceed (the `GOAWAY too_many_pings` an idle cluster used to collect).

Reconnection (`RECONNECT_OPTIONS`): a channel whose peer is down retries after 0.1 s at
first, backing off to once a second. gRPC's own backoff (1 s, growing 1.6x a try up to
120 s) leaves a channel that tried a peer before it was up, or while `pdserve up` restarted
it, idle for up to a try's backoff after the peer is back, failing calls as UNAVAILABLE
meanwhile (after a minute down, ~20-30 s).

Keepalive, from one `Keepalive`:
  channel: ping every `time_s` even with no call open, give up after `timeout_s` unacked
  server:  accept pings down to `time_s / 2` apart with no call open (jitter never strikes),
           and ping its own idle clients every `time_s`
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdserve.cluster_auth import ClusterCredentials, client_interceptors, server_interceptors

MAX_MESSAGE_BYTES = 64 * 2**20  # KV chunks and long prompts fit comfortably

# how soon a channel retries a peer that refused or dropped it (see the top); a try a
# second per channel to a peer that stays down costs next to nothing inside a cluster
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass(frozen=True)
class Keepalive:
    time_s: float = 30.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.time_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"keepalive times must be > 0, got {self}")

    def channel_options(self) -> list[tuple[str, int]]:
        return [("grpc.keepalive_time_ms", int(self.time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]

    def server_options(self) -> list[tuple[str, int]]:
        return [("grpc.keepalive_time_ms", int(self.time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                # the server's floor for clients' pings without data (core's name for
                # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS)
                ("grpc.http2.min_ping_interval_without_data_ms", int(self.time_s * 500)),
                ("grpc.http2.max_pings_without_data", 0)]


DEFAULT_KEEPALIVE = Keepalive()

_LIMITS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
           ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def server(creds: ClusterCredentials, keepalive: Keepalive = DEFAULT_KEEPALIVE, *,
           internal: bool = True,
           interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A grpc.aio server; `internal` ones check the cluster token on every call but health
    (before any of `interceptors`). Bind it with `add_port`."""
    chain = [*(server_interceptors(creds) if internal else ()), *interceptors]
    return grpc.aio.server(
        interceptors=chain or None,
        options=[*_LIMITS, *keepalive.server_options(), ("grpc.so_reuseport", 0)])


def add_port(srv: grpc.aio.Server, address: str, creds: ClusterCredentials | None) -> int:
    """Binds `address` (mTLS when `creds` has certificates); the bound port. OSError when
    it cannot bind."""
    tls = creds.server_credentials() if creds is not None else None
    port = srv.add_secure_port(address, tls) if tls else srv.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return port


def aio_channel(address: str, creds: ClusterCredentials,
                keepalive: Keepalive = DEFAULT_KEEPALIVE) -> grpc.aio.Channel:
    """A grpc.aio channel to a cluster member: every call carries the credential."""
    options = [*_LIMITS, *RECONNECT_OPTIONS, *keepalive.channel_options(),
               *creds.channel_options()]
    tls = creds.channel_credentials()
    interceptors = client_interceptors(creds) or None
    if tls is not None:
        return grpc.aio.secure_channel(address, tls, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(address: str, creds: ClusterCredentials,
                 keepalive: Keepalive = DEFAULT_KEEPALIVE,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking-API channel (the KV sender's threads). Calls must pass
    `creds.metadata()` themselves."""
    # later settings win (dict order), so a caller may lift a limit
    opts = list(dict([*_LIMITS, *RECONNECT_OPTIONS, *keepalive.channel_options(),
                      *creds.channel_options(), *options]).items())
    tls = creds.channel_credentials()
    if tls is not None:
        return grpc.secure_channel(address, tls, options=opts)
    return grpc.insecure_channel(address, options=opts)
