"""KV transfer: the wire format alone, then real grpc.aio receivers on 127.0.0.1 fed by the
gRPC sender or by hand-made messages, writing into an InMemoryKVSink."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import pytest
import torch
from crc32c import crc32c

from pdserve.engine.kv_blocks import copy_blocks, gather_blocks
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer import KVChunkError, KVCommitInfo, KVTransferError
from pdserve.kvtransfer.grpc_sender import GrpcKVTransport
from pdserve.kvtransfer.malloc_tuning import keep_freed_memory
from pdserve.kvtransfer.memory_sink import InMemoryKVSink
from pdserve.kvtransfer.receiver import KVTransferService
from pdserve.kvtransfer.shm import ShmSegmentPool
from pdserve.kvtransfer.sink import KVSink
from pdserve.kvtransfer.wire import (
    WireMessage,
    commit_from_proto,
    commit_to_proto,
    decode_chunk,
    encode_layer,
    encode_layer_messages,
    parse_message,
)
from pdserve.protos.pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

T = TypeVar("T")

SPEC = KVCacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
BLOCK_BYTES = SPEC.block_bytes  # 4*2*8*4 = 256


def _blocks(n: int, spec: KVCacheSpec = SPEC, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, *spec.block_shape)
    k = torch.randn(shape, generator=g).to(spec.torch_dtype)
    v = torch.randn(shape, generator=g).to(spec.torch_dtype)
    return k, v


# -- wire ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_wire_round_trip_multi_chunk(dtype: str) -> None:
    spec = KVCacheSpec(2, 8, 4, 2, 8, dtype)
    k, v = _blocks(5, spec)
    # 2 block pairs per chunk -> chunks of 2, 2, 1 blocks
    chunks = list(encode_layer("r", 1, [4, 3, 2, 1, 0], k, v, first_seq=7,
                               max_chunk_bytes=4 * spec.block_bytes))
    assert [list(c.block_indices) for c in chunks] == [[4, 3], [2, 1], [0]]
    assert [c.seq for c in chunks] == [7, 8, 9]
    assert all(c.dtype == dtype and c.crc32c == crc32c(c.payload) for c in chunks)
    decoded = [decode_chunk(c, spec, num_reserved_blocks=5) for c in chunks]
    assert all(d.num_layers == 1 for d in decoded)
    assert torch.equal(torch.cat([d.k[0] for d in decoded]), k)
    assert torch.equal(torch.cat([d.v[0] for d in decoded]), v)
    assert decoded[0].k.dtype == spec.torch_dtype


def test_wire_payload_is_k_then_v() -> None:
    k, v = _blocks(1)
    (chunk,) = encode_layer("r", 0, [0], k, v)
    assert chunk.payload == k.numpy().tobytes() + v.numpy().tobytes()
    assert list(chunk.shape) == [1, 4, 2, 8]


def test_wire_at_least_one_block_per_chunk() -> None:
    k, v = _blocks(3)
    chunks = list(encode_layer("r", 0, [0, 1, 2], k, v, max_chunk_bytes=1))
    assert [len(c.block_indices) for c in chunks] == [1, 1, 1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_chunk_bytes", [1, 4 * 256, 1 << 20])
def test_encoded_messages_are_plain_protobuf(dtype: str, max_chunk_bytes: int) -> None:
    """The sender's hand-assembled bytes equal protobuf's own serialization."""
    spec = KVCacheSpec(2, 8, 4, 2, 8, dtype)
    k, v = _blocks(5, spec)
    # seq 200+ and payloads over 127 bytes: multi-byte varints in the keys and lengths
    args = ("r" * 40, 1, [4, 3, 2, 1, 0], k, v)
    kw = {"first_seq": 200, "max_chunk_bytes": max_chunk_bytes}
    fast = list(encode_layer_messages(*args, **kw))
    ref = [kvtransfer_pb2.KVMessage(chunk=c) for c in encode_layer(*args, **kw)]
    assert [m.data for m in fast] == [m.SerializeToString() for m in ref]
    assert [m.payload_bytes for m in fast] == [len(m.chunk.payload) for m in ref]


def test_parse_message_leaves_payload_in_place() -> None:
    k, v = _blocks(3)
    (msg,) = encode_layer_messages("r", 2, [0, 1, 2], k, v, first_seq=4)
    raw = msg.data
    parsed = parse_message(raw)
    assert parsed.kind == "chunk" and parsed.error == ""
    assert isinstance(parsed.payload, memoryview) and parsed.payload.obj is raw  # no copy
    assert bytes(parsed.payload) == k.numpy().tobytes() + v.numpy().tobytes()
    header = parsed.body
    assert (header.layer, list(header.block_indices), header.seq) == (2, [0, 1, 2], 4)
    assert header.payload == b""
    decoded = decode_chunk(header, SPEC, 3, parsed.payload)
    assert torch.equal(decoded.k[0], k) and torch.equal(decoded.v[0], v)
    # K starts where the payload starts inside the received bytes: nothing was copied
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: only its address
        raw_at = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
    assert decoded.k.data_ptr() == raw_at + len(raw) - 2 * 3 * BLOCK_BYTES


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (lengths < 128 only)."""
    assert len(payload) < 128
    return bytes((number << 3 | 2, len(payload))) + payload


