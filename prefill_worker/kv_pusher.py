"""KVPusher: hands each layer's KV to the transfer stream as soon as that layer is done.

The engine calls `on_layer(layer, sampling)` on its thread right after every layer of a
step's forward. For each sequence whose prompt completes in this step and that has an open
transfer, the layer's K/V blocks are copied out (so the cache can move on) and queued on
its stream; the sender thread ships them while the next layers compute. Blocks computed in
earlier chunks or taken from the prefix cache are in the same block table and go with them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.kvtransfer.blocks import gather_blocks
from pdserve.kvtransfer.transport import KVPushStream


@dataclass(frozen=True)
class _Open:
    stream: KVPushStream
    num_blocks: int


class KVPusher:
    def __init__(self, kv_cache: PagedKVCache) -> None:
        self.kv = kv_cache
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()  # the event loop registers, the engine thread reads

    def register(self, request_id: str, stream: KVPushStream, num_blocks: int) -> None:
        with self._lock:
            self._open[request_id] = _Open(stream, num_blocks)

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._open.pop(request_id, None)

    def on_layer(self, layer: int, sampling: list[ScheduledSeq]) -> None:
        for s in sampling:
            with self._lock:
                push = self._open.get(s.seq.request_id)
            if push is None:
                continue
            blocks = s.seq.block_table[:push.num_blocks]
            k, v = self._copy_out(layer, blocks)
            push.stream.push_layer(layer, list(range(len(blocks))), k, v)

    def _copy_out(self, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of one layer's K and V blocks: the stream owns them from here on."""
        return (gather_blocks(self.kv.data[layer, 0], blocks).cpu(),
                gather_blocks(self.kv.data[layer, 1], blocks).cpu())
