"""Same-host shared-memory KV transport: the byte-exact tests of the gRPC transport
(tests/test_kvtransfer.py) with payloads in a /dev/shm segment and descriptors on a real
grpc.aio receiver on 127.0.0.1; then the segments' life cycle (reuse after a commit,
unlinked on every other end, none left in /dev/shm) and the fallback to gRPC payloads."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from conftest import tiny_engine
from test_kvtransfer import (
    BLOCK_BYTES,
    SPEC,
    Receiver,
    _assert_rejected,
    _blocks,
    _commit_message,
    _fill_other_blocks,
    _HeldStream,
    _push_bytes,
    _same_bytes_outside,
    _wait_for,
)

from pdserve.decode_worker.server import DecodeWorker
from pdserve.kvtransfer import KVCommitInfo, KVTransferError
from pdserve.kvtransfer.shm import (
    SHM_DIR,
    ShmOffer,
    ShmSegment,
    ShmSegmentPool,
    offer_from_proto,
    offer_to_proto,
    sweep_stale,
)
from pdserve.kvtransfer.shm_sender import ShmKVTransport
from pdserve.kvtransfer.wire import (
    decode_chunk,
    encode_layer_descriptors,
    encode_layer_messages,
    encode_layers_descriptor,
)
from pdserve.prefill_worker.server import PrefillWorker
from pdserve.protocol import SamplingParams
from pdserve.protos.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.worker_runtime import WorkerConfig

HOST = "host-a"
RESERVATION_BYTES = SPEC.num_layers * 2 * BLOCK_BYTES  # per reserved block


def _own_segments() -> set[str]:
    """Segments this test process created, as they exist in /dev/shm now."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"pdserve-kv-{os.getpid()}-")}


@pytest.fixture
def pool() -> Iterator[ShmSegmentPool]:
    # workers of other test modules in this process may hold segments of their own
    before = _own_segments()
    p = ShmSegmentPool(HOST, capacity_bytes=64 << 20)
    yield p
    p.close()
    assert _own_segments() <= before  # nothing of this test's left in /dev/shm


@pytest.fixture
def receiver(pool: ShmSegmentPool) -> Iterator[Receiver]:
    r = Receiver(SPEC, pool)
    yield r
    r.close()


def _transport(mode: str = "shm", host: str = HOST) -> ShmKVTransport:
    # one block pair per chunk, so a layer of several blocks spans several descriptors
    return ShmKVTransport(mode, host=host, shm_max_chunk_bytes=2 * BLOCK_BYTES, timeout_s=30)


@pytest.fixture
def transport() -> Iterator[ShmKVTransport]:
    t = _transport()
    yield t
    t.close()


def _reserve(receiver: Receiver, pool: ShmSegmentPool, n: int) -> tuple[str, ShmOffer]:
    rid = receiver.sink.reserve(n)
    offer = pool.offer(rid, n * RESERVATION_BYTES)
    assert offer is not None
    return rid, offer


def _descriptor_messages(rid: str, offer: ShmOffer, n: int, layers: range = range(3)
                         ) -> tuple[ShmSegment, list[bytes]]:
    """What a sender does by hand: payloads into the segment, descriptors returned."""
    seg = ShmSegment.open(offer.segment, offer.size)
    out, offset = [], 0
    for layer in layers:
        k, v = _blocks(n, seed=layer)
        for c in encode_layer_descriptors(rid, layer, range(n), k, v, seg.view, offset=offset,
                                          first_seq=len(out), max_chunk_bytes=2 * BLOCK_BYTES):
            out.append(c.data)
            offset += c.payload_bytes
    return seg, out


def _commit_bytes(rid: str, num_chunks: int, tokens: int) -> bytes:
    return _commit_message(rid, num_chunks, tokens).SerializeToString()