@pytest.mark.parametrize("layout", ["payload_first", "payload_twice", "chunk_twice"])
def test_parse_message_any_valid_layout(layout: str) -> None:
    """Encodings other than protobuf's own canonical one parse with protobuf's semantics
    (a repeated scalar field: the last wins; a repeated message field: merged)."""
    k, v = _blocks(1, KVCacheSpec(3, 16, 1, 1, 2))  # 8-byte K and V
    chunk = next(encode_layer("r", 1, [0], k, v))
    payload = chunk.payload
    header = kvtransfer_pb2.KVChunk()
    header.CopyFrom(chunk)
    header.ClearField("payload")
    head = header.SerializeToString()
    if layout == "payload_first":
        raw = _field(1, _field(8, payload) + head)
    elif layout == "payload_twice":
        raw = _field(1, head + _field(8, b"\0" * 16) + _field(8, payload))
    else:  # the payload in a second occurrence of the chunk field
        raw = _field(1, head) + _field(1, _field(8, payload))
    assert kvtransfer_pb2.KVMessage.FromString(raw).chunk == chunk  # protobuf agrees
    parsed = parse_message(raw)
    assert parsed.kind == "chunk"
    assert bytes(parsed.payload) == payload
    assert parsed.body.crc32c == chunk.crc32c and list(parsed.body.shape) == list(chunk.shape)


def test_parse_message_other_kinds_and_garbage() -> None:
    info = KVCommitInfo(num_prompt_tokens=3, first_token_id=7)
    commit = kvtransfer_pb2.KVMessage(commit=commit_to_proto("r", 2, info))
    parsed = parse_message(commit.SerializeToString())
    assert parsed.kind == "commit" and commit_from_proto(parsed.body) == info
    abort = kvtransfer_pb2.KVMessage(abort=kvtransfer_pb2.KVAbort(reservation_id="r"))
    assert parse_message(abort.SerializeToString()).kind == "abort"
    assert parse_message(b"") == WireMessage(None, None, error="empty KVMessage")
    k, v = _blocks(1)
    (msg,) = encode_layer_messages("r", 0, [0], k, v)
    for raw in (msg.data[:-100], b"\xff\xff\xff", msg.data[:3]):  # truncated, not protobuf
        bad = parse_message(raw)
        assert bad.kind is None and bad.error.startswith("malformed"), bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "block_ids", [[3, 4, 5, 6], [9, 8, 7, 6], [7, 1, 12, 4, 9, 0, 15, 3, 11, 5], [5], []]
)
def test_copy_and_gather_blocks(block_ids: list[int], dtype: torch.dtype) -> None:
    dst = torch.randn(16, 4, 2, 8).to(dtype)
    src = torch.randn(len(block_ids), 4, 2, 8).to(dtype)
    want = dst.clone()
    for i, b in enumerate(block_ids):
        want[b] = src[i]
    copy_blocks(dst, block_ids, src)
    assert torch.equal(dst, want)
    got = gather_blocks(dst, block_ids)
    assert got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, dst[torch.tensor(block_ids, dtype=torch.long)])
    assert got.data_ptr() != dst.data_ptr() or not block_ids  # a copy


