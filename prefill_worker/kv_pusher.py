"""StreamSaver: the prefill worker's `KVSaver` — the engine's KV connector hands it each
layer's copy of a request's prompt blocks, and it queues them on the request's
`KVPushStream` (the transport), which sends them while the next layers compute.

It runs on the engine thread and only enqueues; the stream's sending thread waits on each
copy (`KVLayerCopy.wait`, a CUDA event) before it reads the tensors.
"""

from __future__ import annotations

from pdserve.engine.kv_connector import KVLayerCopy, KVSaver
from pdserve.kvtransfer.transport import KVPushStream


class StreamSaver(KVSaver):
    def __init__(self, stream: KVPushStream) -> None:
        self.stream = stream

    def save_layer(self, copy: KVLayerCopy) -> None:
        wait = copy.wait if copy.ready is not None else None
        self.stream.push_layer(copy.layer, copy.block_indices, copy.k, copy.v, wait=wait)
