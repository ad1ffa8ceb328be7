"""Proto messages <-> the shared dataclasses. Sampling parameters and finish reasons convert
in `pdserve.protocol` (their one definition); this module adds logprobs and the KV layout."""

from __future__ import annotations

from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.protocol import TokenLogprobs, finish_from_proto, finish_to_proto
from pdserve.protos.pdserve.v1 import common_pb2

__all__ = ["finish_from_proto", "finish_to_proto", "kv_spec_from_proto", "kv_spec_to_proto",
           "layouts_match", "logprobs_from_proto", "logprobs_to_proto"]


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