def test_copy_blocks_into_a_strided_view() -> None:
    """A destination numpy cannot view (not contiguous) goes through torch's own ops."""
    base = torch.zeros(16, 3, 2)
    dst = base[:, :, 0]  # [16, 3], stride 2
    src = torch.randn(3, 3)
    copy_blocks(dst, [9, 2, 5], src)
    assert torch.equal(base[[9, 2, 5], :, 0], src) and not base[:, :, 1].any()
    assert torch.equal(gather_blocks(dst, [5, 9]), src[[2, 0]])


def test_copy_blocks_refuses_bad_ids_and_shapes() -> None:
    dst = torch.zeros(4, 2, 3)
    with pytest.raises(IndexError):
        copy_blocks(dst, [-1], torch.ones(1, 2, 3))  # numpy would write block 3
    with pytest.raises(IndexError):
        gather_blocks(dst, [4])
    with pytest.raises(ValueError):
        copy_blocks(dst, [0], torch.ones(1, 2, 3, dtype=torch.float64))
    assert not dst.any()


def test_keep_freed_memory_is_idempotent() -> None:
    first = keep_freed_memory()
    assert keep_freed_memory() == first
    assert isinstance(first, bool)


def _chunk(**changes: object) -> kvtransfer_pb2.KVChunk:
    k, v = _blocks(2)
    (chunk,) = encode_layer("r", 1, [0, 1], k, v)
    for name, value in changes.items():
        if isinstance(value, list):
            getattr(chunk, name)[:] = value
        else:
            setattr(chunk, name, value)
    return chunk


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"layer": 3}, "layer"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"shape": [2, 4, 2, 4]}, "shape"),
        ({"shape": [2, 4, 2]}, "shape"),
        ({"block_indices": [0]}, "block_indices"),
        ({"block_indices": [0, 2]}, "block_indices"),
        ({"block_indices": [1, 1]}, "block_indices"),
        ({"payload": b"\0" * 10}, "payload"),
        ({"crc32c": 12345}, "crc32c"),
        ({"num_layers": 3}, "num_layers"),  # layers 1..3 of 3
        ({"num_layers": 2}, "payload"),  # one layer's bytes for two
    ],
)
def test_wire_rejects(changes: dict[str, object], field: str) -> None:
    with pytest.raises(KVChunkError) as err:
        decode_chunk(_chunk(**changes), SPEC, num_reserved_blocks=2)
    assert err.value.field == field


def test_commit_round_trip() -> None:
    info = KVCommitInfo(num_prompt_tokens=9, first_token_id=42, first_token_logprob=-0.5,
                        first_token_top_logprobs=((42, -0.5), (7, -1.5)), num_cached_tokens=4,
                        queue_s=0.1, compute_s=0.2, transfer_s=0.3)
    assert commit_from_proto(commit_to_proto("r", 5, info)) == info
    plain = KVCommitInfo(num_prompt_tokens=1, first_token_id=0)
    assert commit_from_proto(commit_to_proto("r", 1, plain)) == plain


def test_in_memory_sink_is_a_kv_sink() -> None:
    assert isinstance(InMemoryKVSink(SPEC), KVSink)


# -- gRPC: a real receiver on loopback -------------------------------------------------