def test_shm_push_round_trip_and_segment_reuse(receiver: Receiver, pool: ShmSegmentPool,
                                               transport: ShmKVTransport) -> None:
    sink = receiver.sink
    held_before = _own_segments()  # workers of other test modules in this process
    other = sink.reserve(3)  # so the transfer's physical blocks are not 0..n-1
    names = []
    for round_ in range(2):
        rid, offer = _reserve(receiver, pool, 4)
        names.append(offer.segment)
        phys = sink.block_table(rid)
        before = _fill_other_blocks(sink)
        stream = transport.open(receiver.address, rid, SPEC, shm=offer)
        sent, order = {}, [2, 0, 3, 1]
        for layer in range(SPEC.num_layers):
            k, v = _blocks(4, seed=10 * round_ + layer)
            sent[layer] = (k, v)
            stream.push_layer(layer, order, k, v)
        info = KVCommitInfo(num_prompt_tokens=14, first_token_id=5)
        result = stream.commit(info)
        assert result.num_chunks == 4 * SPEC.num_layers
        assert result.bytes_sent == 4 * RESERVATION_BYTES
        assert sink.commits[rid] == info
        for layer, (k, v) in sent.items():
            for i, logical in enumerate(order):
                assert torch.equal(sink.cache.key(layer)[phys[logical]], k[i])
                assert torch.equal(sink.cache.value(layer)[phys[logical]], v[i])
        assert _same_bytes_outside(sink, before, phys)
        assert pool.num_in_use == 0  # committed: back in the free list
        sink.release(rid)
    assert transport.num_shm_streams == 2 and transport.num_grpc_streams == 0
    assert names[0] == names[1]  # the clean segment was reused, pages and all
    assert _own_segments() - held_before == {names[0]}
    sink.abort_kv(other, "test done")
    assert sink.num_free_blocks == SPEC.num_blocks


def _push_layers(stream, n: int, seed: int) -> None:
    for layer in range(SPEC.num_layers):
        k, v = _blocks(n, seed=seed + layer)
        stream.push_layer(layer, range(n), k, v)


@pytest.mark.parametrize("layers_per_chunk", [3, 2])
def test_layers_queued_together_share_a_chunk(receiver: Receiver, pool: ShmSegmentPool,
                                              layers_per_chunk: int) -> None:
    """Layers queued behind one the sender waits on go out as one chunk each time they fit
    in its size (3 layers: one chunk; at most 2: chunks of 2 and 1), and land
    byte-exact, each in its own layer."""
    sink = receiver.sink
    t = ShmKVTransport("shm", host=HOST, timeout_s=30,
                       shm_max_chunk_bytes=layers_per_chunk * 2 * 3 * BLOCK_BYTES)
    try:
        rid, offer = _reserve(receiver, pool, 3)
        phys = sink.block_table(rid)
        before = _fill_other_blocks(sink)
        stream = t.open(receiver.address, rid, SPEC, shm=offer)
        landed = threading.Event()  # layer 0's copy "lands" once every layer is queued
        sent = {}
        for layer in range(SPEC.num_layers):
            sent[layer] = _blocks(3, seed=40 + layer)
            stream.push_layer(layer, [2, 0, 1], *sent[layer],
                              wait=(lambda: landed.wait(10)) if layer == 0 else None)
        landed.set()
        result = stream.commit(KVCommitInfo(num_prompt_tokens=10, first_token_id=5))
        assert result.num_chunks == -(-SPEC.num_layers // layers_per_chunk)
        assert result.bytes_sent == 3 * RESERVATION_BYTES
        for layer, (k, v) in sent.items():
            for i, logical in enumerate([2, 0, 1]):
                assert torch.equal(sink.cache.key(layer)[phys[logical]], k[i])
                assert torch.equal(sink.cache.value(layer)[phys[logical]], v[i])
        assert _same_bytes_outside(sink, before, phys)
        sink.release(rid)
    finally:
        t.close()
    assert sink.num_free_blocks == SPEC.num_blocks


def test_multi_layer_chunk_checks(receiver: Receiver, pool: ShmSegmentPool) -> None:
    """A chunk of layers 0-1 decodes to both layers' K and V; one of layers 1-2 after it
    repeats layer 1's blocks and is refused naming them; a corrupt byte in a multi-layer
    chunk's second layer fails its CRC."""
    seg_rid, offer = _reserve(receiver, pool, 2)
    seg = ShmSegment.open(offer.segment, offer.size)
    layers = [_blocks(2, seed=60 + i) for i in range(3)]
    first = encode_layers_descriptor(seg_rid, 0, [0, 1], layers[:2], seg.view, offset=0,
                                     seq=0)
    msg = kvtransfer_pb2.KVMessage.FromString(first.data).chunk
    assert (msg.layer, msg.num_layers, msg.shm.length) == (0, 2, 2 * 2 * 2 * BLOCK_BYTES)
    decoded = decode_chunk(msg, SPEC, 2, seg.view[:first.payload_bytes])
    assert decoded.num_layers == 2
    for i in range(2):
        assert torch.equal(decoded.k[i], layers[i][0]) and torch.equal(decoded.v[i],
                                                                        layers[i][1])
    again = encode_layers_descriptor(seg_rid, 1, [0, 1], layers[1:], seg.view,
                                     offset=first.payload_bytes, seq=1)
    phys = receiver.sink.block_table(seg_rid)
    before = _fill_other_blocks(receiver.sink)
    err = _push_bytes(receiver.address, [first.data, again.data])
    _assert_rejected(receiver, seg_rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT,
                     "block_indices")
    assert err.details() == "block_indices: layer 1 blocks [0, 1] sent twice"
    seg.close()

    rid, offer = _reserve(receiver, pool, 2)
    seg = ShmSegment.open(offer.segment, offer.size)
    chunk = encode_layers_descriptor(rid, 0, [0, 1], layers, seg.view, offset=0, seq=0)
    seg.view[2 * 2 * BLOCK_BYTES + 5] ^= 0x10  # layer 1's K
    phys = receiver.sink.block_table(rid)
    before = _fill_other_blocks(receiver.sink)
    err = _push_bytes(receiver.address, [chunk.data, _commit_bytes(rid, 1, 8)])
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT,
                     "crc32c")
    seg.close()


