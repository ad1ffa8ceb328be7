"""The KV wire format: one `KVChunk` carries some blocks of one layer.

    header : reservation_id, layer, block_indices (logical, within the reservation),
             dtype name, shape of the K part [n, block_size, kv_heads, head_dim], seq, crc32
    payload: K bytes of those n blocks, then V bytes of the same n blocks
             (C-contiguous, native little-endian), crc32 = zlib.crc32(payload)

A layer's blocks are split into chunks of at most `max_chunk_bytes` of payload (at least
one block per chunk). Decoding never unpickles anything: the payload is reinterpreted as
the spec's dtype with `torch.frombuffer` after every header field has been checked against
the receiver's `KVCacheSpec` and the reservation's size.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCacheSpec, dtype_name
from kvtransfer.sink import KVCommitInfo
from protos.pdserve.v1 import common_pb2, kvtransfer_pb2

DEFAULT_MAX_CHUNK_BYTES = 1 << 20


class KVChunkError(ValueError):
    """A chunk or commit that fails validation; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class DecodedChunk:
    layer: int
    block_indices: list[int]
    k: torch.Tensor  # [n, block_size, kv_heads, head_dim], writable, CPU
    v: torch.Tensor  # same
    num_bytes: int  # payload bytes


def _as_bytes(t: torch.Tensor) -> memoryview:
    # any dtype (bfloat16 included) -> its raw bytes, without going through numpy dtypes
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def blocks_per_chunk(block_bytes: int, max_chunk_bytes: int) -> int:
    """Blocks (K and V) that fit in one chunk's payload; always at least one."""
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
    return max(1, max_chunk_bytes // (2 * block_bytes))


def encode_layer(
    reservation_id: str,
    layer: int,
    block_indices: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    first_seq: int = 0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Iterator[kvtransfer_pb2.KVChunk]:
    """Yields the chunks of one layer's blocks, numbered first_seq, first_seq + 1, ...

    k, v: [n, block_size, kv_heads, head_dim], same shape and dtype, any device.
    """
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"k and v must be 4-D of equal shape and dtype, got {tuple(k.shape)} {k.dtype} "
            f"and {tuple(v.shape)} {v.dtype}"
        )
    n = k.shape[0]
    indices = [int(i) for i in block_indices]
    if len(indices) != n or n == 0 or min(indices) < 0:
        raise ValueError(f"block indices {indices[:16]} do not address the {n} blocks given")
    dtype = dtype_name(k.dtype)
    k = k.detach().to("cpu").contiguous()
    v = v.detach().to("cpu").contiguous()
    block_bytes = k[0].numel() * k.element_size()
    step = blocks_per_chunk(block_bytes, max_chunk_bytes)
    for i, start in enumerate(range(0, n, step)):
        end = min(start + step, n)
        payload = b"".join((_as_bytes(k[start:end]), _as_bytes(v[start:end])))
        yield kvtransfer_pb2.KVChunk(
            reservation_id=reservation_id,
            layer=layer,
            block_indices=indices[start:end],
            dtype=dtype,
            shape=[end - start, *k.shape[1:]],
            seq=first_seq + i,
            crc32=zlib.crc32(payload),
            payload=payload,
        )


def decode_chunk(
    chunk: kvtransfer_pb2.KVChunk, spec: KVCacheSpec, num_reserved_blocks: int
) -> DecodedChunk:
    """Checks every header field and the payload, then returns the K and V tensors.

    Raises KVChunkError naming the first field that is wrong. reservation_id and seq are
    stream-level facts and are checked by the receiver.
    """
    if not 0 <= chunk.layer < spec.num_layers:
        raise KVChunkError("layer", f"{chunk.layer} not in [0, {spec.num_layers})")
    if chunk.dtype != spec.dtype:
        raise KVChunkError("dtype", f"{chunk.dtype!r} != receiver dtype {spec.dtype!r}")
    shape = tuple(chunk.shape)
    if len(shape) != 4 or shape[0] < 1 or shape[1:] != spec.block_shape:
        raise KVChunkError(
            "shape", f"{list(shape)} is not [n >= 1, {', '.join(map(str, spec.block_shape))}]"
        )
    n = shape[0]
    indices = list(chunk.block_indices)
    if len(indices) != n:
        raise KVChunkError("block_indices", f"{len(indices)} indices for shape[0] = {n}")
    bad = [i for i in indices if i >= num_reserved_blocks]
    if bad:
        raise KVChunkError(
            "block_indices", f"{bad[:8]} outside the reservation's {num_reserved_blocks} blocks"
        )
    if len(set(indices)) != n:
        raise KVChunkError("block_indices", f"duplicate indices in {indices[:16]}")
    expected = 2 * n * spec.block_bytes
    if len(chunk.payload) != expected:
        raise KVChunkError("payload", f"{len(chunk.payload)} bytes, expected {expected}")
    if zlib.crc32(chunk.payload) != chunk.crc32:
        raise KVChunkError("crc32", "payload checksum mismatch")
    # A read-only view of the payload, no copy: the sink copies it into the cache (its
    # only use), so the warning about a non-writable buffer does not apply.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        kv = torch.frombuffer(chunk.payload, dtype=spec.torch_dtype)
    kv = kv.view(2, *shape)
    return DecodedChunk(chunk.layer, indices, kv[0], kv[1], len(chunk.payload))


def commit_to_proto(
    reservation_id: str, num_chunks: int, info: KVCommitInfo
) -> kvtransfer_pb2.KVCommit:
    msg = kvtransfer_pb2.KVCommit(
        reservation_id=reservation_id,
        num_chunks=num_chunks,
        num_prompt_tokens=info.num_prompt_tokens,
        num_cached_tokens=info.num_cached_tokens,
        first_token_id=info.first_token_id,
        timing=common_pb2.PrefillTiming(
            queue_s=info.queue_s, compute_s=info.compute_s, transfer_s=info.transfer_s
        ),
    )
    if info.first_token_logprob is not None:
        msg.first_token_logprobs.CopyFrom(common_pb2.TokenLogprobs(
            token_id=info.first_token_id,
            logprob=info.first_token_logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=lp)
                 for t, lp in info.first_token_top_logprobs],
        ))
    return msg


def commit_from_proto(msg: kvtransfer_pb2.KVCommit) -> KVCommitInfo:
    """Raises KVChunkError for values KVCommitInfo refuses."""
    if msg.num_prompt_tokens < 1:
        raise KVChunkError("num_prompt_tokens", "must be >= 1")
    if msg.num_cached_tokens > msg.num_prompt_tokens:
        raise KVChunkError("num_cached_tokens", "exceeds num_prompt_tokens")
    t = msg.timing
    if min(t.queue_s, t.compute_s, t.transfer_s) < 0:
        raise KVChunkError("timing", "negative duration")
    has_lp = msg.HasField("first_token_logprobs")
    lp = msg.first_token_logprobs
    return KVCommitInfo(
        num_prompt_tokens=msg.num_prompt_tokens,
        first_token_id=msg.first_token_id,
        first_token_logprob=lp.logprob if has_lp else None,
        first_token_top_logprobs=tuple((x.token_id, x.logprob) for x in lp.top),
        num_cached_tokens=msg.num_cached_tokens,
        queue_s=t.queue_s,
        compute_s=t.compute_s,
        transfer_s=t.transfer_s,
    )
