"""The disaggregated tiers over real gRPC on 127.0.0.1: reserve -> prefill -> layer-wise KV
push -> decode, against the colocated engine; faults leave caches and accounting clean."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest
import torch
from conftest import tiny_engine

from pdserve.protocol import SamplingParams
from pdserve.protos.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.worker_runtime import WorkerConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    return [[(37 * i + 11 * j) % 4000 + 50 for j in range(5 + 23 * i)] for i in range(n)]


async def _start(kind: str, model_dir: str, **cfg):
    from pdserve.decode_worker.server import DecodeWorker
    from pdserve.prefill_worker.server import PrefillWorker

    cls = DecodeWorker if kind == "decode" else PrefillWorker
    timeout = cfg.pop("timeout", 30.0)
    engine = tiny_engine(model_dir, **cfg)
    w = cls(WorkerConfig(engine=engine.config, reservation_timeout_s=timeout), engine=engine)
    await w.start()
    return w


async def _disagg_generate(decode_addr: str, prefill_addr: str, ids: list[int],
                           params: SamplingParams, request_id: str) -> list[int]:
    """The gateway's flow in miniature: Reserve, open Decode, Prefill, collect tokens."""
    async with grpc.aio.insecure_channel(decode_addr) as dch, \
            grpc.aio.insecure_channel(prefill_addr) as pch:
        d = decode_pb2_grpc.DecodeWorkerStub(dch)
        p = prefill_pb2_grpc.PrefillWorkerStub(pch)
        sp = params.to_proto()
        res = await d.Reserve(decode_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=sp))
        stream = d.Decode(decode_pb2.DecodeRequest(reservation_id=res.reservation_id))
        pre = await p.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=sp,
            decode_address=decode_addr, reservation_id=res.reservation_id,
            reserved_blocks=res.num_blocks, decode_kv_spec=res.kv_spec,
            reservation_secret=res.reservation_secret))
        tokens = []
        async for chunk in stream:
            tokens.extend(chunk.token_ids)
        assert tokens[0] == pre.first_token_id
        assert chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
        return tokens


async def _free_blocks(w) -> tuple[int, int]:
    s = await w.stats()
    return s.load.free_blocks, s.load.total_blocks


async def _all_blocks_free(w) -> bool:
    """Whether every block is free and no sequence left within 5 s: freed blocks show in
    the load figures from the engine's next step on."""
    for _ in range(50):
        free, total = await _free_blocks(w)
        if free == total and not w.engine.seqs:
            return True
        await asyncio.sleep(0.1)
    return False


# kv_cache_dtype bfloat16 under the float32 model: half the KV bytes pushed, same flow
@pytest.mark.parametrize("n_prefill,n_decode,kv_dtype", [(1, 1, None), (2, 2, None),
                                                         (1, 1, "bfloat16")])
def test_disaggregated_equals_colocated(tiny_model_dir, n_prefill, n_decode, kv_dtype):
    prompts = _prompts(16)
    reference = [o.token_ids for o in tiny_engine(
        tiny_model_dir, kv_cache_dtype=kv_dtype).generate(prompts, GREEDY)]

    async def main():
        decodes = [await _start("decode", tiny_model_dir, kv_cache_dtype=kv_dtype)
                   for _ in range(n_decode)]
        prefills = [await _start("prefill", tiny_model_dir, max_num_batched_tokens=64,
                                 kv_cache_dtype=kv_dtype) for _ in range(n_prefill)]
        assert decodes[0].engine.kv_spec.dtype == (kv_dtype or "float32")
        try:
            outs = await asyncio.gather(*[
                _disagg_generate(decodes[i % n_decode].address, prefills[i % n_prefill].address,
                                 ids, GREEDY, f"r{i}") for i, ids in enumerate(prompts)])
            for w in decodes + prefills:
                # a worker frees a finished sequence's blocks at its engine's next step
                for _ in range(100):
                    free, total = await _free_blocks(w)
                    if free == total:
                        break
                    await asyncio.sleep(0.05)
                assert free == total
            return outs
        finally:
            for w in decodes + prefills:
                await w.stop(0)

    outs = asyncio.run(main())
    assert outs == reference


def test_kv_cache_dtype_mismatch_refused_and_freed(tiny_model_dir):
    """A float32-cache prefill worker cannot fill a bfloat16-cache decode worker: Prefill
    fails with FAILED_PRECONDITION and the reservation's blocks come back."""
    async def main():
        dec = await _start("decode", tiny_model_dir, kv_cache_dtype="bfloat16")
        pre = await _start("prefill", tiny_model_dir)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _disagg_generate(dec.address, pre.address, _prompts(1)[0], GREEDY, "m0")
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "KV layout differs" in err.value.details()
            for _ in range(50):  # the decode worker frees the reservation on cancel/expiry
                free, total = await _free_blocks(dec)
                if free == total:
                    break
                await asyncio.sleep(0.1)
            assert free == total
        finally:
            await dec.stop(0)
            await pre.stop(0)

    asyncio.run(main())


