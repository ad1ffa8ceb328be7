"""The engine's KV connector: KV saved layer by layer on a prefill engine and loaded into a
decode engine's reservation gives the colocated output; every load-side call runs on the
engine thread; a commit with an out-of-vocabulary token is refused with nothing changed;
pushed KV never serves another request; the stats carry the pool's prefix hashes."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch
from conftest import assert_pool_clean, tiny_engine
from test_disagg import _disagg_generate, _free_blocks, _start

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_connector import KVLayerCopy, KVSaver, PagedKVConnector
from pdserve.engine.sequence import SequenceStatus
from pdserve.kvtransfer.grpc_sender import GrpcKVTransport
from pdserve.kvtransfer.sink import KVCommitInfo
from pdserve.kvtransfer.transport import KVTransferError
from pdserve.protocol import SamplingParams, TokenLogprobs
from pdserve.protos.pdserve.v1 import decode_pb2, decode_pb2_grpc
from pdserve.worker_runtime import WorkerConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = [(7 * j) % 3000 + 60 for j in range(48)]  # three full 16-token blocks


class ListSaver(KVSaver):
    """Keeps every layer copy it is handed, and the thread that handed it."""

    def __init__(self) -> None:
        self.copies: list[KVLayerCopy] = []
        self.threads: set[str] = set()

    def save_layer(self, copy: KVLayerCopy) -> None:
        self.threads.add(threading.current_thread().name)
        self.copies.append(copy)


class RecordingConnector(PagedKVConnector):
    """The real connector, noting which thread made each load-side call."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.calls: list[tuple[str, str]] = []

    def _note(self, what: str) -> None:
        self.calls.append((what, threading.current_thread().name))

    def reserve(self, *args, **kw):
        self._note("reserve")
        return super().reserve(*args, **kw)

    def write(self, *args, **kw):
        self._note("write")
        return super().write(*args, **kw)

    def commit(self, *args, **kw):
        self._note("commit")
        return super().commit(*args, **kw)

    def abort(self, *args, **kw):
        self._note("abort")
        return super().abort(*args, **kw)


def _prefill_and_save(eng, request_id: str, prompt: list[int]) -> tuple[ListSaver, int]:
    saver = ListSaver()
    eng.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0),
                    prefill_only=True, kv_saver=saver)
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    return saver, deltas[-1].new_token_ids[0]


def test_saved_kv_loaded_elsewhere_equals_colocated(tiny_model_dir):
    """Offline, no network: a chunked prefill's saved copies written into another
    engine's reservation decode to the colocated tokens; both pools end clean."""
    reference = tiny_engine(tiny_model_dir).generate([PROMPT], GREEDY)[0].token_ids
    pre = tiny_engine(tiny_model_dir, block_size=16, max_num_batched_tokens=20)  # 3 chunks
    saver, first = _prefill_and_save(pre, "p", PROMPT)
    layers = pre.dims.num_layers
    assert [c.layer for c in saver.copies] == list(range(layers))
    assert all(c.ready is None and c.block_indices == (0, 1, 2) for c in saver.copies)
    assert saver.threads == {threading.current_thread().name}  # the stepping thread

    dec = tiny_engine(tiny_model_dir, block_size=16)
    conn = dec.kv_connector
    conn.reserve("d", PROMPT, GREEDY)
    for c in saver.copies:
        conn.write("d", c.layer, c.block_indices, c.k[None], c.v[None])
    conn.commit("d", first)
    tokens = [first]
    while dec.has_unfinished():
        tokens += [t for d in dec.step() for t in d.new_token_ids]
    assert tokens == reference
    assert_pool_clean(pre)
    assert_pool_clean(dec)


def test_failing_saver_is_dropped_and_batch_runs_on(tiny_model_dir):
    class Broken(KVSaver):
        def save_layer(self, copy: KVLayerCopy) -> None:
            raise RuntimeError("transport gone")

    eng = tiny_engine(tiny_model_dir)
    eng.add_request("broken", PROMPT, SamplingParams(max_tokens=1, temperature=0),
                    prefill_only=True, kv_saver=Broken())
    eng.add_request("fine", PROMPT[:20], GREEDY)
    finished = {}
    while eng.has_unfinished():
        finished.update({d.request_id: d.finish_reason for d in eng.step() if d.finished})
    assert finished == {"broken": "length", "fine": "length"}
    assert not eng.kv_connector.saving
    assert_pool_clean(eng)