def test_sender_keeps_mappings_while_their_files_live(receiver: Receiver,
                                                      pool: ShmSegmentPool) -> None:
    t = _transport()
    sink = receiver.sink
    try:
        # a clean commit: the pool reuses the segment and the sender its mapping of it
        mapped = []
        for round_ in range(2):
            rid, offer = _reserve(receiver, pool, 2)
            stream = t.open(receiver.address, rid, SPEC, shm=offer)
            _push_layers(stream, 2, seed=round_)
            stream.commit(KVCommitInfo(num_prompt_tokens=7, first_token_id=5))
            mapped.append(t._mapped[offer.segment])
            sink.release(rid)
        assert mapped[0] is mapped[1] and t.num_mapped == 1
        # an aborted push: the decode worker unlinks its segment, and the sender's next open
        # closes its mapping of it instead of keeping a dead file's pages alive
        rid, dropped = _reserve(receiver, pool, 2)
        t.open(receiver.address, rid, SPEC, shm=dropped).abort("test")
        _wait_for(lambda: pool.num_in_use == 0)
        assert dropped.segment not in pool.segment_names()
        rid, fresh = _reserve(receiver, pool, 2)
        stream = t.open(receiver.address, rid, SPEC, shm=fresh)
        assert list(t._mapped) == [fresh.segment]
        # over max_mapped_bytes the least recent mapping is closed, even under a live
        # stream, which keeps writing through its own view and commits
        t.max_mapped_bytes = fresh.size
        rid2, other = _reserve(receiver, pool, 2)
        stream2 = t.open(receiver.address, rid2, SPEC, shm=other)
        assert list(t._mapped) == [other.segment]
        for s, seed in ((stream, 10), (stream2, 20)):
            _push_layers(s, 2, seed)
            s.commit(KVCommitInfo(num_prompt_tokens=7, first_token_id=5))
        for r in (rid, rid2):
            assert r in sink.commits
            sink.release(r)
    finally:
        t.close()
    assert t.num_mapped == 0
    assert sink.num_free_blocks == SPEC.num_blocks


def test_descriptors_carry_no_payload(pool: ShmSegmentPool) -> None:
    offer = pool.offer("r", RESERVATION_BYTES)
    seg, messages = _descriptor_messages("r", offer, 1, range(1))
    k, v = _blocks(1, seed=0)
    (plain,) = encode_layer_messages("r", 0, [0], k, v)
    msg = kvtransfer_pb2.KVMessage.FromString(messages[0])
    assert msg.chunk.payload == b"" and msg.chunk.shm.offset == 0
    assert msg.chunk.shm.length == 2 * BLOCK_BYTES
    # same header and CRC-32C as the gRPC payload's
    assert msg.chunk.crc32c == kvtransfer_pb2.KVMessage.FromString(plain.data).chunk.crc32c
    assert bytes(seg.view[:2 * BLOCK_BYTES]) == k.numpy().tobytes() + v.numpy().tobytes()
    assert len(messages[0]) < 100
    seg.close()