def test_corrupt_chunk_rejected_other_blocks_untouched(tiny_model_dir):
    """A corrupt chunk and then the stream's end: refused naming crc32c (the verdict of the
    engine thread's checked copy is awaited), the reservation gone, every block free, and
    no block outside the reservation changed (its own may have taken the bad bytes); the
    failed write's outcome is read where it is awaited, not left for the loop to log."""
    async def main():
        unread: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: unread.append(ctx["message"]))
        dec = await _start("decode", tiny_model_dir)
        try:
            before = dec.engine.kv_cache.data.clone()
            async with grpc.aio.insecure_channel(dec.address) as ch:
                d = decode_pb2_grpc.DecodeWorkerStub(ch)
                res = await d.Reserve(decode_pb2.ReserveRequest(
                    request_id="bad", prompt_token_ids=list(range(40)),
                    sampling=GREEDY.to_proto()))
                phys = list(dec.engine.seqs["bad"].block_table)
                from pdserve.kvtransfer.wire import encode_layer
                spec = dec.engine.kv_spec
                k = dec.engine.kv_cache.data[0, 0, :res.num_blocks].clone() + 1
                chunks = list(encode_layer(res.reservation_id, 0, list(range(res.num_blocks)),
                                           k, k.clone()))
                bad = chunks[0]
                payload = bytearray(bad.payload)
                payload[5] ^= 0xFF
                bad.payload = bytes(payload)

                async def msgs():
                    yield kvtransfer_pb2.KVMessage(chunk=bad)

                kv = kvtransfer_pb2_grpc.KVTransferStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await kv.Push(msgs(), metadata=(("x-pdserve-reservation-secret",
                                                     res.reservation_secret),))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith("crc32c"), e.value.details()
                # the reservation is gone: its Decode stream is refused
                await asyncio.sleep(0.2)
                with pytest.raises(grpc.aio.AioRpcError) as e2:
                    async for _ in d.Decode(decode_pb2.DecodeRequest(
                            reservation_id=res.reservation_id)):
                        pass
                assert e2.value.code() == grpc.StatusCode.NOT_FOUND
            assert spec.num_blocks == (await _free_blocks(dec))[0]
            others = [b for b in range(spec.num_blocks) if b not in phys]
            assert torch.equal(dec.engine.kv_cache.data[:, :, others], before[:, :, others])
            gc.collect()
            assert unread == []
        finally:
            await dec.stop(0)

    asyncio.run(main())


def test_reservation_expires_and_exhaustion(tiny_model_dir):
    async def main():
        # 1.5 s: the checks below must run before it ends, on a loaded machine too (0.5 s
        # did not, once, beside a compiler)
        dec = await _start("decode", tiny_model_dir, num_kv_blocks=8, timeout=1.5)
        try:
            async with grpc.aio.insecure_channel(dec.address) as ch:
                d = decode_pb2_grpc.DecodeWorkerStub(ch)
                sp = SamplingParams(max_tokens=8).to_proto()
                await d.Reserve(decode_pb2.ReserveRequest(
                    request_id="a", prompt_token_ids=list(range(60)), sampling=sp))
                assert (await _free_blocks(dec))[0] == 4
                # more than the pool has free -> RESOURCE_EXHAUSTED, immediately
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await d.Reserve(decode_pb2.ReserveRequest(
                        request_id="b", prompt_token_ids=list(range(100)), sampling=sp),
                        timeout=5)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(2.3)  # past the TTL and the sweep after it (TTL / 4)
                assert (await _free_blocks(dec))[0] == 8
                expired = dec.metrics.reservations_expired._value.get()
                assert expired == 1
        finally:
            await dec.stop(0)

    asyncio.run(main())


def test_cancelled_stream_frees_blocks(tiny_model_dir):
    async def main():
        dec = await _start("decode", tiny_model_dir)
        try:
            async with grpc.aio.insecure_channel(dec.address) as ch:
                d = decode_pb2_grpc.DecodeWorkerStub(ch)
                call = d.Generate(decode_pb2.ColocatedGenerateRequest(
                    request_id="long", prompt_token_ids=list(range(30)),
                    sampling=SamplingParams(max_tokens=500, ignore_eos=True,
                                            temperature=0).to_proto()))
                got = 0
                async for chunk in call:
                    got += len(chunk.token_ids)
                    if got >= 3:
                        call.cancel()
                        break
                assert await _all_blocks_free(dec)
                # cancel by request id of a running request ends its stream with "abort"
                call = d.Generate(decode_pb2.ColocatedGenerateRequest(
                    request_id="other", prompt_token_ids=list(range(30)),
                    sampling=SamplingParams(max_tokens=500, ignore_eos=True).to_proto()))
                last = None
                async for chunk in call:
                    if last is None:
                        r = await d.Cancel(decode_pb2.CancelRequest(request_id="other"))
                        assert r.found
                    last = chunk
                assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
                # the stats are refreshed before the abort's last chunk is sent
                free, total = await _free_blocks(dec)
                assert free == total
        finally:
            await dec.stop(0)

    asyncio.run(main())


def test_worker_health_and_reflection(tiny_model_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        dec = await _start("decode", tiny_model_dir)
        try:
            async with grpc.aio.insecure_channel(dec.address) as ch:
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert h.status == health_pb2.HealthCheckResponse.SERVING
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)

                async def ask():
                    yield reflection_pb2.ServerReflectionRequest(list_services="")

                async for resp in stub.ServerReflectionInfo(ask()):
                    names = {s.name for s in resp.list_services_response.service}
                    break
            assert {"pdserve.v1.DecodeWorker", "pdserve.v1.KVTransfer",
                    "grpc.health.v1.Health"} <= names
        finally:
            await dec.stop(0)

    asyncio.run(main())