class Receiver:
    """A grpc.aio server with KVTransferService over an InMemoryKVSink, on its own loop."""

    def __init__(self, spec: KVCacheSpec, shm: ShmSegmentPool | None = None) -> None:
        self.sink = InMemoryKVSink(spec)
        self.service = KVTransferService(self.sink, shm)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server, port = self._run(self._start())
        self.address = f"127.0.0.1:{port}"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        # the decode worker's limit (pdserve.worker_runtime.MAX_MESSAGE_BYTES)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        self.service.add_to_server(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def close(self) -> None:
        self._run(self._server.stop(None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(SPEC)
    yield r
    r.close()


@pytest.fixture
def receiver_big() -> Iterator[Receiver]:
    """SmolLM2-135M's layout (float32, 16-token blocks, 3 KV heads of 64), 2 layers."""
    r = Receiver(KVCacheSpec(num_layers=2, num_blocks=256, block_size=16, num_kv_heads=3,
                             head_dim=64))
    yield r
    r.close()


@pytest.fixture
def transport() -> Iterator[GrpcKVTransport]:
    t = GrpcKVTransport(max_chunk_bytes=3 * BLOCK_BYTES, timeout_s=30)  # 1 block pair/chunk
    yield t
    t.close()


def _fill_other_blocks(sink: InMemoryKVSink) -> torch.Tensor:
    """Random bytes in the whole cache; returns a copy to compare against later."""
    sink.cache.data.copy_(torch.randn(sink.cache.data.shape))
    return sink.cache.data.clone()


def _same_bytes_outside(sink: InMemoryKVSink, before: torch.Tensor, blocks: list[int]) -> bool:
    """The cache outside `blocks` is byte-identical to `before`."""
    keep = [b for b in range(sink.kv_spec.num_blocks) if b not in blocks]
    now, then = sink.cache.data[:, :, keep], before[:, :, keep]
    return torch.equal(now.view(torch.uint8), then.view(torch.uint8))


def test_push_round_trip(receiver: Receiver, transport: GrpcKVTransport) -> None:
    sink = receiver.sink
    other = sink.reserve(3)  # so the transfer's physical blocks are not 0..n-1
    rid = sink.reserve(4)
    phys = sink.block_table(rid)
    assert phys == [3, 4, 5, 6]
    before = _fill_other_blocks(sink)

    stream = transport.open(receiver.address, rid, SPEC)
    sent = {}
    order = [2, 0, 3, 1]
    for layer in range(SPEC.num_layers):
        k, v = _blocks(4, seed=layer)
        sent[layer] = (k, v)
        stream.push_layer(layer, order, k, v)
    info = KVCommitInfo(num_prompt_tokens=14, first_token_id=5, first_token_logprob=-0.25)
    result = stream.commit(info)

    assert result.num_chunks == 4 * SPEC.num_layers
    assert result.bytes_sent == 2 * 4 * SPEC.num_layers * BLOCK_BYTES
    assert result.push_s > 0
    assert sink.commits[rid] == info
    for layer, (k, v) in sent.items():
        for i, logical in enumerate(order):
            assert torch.equal(sink.cache.key(layer)[phys[logical]], k[i])
            assert torch.equal(sink.cache.value(layer)[phys[logical]], v[i])
    assert _same_bytes_outside(sink, before, phys)
    assert receiver.service.num_committed == 1
    # a committed reservation accepts no more KV
    assert sink.reservation_num_blocks(rid) is None
    sink.release(rid)
    sink.abort_kv(other, "test done")
    assert sink.num_free_blocks == SPEC.num_blocks


def _push_raw(address: str, messages: list[kvtransfer_pb2.KVMessage]) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        stub = kvtransfer_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(iter(messages), timeout=30)
    return err.value


def _layer_messages(rid: str, layers: range, n: int, seq: int = 0,
                    max_chunk_bytes: int = 1 << 20) -> list[kvtransfer_pb2.KVMessage]:
    out = []
    for layer in layers:
        k, v = _blocks(n, seed=layer)
        for chunk in encode_layer(rid, layer, range(n), k, v, first_seq=seq,
                                  max_chunk_bytes=max_chunk_bytes):
            out.append(kvtransfer_pb2.KVMessage(chunk=chunk))
            seq += 1
    return out


def _commit_message(rid: str, num_chunks: int, tokens: int) -> kvtransfer_pb2.KVMessage:
    info = KVCommitInfo(num_prompt_tokens=tokens, first_token_id=1)
    return kvtransfer_pb2.KVMessage(commit=commit_to_proto(rid, num_chunks, info))


def _assert_rejected(receiver: Receiver, rid: str, phys: list[int], before: torch.Tensor,
                     err: grpc.RpcError, code: grpc.StatusCode, field: str) -> None:
    assert err.code() == code, err.details()
    assert err.details().startswith(field), err.details()
    sink = receiver.sink
    assert rid in sink.aborts and rid not in sink.commits
    assert sink.reservation_num_blocks(rid) is None
    assert sink.num_free_blocks == SPEC.num_blocks  # the reservation's blocks are back
    assert _same_bytes_outside(sink, before, phys)


def test_corrupted_payload_rejected(receiver: Receiver) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    messages = _layer_messages(rid, range(3), 2, max_chunk_bytes=2 * BLOCK_BYTES)
    bad = bytearray(messages[3].chunk.payload)
    bad[100] ^= 0x01
    messages[3].chunk.payload = bytes(bad)
    messages.append(_commit_message(rid, len(messages), 8))
    err = _push_raw(receiver.address, messages)
    # refused and aborted, blocks freed, nothing outside the reservation touched (its own
    # blocks may hold the bad chunk: it was checked as it was copied; nothing reads them)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, "crc32c")
    assert err.details() == "crc32c: chunk 3: payload checksum mismatch"
    assert receiver.service.bytes_received == 3 * 2 * BLOCK_BYTES  # chunks 0-2 only


def test_wrong_dtype_rejected(receiver: Receiver) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    bf16 = KVCacheSpec(3, 16, 4, 2, 8, "bfloat16")
    k, v = _blocks(2, bf16)
    msgs = [kvtransfer_pb2.KVMessage(chunk=c) for c in encode_layer(rid, 0, [0, 1], k, v)]
    err = _push_raw(receiver.address, msgs)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, "dtype")


def test_block_index_outside_reservation_rejected(receiver: Receiver) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    messages = _layer_messages(rid, range(1), 2)
    messages[0].chunk.block_indices[:] = [0, 2]  # 2 is the next reservation's block
    err = _push_raw(receiver.address, messages)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT,
                     "block_indices")


