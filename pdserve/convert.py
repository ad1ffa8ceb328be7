"""Proto messages <-> engine dataclasses. The only place that knows both shapes."""

from __future__ import annotations

from pdserve.engine.kv_cache import KVCacheSpec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprobs
from pdserve.protos.pdserve.v1 import common_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_from_proto(m: common_pb2.SamplingParams, default_max_tokens: int = 16
                        ) -> SamplingParams:
    """ValueError (naming the field) when a value is out of range."""
    kw: dict = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "repetition_penalty", "logprobs"):
        if m.HasField(name):
            kw[name] = getattr(m, name)
    kw.setdefault("max_tokens", default_max_tokens)
    if kw.get("top_k") == 0:
        kw["top_k"] = -1
    return SamplingParams(presence_penalty=m.presence_penalty,
                          frequency_penalty=m.frequency_penalty,
                          stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
                          min_tokens=m.min_tokens, output_offset=m.output_offset, **kw)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
        top_k=max(p.top_k, 0), min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens, output_offset=p.output_offset)
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    return m


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprobs_from_proto(m: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top))


def kv_spec_to_proto(s: KVCacheSpec) -> common_pb2.KVCacheSpec:
    return common_pb2.KVCacheSpec(num_layers=s.num_layers, num_blocks=s.num_blocks,
                                  block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                                  head_dim=s.head_dim, dtype=s.dtype)


def kv_spec_from_proto(m: common_pb2.KVCacheSpec) -> KVCacheSpec:
    return KVCacheSpec(m.num_layers, m.num_blocks, m.block_size, m.num_kv_heads, m.head_dim,
                       m.dtype)


def layouts_match(a: KVCacheSpec, b: KVCacheSpec) -> bool:
    """Two workers can exchange KV when everything but the pool size matches."""
    return (a.num_layers, a.block_size, a.num_kv_heads, a.head_dim, a.dtype) == (
        b.num_layers, b.block_size, b.num_kv_heads, b.head_dim, b.dtype)