def test_corrupted_shm_payload_rejected(receiver: Receiver, pool: ShmSegmentPool) -> None:
    """A byte flipped in the segment after the descriptor's CRC was computed: refused
    with INVALID_ARGUMENT, reservation aborted and its blocks freed, every other block
    byte-identical (the bad chunk may have reached the reservation's own blocks, which
    nothing else reads), segment unlinked."""
    sink = receiver.sink
    rid, offer = _reserve(receiver, pool, 2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    seg, messages = _descriptor_messages(rid, offer, 2)
    corrupt_at = 3 * 2 * BLOCK_BYTES + 100  # in chunk 3: layer 1, block 1
    seg.view[corrupt_at] ^= 0x01
    err = _push_bytes(receiver.address, [*messages, _commit_bytes(rid, 6, 8)])
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, "crc32c")
    assert err.details() == "crc32c: chunk 3: payload checksum mismatch"
    assert receiver.service.bytes_received == 3 * 2 * BLOCK_BYTES  # chunks 0-2 only
    assert offer.segment not in _own_segments() and pool.num_in_use == 0
    seg.close()


@pytest.mark.parametrize("edit, field", [
    ("gap", "shm"), ("outside", "shm"), ("both", "payload"),
])
def test_bad_descriptor_rejected(receiver: Receiver, pool: ShmSegmentPool, edit: str,
                                 field: str) -> None:
    sink = receiver.sink
    rid, offer = _reserve(receiver, pool, 2)
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    seg, messages = _descriptor_messages(rid, offer, 2, range(1))
    msg = kvtransfer_pb2.KVMessage.FromString(messages[1])
    if edit == "gap":  # not where the previous chunk ended
        msg.chunk.shm.offset += 8
    elif edit == "outside":  # starts where it should, runs past the segment's end
        msg.chunk.shm.length = offer.size
    else:  # a payload in the message as well
        msg.chunk.payload = bytes(2 * BLOCK_BYTES)
    messages[1] = msg.SerializeToString()
    err = _push_bytes(receiver.address, messages)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, field)
    assert offer.segment not in _own_segments()
    seg.close()


def test_descriptor_without_an_offer_rejected(receiver: Receiver, pool: ShmSegmentPool
                                              ) -> None:
    sink = receiver.sink
    rid = sink.reserve(1)  # no segment offered for it
    phys = sink.block_table(rid)
    before = _fill_other_blocks(sink)
    other = pool.offer("another reservation", RESERVATION_BYTES)
    seg, messages = _descriptor_messages(rid, other, 1, range(1))
    err = _push_bytes(receiver.address, messages)
    _assert_rejected(receiver, rid, phys, before, err, grpc.StatusCode.INVALID_ARGUMENT, "shm")
    assert other.segment in _own_segments()  # another reservation's segment is untouched
    seg.close()


def test_sender_abort_mid_transfer(receiver: Receiver, pool: ShmSegmentPool,
                                   transport: ShmKVTransport) -> None:
    sink = receiver.sink
    rid, offer = _reserve(receiver, pool, 2)
    stream = transport.open(receiver.address, rid, SPEC, shm=offer)
    k, v = _blocks(2)
    stream.push_layer(0, [0, 1], k, v)
    stream.abort("prefill failed")  # returns at once: the receiver answers meanwhile
    end = time.monotonic() + 10
    while rid not in sink.aborts and time.monotonic() < end:
        time.sleep(0.01)
    assert sink.aborts[rid].startswith("CANCELLED: sender aborted: prefill failed")
    assert sink.num_free_blocks == SPEC.num_blocks
    assert offer.segment not in _own_segments() and pool.num_in_use == 0


def test_cancelled_shm_push_frees_everything(receiver: Receiver, pool: ShmSegmentPool) -> None:
    sink = receiver.sink
    rid, offer = _reserve(receiver, pool, 2)
    seg, raw = _descriptor_messages(rid, offer, 2)
    messages = [kvtransfer_pb2.KVMessage.FromString(m) for m in raw]
    held = _HeldStream(receiver.address, messages[:1], messages[1:])
    _wait_for(lambda: receiver.service.bytes_received > 0)
    held.future.cancel()
    _wait_for(lambda: rid in sink.aborts)
    assert sink.num_free_blocks == SPEC.num_blocks
    assert offer.segment not in _own_segments() and pool.num_in_use == 0
    held.close()
    seg.close()


def test_reservation_expiring_mid_shm_push(receiver: Receiver, pool: ShmSegmentPool) -> None:
    sink = receiver.sink
    rid, offer = _reserve(receiver, pool, 2)
    seg, raw = _descriptor_messages(rid, offer, 2)
    messages = [kvtransfer_pb2.KVMessage.FromString(m) for m in raw]
    held = _HeldStream(receiver.address, messages[:1], messages[1:])
    _wait_for(lambda: receiver.service.bytes_received > 0)
    sink.abort_kv(rid, "expired")  # what the decode worker does on its reservation timeout
    held.release()
    with pytest.raises(grpc.RpcError) as err:
        held.future.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert offer.segment not in _own_segments() and pool.num_in_use == 0
    # the late sender still writes into its own mapping, which no one else reads
    seg.view[0] ^= 0xFF
    held.close()
    seg.close()


