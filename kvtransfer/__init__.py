"""Moving paged KV blocks from a prefill worker to a decode worker.

The layout being moved is `pdserve.engine.kv_cache.KVCacheSpec`'s: per layer, K and V of shape
`[num_blocks, block_size, kv_heads, head_dim]`. A transfer fills one reservation that the
decode worker made before any prefill work began.

- `wire`: the chunk format (header + raw K then V bytes + CRC-32C), its validation, and the
  copy-free (de)serialization of chunk messages used on both ends.
- `sink`: `KVSink`, what the decode engine implements to receive KV, and `KVCommitInfo`.
- `memory_sink`: `InMemoryKVSink`, a real sink over a `PagedKVCache` (tests, warm-up).
- `receiver`: `KVTransferService`, the `KVTransfer.Push` servicer hosted by decode workers.
- `transport`: the sender interface prefill workers use (`KVTransport`, `KVPushStream`).
- `grpc_sender`: `GrpcKVTransport`, the gRPC streaming implementation of it.
- `shm`: same-host shared memory: the host id, the segments and the decode worker's pool
  of them (offered at Reserve), with their life cycle.
- `shm_sender`: `ShmKVTransport`, payloads through the decode worker's segment and only
  descriptors on the Push stream when both share a host; gRPC payloads otherwise.
- `malloc_tuning`: keeps glibc from returning message buffers to the kernel per chunk.
"""

from pdserve.kvtransfer.sink import KVCommitInfo, KVSink
from pdserve.kvtransfer.transport import KVPushStream, KVTransferError, KVTransport, PushResult
from pdserve.kvtransfer.wire import DEFAULT_MAX_CHUNK_BYTES, KVChunkError

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "KVChunkError",
    "KVCommitInfo",
    "KVPushStream",
    "KVSink",
    "KVTransferError",
    "KVTransport",
    "PushResult",
]
