"""Translations between the protos and the gateway's dataclasses (no logic). What the
workers share (sampling params, finish reasons, KV layout) comes from `pdserve.convert`."""

from __future__ import annotations

from pdserve import convert as shared
from pdserve.engine.kv_cache import KVCacheSpec
from pdserve.engine.sequence import TokenLogprobs
from pdserve.gateway.registry import Load
from pdserve.gateway.request import RequestTiming
from pdserve.protos.pdserve.v1 import common_pb2

sampling_to_proto = shared.sampling_to_proto
FINISH_REASONS = {k: v for k, v in shared.FINISH_REASON_NAMES.items() if v is not None}
FINISH_TO_PROTO = {k: v for k, v in shared.FINISH_REASONS.items() if k is not None}


def sampling_fields_from_proto(msg: common_pb2.SamplingParams) -> dict:
    """Proto fields as SamplingParams keyword arguments; unset optional fields are None, so
    the gateway can apply its own defaults (max_tokens depends on the prompt's length)."""
    out: dict = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "repetition_penalty", "logprobs"):
        out[name] = getattr(msg, name) if msg.HasField(name) else None
    out["presence_penalty"] = msg.presence_penalty
    out["frequency_penalty"] = msg.frequency_penalty
    out["stop_token_ids"] = list(msg.stop_token_ids)
    out["ignore_eos"] = msg.ignore_eos
    out["min_tokens"] = msg.min_tokens
    return out


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