def test_fallback_to_grpc_when_hosts_differ(receiver: Receiver, pool: ShmSegmentPool) -> None:
    sink = receiver.sink
    rid, offer = _reserve(receiver, pool, 2)
    t = _transport("auto", host="host-b")
    stream = t.open(receiver.address, rid, SPEC, shm=offer)
    for layer in range(SPEC.num_layers):
        stream.push_layer(layer, [0, 1], *_blocks(2, seed=layer))
    stream.commit(KVCommitInfo(num_prompt_tokens=5, first_token_id=1))
    assert t.num_grpc_streams == 1 and t.num_shm_streams == 0
    phys = sink.block_table(rid)
    for layer in range(SPEC.num_layers):
        k, v = _blocks(2, seed=layer)
        assert torch.equal(sink.cache.key(layer)[phys], k)
        assert torch.equal(sink.cache.value(layer)[phys], v)
    # the unused segment was committed cleanly too: kept for the next reservation
    assert pool.num_in_use == 0 and offer.segment in _own_segments()
    sink.release(rid)
    t.close()


@pytest.mark.parametrize("case", ["other host", "no offer", "missing", "bad name", "size"])
def test_transport_choice(pool: ShmSegmentPool, case: str) -> None:
    offer = pool.offer("r", RESERVATION_BYTES)
    host = HOST
    if case == "other host":
        host = "host-b"
    elif case == "no offer":
        offer = None
    elif case == "missing":
        offer = ShmOffer(HOST, "pdserve-kv-1-0123456789abcdef", offer.size)
    elif case == "bad name":
        offer = ShmOffer(HOST, "../../etc/passwd", offer.size)
    else:
        offer = ShmOffer(HOST, offer.segment, offer.size + 1)
    auto, strict = _transport("auto", host), _transport("shm", host)
    # auto falls back to gRPC payloads (the stream works, here into no reservation)
    stream = auto.open("127.0.0.1:1", "r", SPEC, shm=offer)
    assert auto.num_grpc_streams == 1 and auto.num_shm_streams == 0
    stream.abort("test done")
    with pytest.raises(KVTransferError) as err:
        strict.open("127.0.0.1:1", "r", SPEC, shm=offer)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    auto.close()
    strict.close()


def test_grpc_mode_ignores_offers(pool: ShmSegmentPool) -> None:
    offer = pool.offer("r", RESERVATION_BYTES)
    t = _transport("grpc")
    t.open("127.0.0.1:1", "r", SPEC, shm=offer).abort("test done")
    assert t.num_grpc_streams == 1 and t.num_shm_streams == 0
    t.close()


def test_pool_capacity_and_eviction(pool: ShmSegmentPool) -> None:
    small = ShmSegmentPool(HOST, capacity_bytes=3 << 20)
    a = small.offer("a", 1)
    b = small.offer("b", (1 << 20) + 1)  # rounded up to 2 MiB
    assert (a.size, b.size) == (1 << 20, 2 << 20)
    assert small.offer("c", 1) is None  # full: that transfer goes over gRPC
    small.finish("b", clean=True)  # kept for reuse ...
    c = small.offer("c", 1)
    assert c.segment == b.segment  # ... and the smallest free one that fits is reused
    small.finish("c", clean=True)
    d = small.offer("d", 3 << 20)
    assert d is None  # 3 MiB does not fit beside a's 1 MiB, even with b dropped
    assert b.segment not in _own_segments()  # the free segment was dropped trying
    small.finish("a", clean=False)
    assert a.segment not in _own_segments()
    small.close()
    with pytest.raises(ValueError, match="already has a segment"):
        pool.offer("x", 1) and pool.offer("x", 1)


def test_stale_segments_of_dead_processes_swept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"pdserve-kv-{dead_pid}-0123456789abcdef"
    live = tmp_path / f"pdserve-kv-{os.getpid()}-0123456789abcdef"
    unrelated = tmp_path / "something-else"
    for p in (stale, live, unrelated):
        p.write_bytes(b"x")
    assert sweep_stale(tmp_path) == 1
    assert not stale.exists() and live.exists() and unrelated.exists()


