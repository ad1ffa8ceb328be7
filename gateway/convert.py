"""Translations between the protos and the gateway's dataclasses (no logic). Sampling
parameters and finish reasons convert in `pdserve.protocol`; logprobs and the KV layout in
`pdserve.convert`, shared with the workers."""

from __future__ import annotations

from pdserve import convert as shared
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.gateway.registry import Load
from pdserve.gateway.request import RequestTiming
from pdserve.protocol import TokenLogprobs
from pdserve.protos.pdserve.v1 import common_pb2


def logprobs_from_proto(items) -> tuple[TokenLogprobs, ...]:
    return tuple(shared.logprobs_from_proto(x) for x in items)


def logprobs_to_proto(items: tuple[TokenLogprobs, ...]) -> list[common_pb2.TokenLogprobs]:
    return [shared.logprobs_to_proto(x) for x in items]


def timing_to_proto(t: RequestTiming) -> common_pb2.Timing:
    return common_pb2.Timing(queue_s=t.queue_s, prefill_s=t.prefill_s,
                             transfer_s=t.transfer_s, decode_s=t.decode_s)


def kv_spec_from_proto(msg: common_pb2.KVCacheSpec) -> KVCacheSpec | None:
    """None when the message is empty (a worker that did not say)."""
    if msg.block_size == 0:
        return None
    try:
        return shared.kv_spec_from_proto(msg)
    except ValueError:
        return None


def load_from_proto(msg: common_pb2.WorkerLoad) -> Load:
    return Load(msg.num_running, msg.num_waiting, msg.free_blocks, msg.total_blocks,
                msg.tokens_per_s, msg.queue_depth, frozenset(msg.cached_block_hashes))
