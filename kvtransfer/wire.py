"""The KV wire format: one `KVChunk` carries some blocks of one layer, or the same blocks of
several consecutive layers.

    header : reservation_id, layer, num_layers (0 reads as 1), block_indices (logical,
             within the reservation), dtype name, shape of one layer's K part
             [n, block_size, kv_heads, head_dim], seq, crc32c
    payload: for each layer from `layer` on: K bytes of those n blocks, then V bytes of the
             same n blocks (C-contiguous, native little-endian); crc32c = CRC-32C of the
             whole payload

A layer's blocks are split into chunks of at most `max_chunk_bytes` of payload (at least
one block per chunk). Whole layers that are ready together and fit in `max_chunk_bytes`
may share one chunk (`encode_layers_descriptor`: the shared-memory sender, whose chunks
cost the receiver a message and a round of checks each, whatever their size). Decoding
never unpickles anything: the payload is reinterpreted as the spec's dtype with
`torch.frombuffer` after every header field has been checked against the receiver's
`KVCacheSpec` and the reservation's size.

The bytes on the wire are plain protobuf (`KVMessage` of kvtransfer.proto), but the hot
path does not build or parse the payload through protobuf objects, because every trip
through them copies the payload (building a message copies it in, serializing copies it
out, and each read of a parsed `bytes` field makes a fresh copy):

- `encode_layer_messages` (the sender) serializes the small header with protobuf and
  appends the payload field itself, copying the tensors once, straight into the message.
  The result is byte-identical to `KVMessage(chunk=...).SerializeToString()`.
- `encode_layer_descriptors` (the shared-memory sender) writes the payload into the
  reservation's segment (`pdserve.kvtransfer.shm`), taking its CRC-32C in the same pass
  (the C op `pdserve::copy_crc32c`), and sends the header with a descriptor
  (`KVChunk.shm`: offset, length) in place of the payload field.
- `parse_message` (the receiver's gRPC deserializer) walks the message's field tags and
  lengths, parses everything but the payload with protobuf, and returns the payload as a
  view into the received bytes. Any encoding it does not recognise as the plain one-chunk
  layout (fields repeated, other fields alongside) goes through the full protobuf parser
  instead, so every valid `KVMessage` is read with protobuf's own semantics.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from crc32c import crc32c
from google.protobuf.message import DecodeError

from pdserve.engine.kv_cache import dtype_name
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer.sink import KVCommitInfo
from pdserve.protos.pdserve.v1 import common_pb2, kvtransfer_pb2

DEFAULT_MAX_CHUNK_BYTES = 1 << 20
# copy-then-checksum granule of the shared-memory encoder without its C op: inside L2
_CACHED_PIECE_BYTES = 256 << 10

# protobuf keys (field number << 3 | wire type 2, length-delimited) of the two fields the
# fast paths write and look for: KVMessage.chunk and KVChunk.payload
_CHUNK_KEY = 1 << 3 | 2
_PAYLOAD_KEY = 8 << 3 | 2
assert kvtransfer_pb2.KVMessage.DESCRIPTOR.fields_by_name["chunk"].number == _CHUNK_KEY >> 3
assert kvtransfer_pb2.KVChunk.DESCRIPTOR.fields_by_name["payload"].number == _PAYLOAD_KEY >> 3


# torch.frombuffer warns about read-only buffers; decode_chunk's views are never written
warnings.filterwarnings("ignore", message="The given buffer is not writable",
                        category=UserWarning, module=__name__)


class KVChunkError(ValueError):
    """A chunk or commit that fails validation; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class DecodedChunk:
    layer: int  # the first layer it covers
    num_layers: int
    block_indices: list[int]
    k: torch.Tensor  # [num_layers, n, block_size, kv_heads, head_dim], a read-only view, CPU
    v: torch.Tensor  # same
    num_bytes: int  # payload bytes
    crc32c: int  # the CRC-32C the header states for the payload (checked unless asked not)


@dataclass(frozen=True)
class EncodedChunk:
    """One chunk, serialized as a whole `KVMessage`, ready for the wire."""

    data: bytes
    payload_bytes: int


@dataclass(frozen=True)
class WireMessage:
    """One received `KVMessage`, as `parse_message` returns it.

    kind is "chunk", "commit" or "abort", or None when the bytes are not a KVMessage with
    one of them set (`error` says why). For a chunk, `body` is its header: its own payload
    field is empty and the payload is `payload`, a view into the received bytes.
    """

    kind: str | None
    body: kvtransfer_pb2.KVChunk | kvtransfer_pb2.KVCommit | kvtransfer_pb2.KVAbort | None
    payload: memoryview | bytes = b""
    error: str = ""