def test_unknown_reservation_not_found(receiver: Receiver) -> None:
    sink = receiver.sink
    before = _fill_other_blocks(sink)
    err = _push_raw(receiver.address, _layer_messages("nope", range(1), 1))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert torch.equal(sink.cache.data, before)


def test_commit_with_missing_layers_rejected(receiver: Receiver) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    messages = _layer_messages(rid, range(2), 2)  # layer 2 never sent
    messages.append(_commit_message(rid, len(messages), 8))
    err = _push_raw(receiver.address, messages)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT,
                     "commit")
    assert "layer 2" in err.details()


@pytest.mark.parametrize(
    ("tokens", "num_chunks", "field"), [(8, 99, "num_chunks"), (4, None, "num_prompt_tokens")]
)
def test_commit_header_checked(receiver: Receiver, tokens: int, num_chunks: int | None,
                               field: str) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    messages = _layer_messages(rid, range(3), 2)
    messages.append(_commit_message(rid, num_chunks or len(messages), tokens))
    err = _push_raw(receiver.address, messages)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, field)


def test_out_of_order_seq_rejected(receiver: Receiver) -> None:
    rid = receiver.sink.reserve(2)
    phys = receiver.sink.block_table(rid)
    before = _fill_other_blocks(receiver.sink)
    messages = _layer_messages(rid, range(2), 2)
    messages[0], messages[1] = messages[1], messages[0]
    err = _push_raw(receiver.address, messages)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, "seq")


def test_stream_without_commit_aborts(receiver: Receiver) -> None:
    rid = receiver.sink.reserve(1)
    phys = receiver.sink.block_table(rid)
    before = _fill_other_blocks(receiver.sink)
    err = _push_raw(receiver.address, _layer_messages(rid, range(3), 1))
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT,
                     "commit")