def test_offer_proto_round_trip() -> None:
    offer = ShmOffer(HOST, "pdserve-kv-1-0123456789abcdef", 4096)
    assert offer_from_proto(offer_to_proto(offer)) == offer
    assert offer_from_proto(common_pb2.KVShmOffer()) is None  # unset: gRPC payloads


# -- a real prefill + decode pair pushing through shared memory -----------------------------


async def _start_worker(kind: str, model_dir: str, kv_transport: str, **cfg):
    cls = DecodeWorker if kind == "decode" else PrefillWorker
    engine = tiny_engine(model_dir, **cfg)
    w = cls(WorkerConfig(engine=engine.config), engine=engine, kv_transport=kv_transport)
    await w.start()
    return w


async def _generate_via_offer(decode_addr: str, prefill_addr: str, ids: list[int],
                              params, request_id: str) -> list[int]:
    """The gateway's flow, passing the Reserve's shm offer on to Prefill as it does."""
    async with grpc.aio.insecure_channel(decode_addr) as dch, \
            grpc.aio.insecure_channel(prefill_addr) as pch:
        d = decode_pb2_grpc.DecodeWorkerStub(dch)
        p = prefill_pb2_grpc.PrefillWorkerStub(pch)
        sp = params.to_proto()
        res = await d.Reserve(decode_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=sp))
        assert res.HasField("shm") and res.shm.segment in _own_segments()
        stream = d.Decode(decode_pb2.DecodeRequest(reservation_id=res.reservation_id))
        pre = await p.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=sp,
            decode_address=decode_addr, reservation_id=res.reservation_id,
            reserved_blocks=res.num_blocks, decode_kv_spec=res.kv_spec, decode_shm=res.shm,
            reservation_secret=res.reservation_secret))
        tokens = []
        async for chunk in stream:
            tokens.extend(chunk.token_ids)
        assert tokens[0] == pre.first_token_id
        return tokens


def test_disaggregated_over_shm_equals_colocated(tiny_model_dir):
    before = _own_segments()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[(37 * i + 11 * j) % 4000 + 50 for j in range(5 + 23 * i)] for i in range(8)]
    reference = [o.token_ids for o in tiny_engine(tiny_model_dir).generate(prompts, greedy)]

    async def main():
        dec = await _start_worker("decode", tiny_model_dir, "auto")
        pre = await _start_worker("prefill", tiny_model_dir, "shm", max_num_batched_tokens=64)
        try:
            outs = await asyncio.gather(*[
                _generate_via_offer(dec.address, pre.address, ids, greedy, f"s{i}")
                for i, ids in enumerate(prompts)])
            # strict mode: every transfer went through shared memory or the request failed
            assert pre.transport.num_shm_streams == len(prompts)
            assert pre.transport.num_grpc_streams == 0
            assert dec.kv_receiver.num_committed == len(prompts)
            assert dec.shm.num_in_use == 0  # every segment back in the free list
            for w in (dec, pre):
                # the stats are the engine's as of its last step: the step that streamed a
                # request's last token may not have published the freed blocks yet
                for _ in range(100):
                    s = await w.stats()
                    if s.load.free_blocks == s.load.total_blocks:
                        break
                    await asyncio.sleep(0.05)
                assert s.load.free_blocks == s.load.total_blocks, s.load
                assert s.load.num_running == 0, s.load
            return outs
        finally:
            await dec.stop(0)
            await pre.stop(0)

    outs = asyncio.run(main())
    assert outs == reference
    assert _own_segments() <= before  # the decode worker unlinked its segments at stop


def test_unused_offer_released_with_its_reservation(tiny_model_dir):
    """A reservation cancelled before any push: its segment is unlinked at once."""
    before = _own_segments()
    async def main():
        dec = await _start_worker("decode", tiny_model_dir, "auto")
        try:
            async with grpc.aio.insecure_channel(dec.address) as ch:
                d = decode_pb2_grpc.DecodeWorkerStub(ch)
                res = await d.Reserve(decode_pb2.ReserveRequest(
                    request_id="c", prompt_token_ids=list(range(40)),
                    sampling=SamplingParams(max_tokens=2).to_proto()))
                assert res.shm.segment in _own_segments()
                await d.Cancel(decode_pb2.CancelRequest(reservation_id=res.reservation_id))
                assert res.shm.segment not in _own_segments()
                assert dec.shm.num_in_use == 0
        finally:
            await dec.stop(0)

    asyncio.run(main())
    assert _own_segments() <= before