def test_commit_outside_vocab_refused_engine_untouched(tiny_model_dir):
    eng = tiny_engine(tiny_model_dir, block_size=16)
    conn = eng.kv_connector
    vocab = eng.dims.vocab_size
    res = conn.reserve("r", PROMPT, GREEDY)
    assert len(res.block_ids) == 3
    pool_before, counters_before = eng.pool.stats(), (eng.counters.prompt_tokens,
                                                      eng.counters.generation_tokens)
    with pytest.raises(ValueError, match="^first_token_id"):
        conn.commit("r", vocab)
    with pytest.raises(ValueError, match="^first_token_top_logprobs"):
        conn.commit("r", 5, TokenLogprobs(5, -0.1, ((5, -0.1), (vocab + 3, -2.0))))
    seq = eng.seqs["r"]
    assert seq.status == SequenceStatus.WAITING_FOR_KV and not seq.output_token_ids
    assert eng.pool.stats() == pool_before
    assert (eng.counters.prompt_tokens, eng.counters.generation_tokens) == counters_before
    assert not eng.has_unfinished()
    # a write outside the reservation is refused, and so is the commit after it
    k = eng.kv_cache.key(0)[:1].clone()
    with pytest.raises(IndexError):
        conn.write("r", 0, [3], k[None], k[None])
    with pytest.raises(RuntimeError, match="write"):
        conn.commit("r", 5)
    assert conn.abort("r").finish_reason == "abort"
    with pytest.raises(KeyError):
        conn.commit("r", 5)
    assert_pool_clean(eng)


def test_load_side_on_engine_thread_and_out_of_vocab_over_grpc(tiny_model_dir):
    reference = tiny_engine(tiny_model_dir).generate([PROMPT], GREEDY)[0].token_ids

    async def main():
        from pdserve.decode_worker.server import DecodeWorker

        engine = tiny_engine(tiny_model_dir)
        recorder = RecordingConnector(engine)
        engine.kv_connector = recorder  # before the engine thread starts
        dec = DecodeWorker(WorkerConfig(engine=engine.config), engine=engine)
        await dec.start()
        pre = await _start("prefill", tiny_model_dir)
        try:
            out = await _disagg_generate(dec.address, pre.address, PROMPT, GREEDY, "ok")
            assert out == reference
            kinds = [what for what, _ in recorder.calls]
            layers = dec.engine.dims.num_layers
            assert kinds[0] == "reserve" and kinds[-1] == "commit"
            assert kinds.count("write") >= layers
            assert {thread for _, thread in recorder.calls} == {"engine-loop"}

            # a complete, valid transfer whose commit names a token outside the vocabulary
            async with grpc.aio.insecure_channel(dec.address) as ch:
                d = decode_pb2_grpc.DecodeWorkerStub(ch)
                res = await d.Reserve(decode_pb2.ReserveRequest(
                    request_id="bad", prompt_token_ids=PROMPT,
                    sampling=GREEDY.to_proto()))
            spec = dec.engine.kv_spec
            transport = GrpcKVTransport(timeout_s=30)
            try:
                stream = transport.open(dec.address, res.reservation_id, spec,
                                        res.reservation_secret)
                blocks = torch.ones(res.num_blocks, *spec.block_shape, dtype=spec.torch_dtype)
                for layer in range(layers):
                    stream.push_layer(layer, range(res.num_blocks), blocks, blocks.clone())
                info = KVCommitInfo(num_prompt_tokens=len(PROMPT),
                                    first_token_id=dec.engine.dims.vocab_size)
                with pytest.raises(KVTransferError) as err:
                    await asyncio.to_thread(stream.commit, info)
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert "first_token_id" in str(err.value)
            finally:
                transport.close()
            for _ in range(50):  # the refused reservation is aborted on the engine thread
                if await _free_blocks(dec) == (spec.num_blocks, spec.num_blocks):
                    break
                await asyncio.sleep(0.1)
            assert await _free_blocks(dec) == (spec.num_blocks, spec.num_blocks)
            assert ("abort", "engine-loop") in recorder.calls
            assert {thread for _, thread in recorder.calls} == {"engine-loop"}
            assert dec.engine.counters.generation_tokens == len(reference)
        finally:
            await dec.stop(0)
            await pre.stop(0)
        assert_pool_clean(dec.engine)
        assert_pool_clean(pre.engine)

    asyncio.run(main())