def _push_bytes(address: str, messages: list[bytes]) -> grpc.RpcError:
    """Pushes hand-made bytes, as a sender with its own encoder would."""
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary("/pdserve.v1.KVTransfer/Push", request_serializer=None,
                                    response_deserializer=kvtransfer_pb2.PushAck.FromString)
        with pytest.raises(grpc.RpcError) as err:
            push(iter(messages), timeout=30)
    return err.value


def test_corrupted_fast_path_chunk_rejected(receiver: Receiver) -> None:
    """A bit flipped in a payload the receiver reads in place: refused, the reservation
    aborted, no block outside it touched."""
    sink = receiver.sink
    rid = sink.reserve(2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    messages = []
    for layer in range(3):
        k, v = _blocks(2, seed=layer)
        messages += [bytearray(m.data) for m in encode_layer_messages(
            rid, layer, [0, 1], k, v, first_seq=layer)]
    messages[2][-1] ^= 0x80  # the last byte of layer 2's V
    err = _push_bytes(receiver.address, [bytes(m) for m in messages])
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, "crc32c")
    assert receiver.service.bytes_received == 2 * 2 * 2 * BLOCK_BYTES  # layers 0 and 1 only


def test_malformed_message_rejected(receiver: Receiver) -> None:
    """Bytes that are not a KVMessage end the stream with INVALID_ARGUMENT (not a gRPC
    deserialization failure) and free the reservation."""
    sink = receiver.sink
    rid = sink.reserve(2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    k, v = _blocks(2)
    (first,) = encode_layer_messages(rid, 0, [0, 1], k, v)
    err = _push_bytes(receiver.address, [first.data, first.data[:-7]])
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, "msg")


def test_push_4_mib_chunks_of_a_real_layout(receiver_big: Receiver) -> None:
    """SmolLM2's block layout in 4 MiB chunks: 4 MiB of payload plus its header is over
    gRPC's default 4 MiB receive limit, which the decode worker raises (MAX_MESSAGE_BYTES)
    as this receiver does."""
    sink = receiver_big.sink
    spec = sink.kv_spec
    rid = sink.reserve(200)
    t = GrpcKVTransport(max_chunk_bytes=4 << 20, timeout_s=60)
    try:
        stream = t.open(receiver_big.address, rid, spec)
        k, v = _blocks(200, spec, seed=3)
        for layer in range(spec.num_layers):
            stream.push_layer(layer, list(range(200)), k, v)
        result = stream.commit(KVCommitInfo(num_prompt_tokens=200 * 16, first_token_id=1))
    finally:
        t.close()
    assert result.bytes_sent == spec.num_layers * 2 * 200 * spec.block_bytes
    phys = sink.block_table(rid)
    assert torch.equal(sink.cache.value(spec.num_layers - 1)[phys], v)


def test_sender_reports_status_code(receiver: Receiver, transport: GrpcKVTransport) -> None:
    stream = transport.open(receiver.address, "missing", SPEC)
    k, v = _blocks(1)
    stream.push_layer(0, [0], k, v)
    with pytest.raises(KVTransferError) as err:
        stream.commit(KVCommitInfo(num_prompt_tokens=1, first_token_id=0))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert stream.failed


def test_sender_abort_frees_reservation(receiver: Receiver, transport: GrpcKVTransport) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    stream = transport.open(receiver.address, rid, SPEC)
    k, v = _blocks(2)
    stream.push_layer(0, [0, 1], k, v)
    stream.abort("prefill failed")  # returns at once: the receiver answers meanwhile
    end = time.monotonic() + 10
    while rid not in sink.aborts and time.monotonic() < end:
        time.sleep(0.01)
    assert sink.aborts[rid].startswith("CANCELLED: sender aborted: prefill failed")
    assert sink.num_free_blocks == SPEC.num_blocks
    stream.abort("again")  # idempotent