def _as_bytes(t: torch.Tensor) -> memoryview:
    # any dtype (bfloat16 included) -> its raw bytes, without going through numpy dtypes
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def blocks_per_chunk(block_bytes: int, max_chunk_bytes: int) -> int:
    """Blocks (K and V) that fit in one chunk's payload; always at least one."""
    if max_chunk_bytes < 1:
        raise ValueError(f"max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
    return max(1, max_chunk_bytes // (2 * block_bytes))


def _layer_tensors(block_indices: Sequence[int], k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(indices as ints, k and v contiguous on the CPU) of one layer's blocks, checked."""
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"k and v must be 4-D of equal shape and dtype, got {tuple(k.shape)} {k.dtype} "
            f"and {tuple(v.shape)} {v.dtype}"
        )
    n = k.shape[0]
    indices = [int(i) for i in block_indices]
    if len(indices) != n or n == 0 or min(indices) < 0:
        raise ValueError(f"block indices {indices[:16]} do not address the {n} blocks given")
    return indices, k.detach().to("cpu").contiguous(), v.detach().to("cpu").contiguous()


def _layer_parts(
    reservation_id: str, layer: int, block_indices: Sequence[int], k: torch.Tensor,
    v: torch.Tensor, first_seq: int, max_chunk_bytes: int, checksum: bool = True,
) -> Iterator[tuple[kvtransfer_pb2.KVChunk, torch.Tensor, torch.Tensor]]:
    """(header with crc32c but no payload, K blocks, V blocks: contiguous CPU tensors) of
    each chunk of one layer; crc32c left 0 when not `checksum` (the caller computes it)."""
    indices, k, v = _layer_tensors(block_indices, k, v)
    n = len(indices)
    dtype = dtype_name(k.dtype)
    block_bytes = k[0].numel() * k.element_size()
    step = blocks_per_chunk(block_bytes, max_chunk_bytes)
    for i, start in enumerate(range(0, n, step)):
        end = min(start + step, n)
        k_part, v_part = k[start:end], v[start:end]
        header = kvtransfer_pb2.KVChunk(
            reservation_id=reservation_id,
            layer=layer,
            block_indices=indices[start:end],
            dtype=dtype,
            shape=[end - start, *k.shape[1:]],
            seq=first_seq + i,
            # of K then V
            crc32c=crc32c(_as_bytes(v_part), crc32c(_as_bytes(k_part))) if checksum else 0,
        )
        yield header, k_part, v_part


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
    """Yields the chunks of one layer's blocks as protobuf messages, numbered first_seq,
    first_seq + 1, ... (for tools and tests; the sender uses `encode_layer_messages`).

    k, v: [n, block_size, kv_heads, head_dim], same shape and dtype, any device.
    """
    for header, k_part, v_part in _layer_parts(
        reservation_id, layer, block_indices, k, v, first_seq, max_chunk_bytes
    ):
        header.payload = b"".join((_as_bytes(k_part), _as_bytes(v_part)))
        yield header


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_layer_messages(
    reservation_id: str,
    layer: int,
    block_indices: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    first_seq: int = 0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Iterator[EncodedChunk]:
    """The chunks of `encode_layer`, each serialized as a `KVMessage` (the same bytes), with
    the tensors copied once, straight into the message."""
    for header, k_part, v_part in _layer_parts(
        reservation_id, layer, block_indices, k, v, first_seq, max_chunk_bytes
    ):
        k_bytes, v_bytes = _as_bytes(k_part), _as_bytes(v_part)
        head = header.SerializeToString()
        size = k_bytes.nbytes + v_bytes.nbytes
        # protobuf writes fields in number order, so the payload (field 8) goes last
        payload_key = bytes((_PAYLOAD_KEY,)) + _varint_bytes(size)
        body_len = len(head) + len(payload_key) + size
        data = b"".join((bytes((_CHUNK_KEY,)), _varint_bytes(body_len), head, payload_key,
                         k_bytes, v_bytes))
        yield EncodedChunk(data, size)


def encode_layer_descriptors(
    reservation_id: str,
    layer: int,
    block_indices: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    segment: memoryview,
    *,
    offset: int,
    first_seq: int = 0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Iterator[EncodedChunk]:
    """The chunks of `encode_layer` for the shared-memory transport: each payload is
    copied into `segment` (packed from `offset`, chunk after chunk) and the message carries
    its descriptor (`KVChunk.shm`: offset, length) instead of the payload. Header and
    CRC-32C are those of `encode_layer`. Raises ValueError when the segment is too small.

    Each K or V part is copied into the segment by one C call that takes its CRC-32C in the
    same pass (`pdserve::copy_crc32c`), continuing the chunk's running CRC: one trip
    through memory instead of two (`_copy_with_crc32c`)."""
    for header, k_part, v_part in _layer_parts(
        reservation_id, layer, block_indices, k, v, first_seq, max_chunk_bytes,
        checksum=False,
    ):
        chunk = _descriptor_chunk(header, (k_part, v_part), segment, offset)
        yield chunk
        offset += chunk.payload_bytes


def encode_layers_descriptor(
    reservation_id: str,
    first_layer: int,
    block_indices: Sequence[int],
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    segment: memoryview,
    *,
    offset: int,
    seq: int,
) -> EncodedChunk:
    """Whole layers `first_layer`, `first_layer + 1`, ... as one shared-memory chunk: each
    layer's (k, v), `[n, ...]` of the same blocks, copied into `segment` from `offset`,
    K then V, layer after layer, with one CRC-32C over all of it. For the sender that finds
    several layers ready at once; the caller keeps the payload within its chunk size."""
    if not layers:
        raise ValueError("no layers to encode")
    parts: list[torch.Tensor] = []
    indices: list[int] = []
    for k, v in layers:
        indices, k, v = _layer_tensors(block_indices, k, v)
        if parts and (k.shape != parts[0].shape or k.dtype != parts[0].dtype):
            raise ValueError(f"layers differ: {tuple(k.shape)} {k.dtype} after "
                             f"{tuple(parts[0].shape)} {parts[0].dtype}")
        parts += (k, v)
    header = kvtransfer_pb2.KVChunk(
        reservation_id=reservation_id, layer=first_layer, block_indices=indices,
        dtype=dtype_name(parts[0].dtype), shape=list(parts[0].shape), seq=seq)
    if len(layers) > 1:  # one layer's header stays byte-identical to encode_layer's
        header.num_layers = len(layers)
    return _descriptor_chunk(header, parts, segment, offset)


def _descriptor_chunk(header: kvtransfer_pb2.KVChunk, parts: Sequence[torch.Tensor],
                      segment: memoryview, offset: int) -> EncodedChunk:
    """`parts` copied into `segment` back to back from `offset` with their CRC-32C, and the
    message carrying `header` with that CRC and the descriptor. Raises ValueError when the
    segment is too small."""
    end = offset + sum(_nbytes(p) for p in parts)
    if end > segment.nbytes:
        raise ValueError(f"shm segment of {segment.nbytes} bytes is full at {offset}")
    crc, at = 0, offset
    op = _copy_crc32c_op()
    for part in parts:
        crc = _copy_with_crc32c(segment, at, part, crc, op)
        at += _nbytes(part)
    header.crc32c = crc
    header.shm.offset = offset
    header.shm.length = end - offset
    return EncodedChunk(kvtransfer_pb2.KVMessage(chunk=header).SerializeToString(),
                        end - offset)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@functools.cache
def _copy_crc32c_op() -> Callable[..., int] | None:
    """The C copy + CRC-32C op, loaded on first use; None (warned once) when it cannot be."""
    from pdserve.engine.cpu_kernels.library import op_or_none

    return op_or_none("crc_copy", "copy_crc32c", "KV shm sender: the C copy with CRC-32C",
                      "payloads are copied and checksummed in 256 KiB pieces")


def _copy_with_crc32c(segment: memoryview, at: int, part: torch.Tensor, crc: int,
                      op: Callable[..., int] | None) -> int:
    """segment[at:at + part's size] = part's bytes; returns their CRC-32C continued from
    crc. op: `pdserve::copy_crc32c`, or None for pieces copied and then checksummed while
    they are still in the CPU cache."""
    n = _nbytes(part)
    if n == 0:
        return crc
    if op is not None:
        # a tensor over exactly these bytes, gone on return: a live one would keep the
        # stream from releasing its view of the segment
        return op(torch.frombuffer(segment, dtype=torch.uint8, count=n, offset=at), part, crc)
    src = _as_bytes(part)
    for start in range(0, n, _CACHED_PIECE_BYTES):
        piece = src[start:start + _CACHED_PIECE_BYTES]
        segment[at:at + piece.nbytes] = piece
        crc = crc32c(segment[at:at + piece.nbytes], crc)
        at += piece.nbytes
    return crc


class _NotPlain(Exception):
    """The message is not the plain one-chunk layout: parse it with protobuf instead."""


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _NotPlain


def _split_plain_chunk(raw: bytes) -> tuple[bytes, int, int]:
    """(chunk header bytes without the payload field, payload start, payload end) of a
    message that is exactly one `chunk` field whose payload field occurs exactly once."""
    end = len(raw)
    if end < 2 or raw[0] != _CHUNK_KEY:
        raise _NotPlain
    size, start = _read_varint(raw, 1, end)
    if start + size != end:
        raise _NotPlain  # other KVMessage fields follow the chunk
    pos, span = start, None
    while pos < end:
        field_at = pos
        key, pos = _read_varint(raw, pos, end)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(raw, pos, end)
        elif wire_type == 2:
            n, pos = _read_varint(raw, pos, end)
            if key == _PAYLOAD_KEY:
                if span is not None:
                    raise _NotPlain
                span = (field_at, pos, pos + n)
            pos += n
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise _NotPlain
    if pos != end or span is None:
        raise _NotPlain
    field_at, payload_start, payload_end = span
    return raw[start:field_at] + raw[payload_end:end], payload_start, payload_end


def parse_message(raw: bytes) -> WireMessage:
    """The receiver's gRPC request deserializer: never raises (a message that does not
    parse comes back with kind None and the reason, so the stream can be refused with
    INVALID_ARGUMENT and its reservation freed)."""
    try:
        header, payload_start, payload_end = _split_plain_chunk(raw)
    except _NotPlain:
        pass
    else:
        try:
            chunk = kvtransfer_pb2.KVChunk.FromString(header)
        except DecodeError as e:
            return WireMessage(None, None, error=f"malformed KVChunk: {e}")
        return WireMessage("chunk", chunk, memoryview(raw)[payload_start:payload_end])
    try:
        msg = kvtransfer_pb2.KVMessage.FromString(raw)
    except DecodeError as e:
        return WireMessage(None, None, error=f"malformed KVMessage: {e}")
    kind = msg.WhichOneof("msg")
    if kind is None:
        return WireMessage(None, None, error="empty KVMessage")
    body = getattr(msg, kind)
    if kind == "chunk":
        payload = body.payload  # one read: each read of a bytes field copies it
        body.ClearField("payload")
        return WireMessage(kind, body, payload)
    return WireMessage(kind, body)


def decode_chunk(
    chunk: kvtransfer_pb2.KVChunk, spec: KVCacheSpec, num_reserved_blocks: int,
    payload: memoryview | bytes | None = None, *, check_crc32c: bool = True,
) -> DecodedChunk:
    """Checks every header field and the payload, then returns the K and V tensors.

    payload: the chunk's payload when it was kept apart from the header (as
    `parse_message` does); None to use `chunk.payload`. check_crc32c=False leaves the
    payload's checksum to the caller (the receiver's sink takes it while copying the
    bytes into the cache); every other check still runs. Raises KVChunkError naming the
    first field that is wrong. reservation_id and seq are stream-level facts and are
    checked by the receiver.
    """
    if not 0 <= chunk.layer < spec.num_layers:
        raise KVChunkError("layer", f"{chunk.layer} not in [0, {spec.num_layers})")
    num_layers = chunk.num_layers or 1
    if chunk.layer + num_layers > spec.num_layers:
        raise KVChunkError("num_layers", f"layers {chunk.layer}..{chunk.layer + num_layers - 1}"
                                         f" not all in [0, {spec.num_layers})")
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
    if max(indices) >= num_reserved_blocks:  # uint32 on the wire: never negative
        bad = [i for i in indices if i >= num_reserved_blocks]
        raise KVChunkError(
            "block_indices", f"{bad[:8]} outside the reservation's {num_reserved_blocks} blocks"
        )
    if len(set(indices)) != n:
        raise KVChunkError("block_indices", f"duplicate indices in {indices[:16]}")
    if payload is None:
        payload = chunk.payload  # read once: each read of a bytes field copies it
    size = len(payload) if isinstance(payload, bytes) else payload.nbytes
    expected = 2 * n * spec.block_bytes * num_layers
    if size != expected:
        raise KVChunkError("payload", f"{size} bytes, expected {expected}")
    if check_crc32c and crc32c(payload) != chunk.crc32c:
        raise KVChunkError("crc32c", "payload checksum mismatch")
    # A read-only view of the payload, no copy: the sink copies it into the cache (its
    # only use), so torch's warning about a non-writable buffer does not apply (silenced
    # for this module at import: a catch_warnings block per chunk costs more than the rest
    # of this function)
    kv = torch.frombuffer(payload, dtype=spec.torch_dtype).view(num_layers, 2, *shape)
    return DecodedChunk(chunk.layer, num_layers, indices, kv[:, 0], kv[:, 1], size,
                        chunk.crc32c)


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