def test_pushed_kv_not_in_decode_prefix_cache(tiny_model_dir):
    """The decode worker holds the pushed prompt's blocks, yet a colocated request with
    the same prompt hits none of them; its own (locally computed) blocks are cached."""
    async def generate(dec, request_id: str) -> int:
        async with grpc.aio.insecure_channel(dec.address) as ch:
            d = decode_pb2_grpc.DecodeWorkerStub(ch)
            async for chunk in d.Generate(decode_pb2.ColocatedGenerateRequest(
                    request_id=request_id, prompt_token_ids=PROMPT,
                    sampling=GREEDY.to_proto())):
                last = chunk
        return last.num_cached_tokens

    async def main():
        dec = await _start("decode", tiny_model_dir, block_size=16)
        pre = await _start("prefill", tiny_model_dir, block_size=16)
        try:
            await _disagg_generate(dec.address, pre.address, PROMPT, GREEDY, "pushed")
            assert dec.engine.pool.stats().cached == 0
            assert await generate(dec, "local") == 0
            assert dec.aengine.stats().prefix_hits == 0
            # the local request's blocks are cached: the next one takes all but the last
            assert await generate(dec, "again") == 32
            assert dec.aengine.stats().prefix_hits == 32
            # the prefill worker still shares the prefix it computed
            await _disagg_generate(dec.address, pre.address, PROMPT, GREEDY, "pushed2")
            assert pre.engine.pool.prefix_hits == 32
        finally:
            await dec.stop(0)
            await pre.stop(0)
        assert_pool_clean(dec.engine)
        assert_pool_clean(pre.engine)

    asyncio.run(main())


def test_prefix_hashes_in_stats_equal_the_pools(tiny_model_dir):
    async def main():
        dec = await _start("decode", tiny_model_dir, block_size=16)
        pre = await _start("prefill", tiny_model_dir, block_size=16)
        try:
            for i in range(2):
                prompt = [t + 100 * i for t in PROMPT]
                await _disagg_generate(dec.address, pre.address, prompt, GREEDY, f"h{i}")
            for _ in range(50):  # the engine thread publishes a snapshot when it idles
                if pre.aengine.stats().prefix_hashes:
                    break
                await asyncio.sleep(0.1)
            hashes = pre.aengine.stats().prefix_hashes
            assert len(hashes) == 6  # 3 full blocks of each prompt
            assert hashes == tuple(pre.engine.pool.cached_hashes())
            assert list(pre.load().cached_block_hashes) == list(hashes)
            assert dec.aengine.stats().prefix_hashes == ()  # decode workers report none
        finally:
            await dec.stop(0)
            await pre.stop(0)

    asyncio.run(main())


def test_prefix_hashes_bounded_newest_last(tiny_model_dir):
    async def main():
        eng = tiny_engine(tiny_model_dir, block_size=16)
        aeng = AsyncEngine(eng, max_prefix_hashes=4)
        aeng.start()
        try:
            for i in range(2):
                async for _ in aeng.generate(f"b{i}", [t + 100 * i for t in PROMPT], GREEDY):
                    pass
            for _ in range(50):
                if len(aeng.stats().prefix_hashes) == 4:
                    break
                await asyncio.sleep(0.1)
            all_hashes = eng.pool.cached_hashes()
            assert len(all_hashes) == 6
            assert aeng.stats().prefix_hashes == tuple(all_hashes[-4:])
        finally:
            await aeng.stop()
        assert_pool_clean(eng)

    asyncio.run(main())


def _crc(k: torch.Tensor, v: torch.Tensor, crc: int = 0) -> int:
    from crc32c import crc32c

    return crc32c(v.numpy().tobytes(), crc32c(k.numpy().tobytes(), crc))


def test_checksum_checked_as_copied_only_own_blocks_touched(tiny_model_dir):
    """A write with the sender's CRC-32C: good bytes land; bad bytes may land in the
    reservation's own blocks only, the write raises, the commit is refused naming crc32c,
    and the abort frees the blocks. Every other block keeps its bytes throughout."""
    from pdserve.engine.kv_blocks import ChecksumMismatch

    eng = tiny_engine(tiny_model_dir, block_size=16)
    conn = eng.kv_connector
    gen = torch.Generator().manual_seed(0)
    eng.kv_cache.data.copy_(torch.randn(eng.kv_cache.data.shape, generator=gen))
    phys = list(conn.reserve("r", PROMPT, GREEDY).block_ids)
    others = [b for b in range(eng.pool.num_blocks) if b not in phys]
    before = eng.kv_cache.data.clone()
    shape = (len(phys), *eng.kv_spec.block_shape)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    conn.write("r", 0, range(len(phys)), k[None], v[None], _crc(k, v))
    assert torch.equal(eng.kv_cache.key(0)[phys], k)
    assert torch.equal(eng.kv_cache.value(0)[phys], v)
    with pytest.raises(ChecksumMismatch, match="^crc32c"):
        conn.write("r", 1, [2, 0], k[None, :2], v[None, :2], _crc(k[:2], v[:2]) ^ 1)
    with pytest.raises(ValueError, match="^crc32c"):
        conn.commit("r", 5)
    # data: [layers, K/V, blocks, ...]
    assert torch.equal(eng.kv_cache.data[:, :, others], before[:, :, others])
    assert conn.abort("r").finish_reason == "abort"
    assert_pool_clean(eng)