def test_sender_validates_inputs(receiver: Receiver, transport: GrpcKVTransport) -> None:
    rid = receiver.sink.reserve(1)
    stream = transport.open(receiver.address, rid, SPEC)
    k, v = _blocks(1)
    with pytest.raises(ValueError, match="layer"):
        stream.push_layer(3, [0], k, v)
    with pytest.raises(ValueError, match="k_blocks"):
        stream.push_layer(0, [0], k.to(torch.float16), v)
    with pytest.raises(ValueError, match="v_blocks"):
        stream.push_layer(0, [0, 1], *_blocks(2)[:1], v)
    stream.abort("test done")


def test_concurrent_streams_share_a_channel(receiver: Receiver,
                                            transport: GrpcKVTransport) -> None:
    sink = receiver.sink
    rids = [sink.reserve(2) for _ in range(4)]
    streams = [transport.open(receiver.address, rid, SPEC) for rid in rids]
    for layer in range(SPEC.num_layers):
        for i, stream in enumerate(streams):
            k, v = _blocks(2, seed=10 * i + layer)
            stream.push_layer(layer, [0, 1], k, v)
    for stream in streams:
        stream.commit(KVCommitInfo(num_prompt_tokens=5, first_token_id=3))
    assert set(sink.commits) == set(rids)
    assert len(transport._channels) == 1
    for i, rid in enumerate(rids):
        phys = sink.block_table(rid)
        k, _ = _blocks(2, seed=10 * i + 2)
        assert torch.equal(sink.cache.key(2)[phys], k)
        sink.release(rid)
    assert sink.num_free_blocks == SPEC.num_blocks


class _HeldStream:
    """A raw Push call that sends `first`, then waits for `release()` before `rest`."""

    def __init__(self, address: str, first: list[kvtransfer_pb2.KVMessage],
                 rest: list[kvtransfer_pb2.KVMessage]) -> None:
        self._gate = threading.Event()
        self.sent_first = threading.Event()
        self._channel = grpc.insecure_channel(address)
        stub = kvtransfer_pb2_grpc.KVTransferStub(self._channel)

        def requests() -> Iterator[kvtransfer_pb2.KVMessage]:
            yield from first
            self.sent_first.set()
            self._gate.wait(timeout=30)
            yield from rest

        self.future = stub.Push.future(requests(), timeout=30)
        assert self.sent_first.wait(timeout=30)

    def release(self) -> None:
        self._gate.set()

    def close(self) -> None:
        self._gate.set()
        self._channel.close()


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_cancelled_push_frees_reservation(receiver: Receiver) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    messages = _layer_messages(rid, range(3), 2)
    held = _HeldStream(receiver.address, messages[:1], messages[1:])
    _wait_for(lambda: receiver.service.bytes_received > 0)
    held.future.cancel()
    _wait_for(lambda: rid in sink.aborts)
    assert sink.num_free_blocks == SPEC.num_blocks
    held.close()


def test_reservation_expiring_mid_push(receiver: Receiver) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    messages = _layer_messages(rid, range(3), 2)
    held = _HeldStream(receiver.address, messages[:1], messages[1:])
    _wait_for(lambda: receiver.service.bytes_received > 0)
    sink.abort_kv(rid, "expired")  # what the decode worker does on its reservation timeout
    held.release()
    with pytest.raises(grpc.RpcError) as err:
        held.future.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert sink.aborts[rid] == "expired"
    held.close()


def test_second_stream_for_a_reservation_refused(receiver: Receiver) -> None:
    sink = receiver.sink
    rid = sink.reserve(2)
    messages = _layer_messages(rid, range(3), 2)
    held = _HeldStream(receiver.address, messages[:1], [*messages[1:],
                                                          _commit_message(rid, 3, 8)])
    _wait_for(lambda: receiver.service.bytes_received > 0)
    err = _push_raw(receiver.address, messages)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    held.release()  # the first stream is unaffected and commits
    assert held.future.result(timeout=30).num_chunks == 3
    assert rid in sink.commits
    held.close()