def test_a_write_of_several_layers(tiny_model_dir):
    """One write covering layers 1..L-1 (a multi-layer chunk): each layer lands in its own
    cache, under one CRC over K1 V1 K2 V2 ...; a range past the last layer is refused."""
    eng = tiny_engine(tiny_model_dir, block_size=16)
    conn = eng.kv_connector
    phys = list(conn.reserve("r", PROMPT, GREEDY).block_ids)
    n_layers = eng.kv_spec.num_layers
    gen = torch.Generator().manual_seed(2)
    shape = (n_layers - 1, len(phys), *eng.kv_spec.block_shape)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    crc = 0
    for i in range(n_layers - 1):
        crc = _crc(k[i], v[i], crc)
    conn.write("r", 1, range(len(phys)), k, v, crc)
    for i in range(n_layers - 1):
        assert torch.equal(eng.kv_cache.key(1 + i)[phys], k[i])
        assert torch.equal(eng.kv_cache.value(1 + i)[phys], v[i])
    with pytest.raises(IndexError, match="^layers 2.."):
        conn.write("r", 2, range(len(phys)), k, v, crc)
    assert conn.abort("r").finish_reason == "abort"
    assert_pool_clean(eng)


@pytest.mark.parametrize("shared_by", ["ref_count", "prefix_hash"])
def test_checksum_checked_before_copy_into_a_shared_block(tiny_model_dir, shared_by):
    """Were a reservation's block ever held by someone else too (a second reference, or a
    prefix-cache hash: not something `reserve` hands out), a write checks its bytes before
    copying, so bad bytes leave even the reservation's blocks untouched."""
    from pdserve.engine.kv_blocks import ChecksumMismatch

    eng = tiny_engine(tiny_model_dir, block_size=16)
    conn = eng.kv_connector
    phys = list(conn.reserve("r", PROMPT, GREEDY).block_ids)
    block = eng.pool.blocks[phys[1]]
    if shared_by == "ref_count":
        block.ref_count += 1
    else:
        block.block_hash = 12345
    before = eng.kv_cache.data.clone()
    shape = (len(phys), *eng.kv_spec.block_shape)
    k, v = torch.ones(shape), torch.full(shape, 2.0)
    with pytest.raises(ChecksumMismatch):
        conn.write("r", 0, range(len(phys)), k[None], v[None], _crc(k, v) ^ 1)
    assert torch.equal(eng.kv_cache.data, before)
    if shared_by == "ref_count":
        block.ref_count -= 1
    else:
        block.block_hash = None
    assert conn.abort("r").finish_reason == "abort"
    assert_pool_clean(eng)


def test_corrupted_chunk_over_grpc_refused_by_the_engines_check(tiny_model_dir):
    """Through a real decode worker, where the checksum is taken on the engine thread as
    the chunk is copied: the push ends INVALID_ARGUMENT naming crc32c, the reservation is
    aborted and its blocks freed, no block outside it changed, and every connector call
    ran on the engine thread."""
    from pdserve.kvtransfer.receiver import SECRET_METADATA
    from pdserve.kvtransfer.wire import commit_to_proto, encode_layer
    from pdserve.protos.pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

    async def main():
        from pdserve.decode_worker.server import DecodeWorker

        engine = tiny_engine(tiny_model_dir, block_size=16)
        recorder = RecordingConnector(engine)
        engine.kv_connector = recorder
        gen = torch.Generator().manual_seed(1)
        engine.kv_cache.data.copy_(torch.randn(engine.kv_cache.data.shape, generator=gen))
        dec = DecodeWorker(WorkerConfig(engine=engine.config), engine=engine)
        await dec.start()
        try:
            async with grpc.aio.insecure_channel(dec.address) as ch:
                d = decode_pb2_grpc.DecodeWorkerStub(ch)
                res = await d.Reserve(decode_pb2.ReserveRequest(
                    request_id="bad", prompt_token_ids=PROMPT, sampling=GREEDY.to_proto()))
                phys = list(engine.seqs["bad"].block_table)
                before = engine.kv_cache.data.clone()
                spec = engine.kv_spec
                msgs, seq = [], 0
                for layer in range(spec.num_layers):
                    k, v = (torch.randn(res.num_blocks, *spec.block_shape, generator=gen)
                            for _ in range(2))
                    for c in encode_layer(res.reservation_id, layer, range(res.num_blocks), k,
                                          v, first_seq=seq):
                        msgs.append(kvtransfer_pb2.KVMessage(chunk=c))
                        seq += 1
                bad = bytearray(msgs[1].chunk.payload)
                bad[7] ^= 0x10
                msgs[1].chunk.payload = bytes(bad)
                info = KVCommitInfo(num_prompt_tokens=len(PROMPT), first_token_id=1)
                msgs.append(kvtransfer_pb2.KVMessage(
                    commit=commit_to_proto(res.reservation_id, seq, info)))
                push = kvtransfer_pb2_grpc.KVTransferStub(ch).Push
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await push(iter(msgs), timeout=30,
                               metadata=((SECRET_METADATA, res.reservation_secret),))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("crc32c"), err.value.details()
            spec = engine.kv_spec
            for _ in range(50):  # the abort is applied on the engine thread
                if await _free_blocks(dec) == (spec.num_blocks, spec.num_blocks):
                    break
                await asyncio.sleep(0.1)
            assert await _free_blocks(dec) == (spec.num_blocks, spec.num_blocks)
            others = [b for b in range(spec.num_blocks) if b not in phys]
            assert torch.equal(engine.kv_cache.data[:, :, others], before[:, :, others])
            assert ("abort", "engine-loop") in recorder.calls
            assert {thread for _, thread in recorder.calls} == {"engine-loop"}
        finally:
            await dec.stop(0)
        assert_pool_clean(dec.engine)

    asyncio.run(main())


def test_queued_kv_writes_applied_in_one_drain_in_order(tiny_model_dir):
    """KV writes queued while the engine thread is busy wait in one drain command: each
    future resolves with its own outcome, in the order sent, and a commit sent after them
    sees every one (here a failed checksum, so it is refused and the abort frees all)."""
    from pdserve.engine.kv_blocks import ChecksumMismatch

    async def main():
        eng = tiny_engine(tiny_model_dir, block_size=16)
        aeng = AsyncEngine(eng)
        busy, gate = threading.Event(), threading.Event()
        aeng.start()
        try:
            res = await aeng.reserve("r", PROMPT, GREEDY)
            phys = list(res.block_ids)
            aeng._cmds.put((lambda: busy.set() or gate.wait(), None))
            await asyncio.to_thread(busy.wait)  # the engine thread is held until the gate
            gen = torch.Generator().manual_seed(1)
            shape = (len(phys), *eng.kv_spec.block_shape)
            sent, futs = [], []
            for layer in range(eng.dims.num_layers):
                k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
                sent.append((k, v))
                futs.append(aeng.write_kv("r", layer, range(len(phys)), k[None], v[None],
                                          _crc(k, v)))
            futs.append(aeng.write_kv("r", 0, [1], k[None, :1], v[None, :1],
                                      _crc(k[:1], v[:1]) ^ 1))
            futs.append(aeng.write_kv("gone", 0, [0], k[None, :1], v[None, :1], 0))
            assert aeng._cmds.qsize() == 1  # one drain command for every write
            commit = asyncio.ensure_future(aeng.commit("r", 5))
            gate.set()
            outcomes = [await asyncio.wrap_future(f) for f in futs[:-2]]
            assert outcomes == [None] * eng.dims.num_layers
            with pytest.raises(ChecksumMismatch):
                await asyncio.wrap_future(futs[-2])
            with pytest.raises(KeyError):
                await asyncio.wrap_future(futs[-1])
            with pytest.raises(ValueError, match="^crc32c"):
                await commit
            for layer, (k, v) in enumerate(sent[1:], start=1):
                assert torch.equal(eng.kv_cache.key(layer)[phys], k)
                assert torch.equal(eng.kv_cache.value(layer)[phys], v)
            assert not aeng._kv_drain_queued and not aeng._kv_writes
            assert await aeng.cancel_reservation("r")
        finally:
            gate.set()  # a failed assertion must not leave the engine thread held
            await aeng.stop()
        assert_pool_clean(eng)

    asyncio.run(main())
