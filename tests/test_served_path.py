"""The served path's per-token plumbing: the engine's deltas reach a stream in batches (all
that are queued when the reader comes back), the decode worker sends each batch as one
TokenChunk, and an idle stream still gets its keepalives, which never come before tokens
that are queued; with a stream interval, tokens go out that many at a time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import pytest
from conftest import assert_pool_clean, tiny_engine

from pdserve.bench.thread_cpu import cpu_between, threads_cpu
from pdserve.decode_worker.reservations import ReservationTable
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.async_engine import AsyncEngine
from pdserve.metrics import TierMetrics, TokenTimer
from pdserve.os_thread import ENGINE_THREAD_NAME
from pdserve.protocol import SamplingParams

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@contextlib.asynccontextmanager
async def _running(tiny_model_dir):
    """A started AsyncEngine on the tiny model (one thread), stopped on the way out."""
    aeng = AsyncEngine(tiny_engine(tiny_model_dir, num_threads=1))
    aeng.start()
    try:
        yield aeng
    finally:
        await aeng.stop()


async def _until_finished(aeng: AsyncEngine) -> None:
    for _ in range(600):
        if not aeng.engine.seqs and aeng.stats().running == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine did not finish the request")


def test_queued_deltas_come_as_one_batch_with_the_same_tokens(tiny_model_dir):
    async def main():
        async with _running(tiny_model_dir) as aeng:
            one_by_one = [d async for d in aeng.generate("a", PROMPT, GREEDY)]
            await aeng.add_request("b", PROMPT, GREEDY)
            await _until_finished(aeng)  # every step done before the reader comes
            batches = [b async for b in aeng.stream_batches("b")]
        assert len(batches) == 1 and len(batches[0]) == 12
        assert [d.new_token_ids for d in batches[0]] == [d.new_token_ids for d in one_by_one]
        assert batches[0][-1].finished and not any(d.finished for d in batches[0][:-1])
        assert_pool_clean(aeng.engine)

    asyncio.run(main())


def test_idle_stream_gets_empty_batches_then_its_end(tiny_model_dir):
    async def main():
        async with _running(tiny_model_dir) as aeng:
            await aeng.reserve("r", PROMPT, GREEDY)  # KV never comes: the stream is idle
            it = aiter(aeng.stream_batches("r", idle_s=0.05))
            assert await anext(it) == []
            assert await anext(it) == []
            assert await aeng.cancel_reservation("r")
            last = await anext(it)
            assert [d.finish_reason for d in last] == ["abort"]
        assert_pool_clean(aeng.engine)

    asyncio.run(main())


def test_decode_worker_sends_queued_tokens_as_one_chunk(tiny_model_dir):
    async def main():
        async with _running(tiny_model_dir) as aeng:
            metrics = TierMetrics("tiny", "decode", "d0")
            svc = DecodeService(aeng, ReservationTable(aeng, 30.0), metrics, stats=None,
                                keepalive_s=5.0)
            await aeng.add_request("c", PROMPT, GREEDY)
            await _until_finished(aeng)
            timer = TokenTimer(metrics, 0.0)
            chunks = [c async for c in svc._stream("c", timer, None)]
        assert len(chunks) == 1
        assert len(chunks[0].token_ids) == 12 and chunks[0].num_output_tokens == 12
        assert chunks[0].finish_reason  # the last delta's reason rides the same message
        assert timer.count == 12

    asyncio.run(main())


def test_keepalives_give_way_to_queued_tokens(tiny_model_dir):
    async def main():
        async with _running(tiny_model_dir) as aeng:
            await aeng.add_request("k", PROMPT, LONG)
            it = aiter(aeng.stream_batches("k", idle_s=0.05))
            first = await anext(it)  # the stream's idle timer runs from here
            await _until_finished(aeng)
            await asyncio.sleep(0.3)  # several idle periods with every token queued
            rest = [b async for b in it]
        batches = [first, *rest]
        assert all(batches), "an empty batch came while tokens were queued"
        ids = [t for b in batches for d in b for t in d.new_token_ids]
        assert len(ids) == LONG.max_tokens and batches[-1][-1].finished
        assert len(first) < LONG.max_tokens  # the rest waited through the idle periods
        assert_pool_clean(aeng.engine)

    asyncio.run(main())


def test_the_engine_thread_has_a_kernel_name_and_its_cpu_is_counted(tiny_model_dir):
    async def main():
        async with _running(tiny_model_dir) as aeng:
            before = threads_cpu(os.getpid())
            assert [d async for d in aeng.generate("n", PROMPT, GREEDY)][-1].finished
            after = threads_cpu(os.getpid())
        return cpu_between(before, after)

    spent = asyncio.run(main())
    engine = [t for t in spent if t.name == ENGINE_THREAD_NAME]
    assert engine and sum(t.cpu_s for t in engine) > 0  # 12 tokens took it some time
    main_tid = threading.main_thread().native_id
    assert all(t.name != ENGINE_THREAD_NAME for t in spent if t.tid == main_tid)


def test_a_stream_interval_sends_tokens_n_at_a_time(tiny_model_dir):
    async def main():
        async with _running(tiny_model_dir) as aeng:
            metrics = TierMetrics("tiny", "decode", "d0")
            with pytest.raises(ValueError, match="stream_interval"):
                DecodeService(aeng, ReservationTable(aeng, 30.0), metrics, stats=None,
                              stream_interval=0)
            svc = DecodeService(aeng, ReservationTable(aeng, 30.0), metrics, stats=None,
                                keepalive_s=5.0, stream_interval=4)
            plain = [t async for d in aeng.generate("p", PROMPT, LONG) for t in d.new_token_ids]
            await aeng.add_request("s", PROMPT, LONG)
            timer = TokenTimer(metrics, 0.0)
            chunks = [c async for c in svc._stream("s", timer, None)]
        return plain, chunks, timer

    plain, chunks, timer = asyncio.run(main())
    sizes = [len(c.token_ids) for c in chunks]
    assert [t for c in chunks for t in c.token_ids] == plain  # the same tokens, in order
    assert chunks[-1].finish_reason and not any(c.finish_reason for c in chunks[:-1])
    # the first token goes at once; between it and the end, four or more to a message
    assert all(n >= 4 for n in sizes[1:-1]), sizes
    assert len(chunks) <= 2 + LONG.max_tokens // 4 and timer.count == LONG.max_tokens


def test_tokens_per_s_counts_the_window_and_forgets_what_left_it(tiny_model_dir, monkeypatch):
    """EngineStats.tokens_per_s: the tokens delivered over the last RATE_WINDOW_S, per
    second; back to 0 once they are older, and right again for the next request."""
    window = 1.0
    monkeypatch.setattr(AsyncEngine, "RATE_WINDOW_S", window)

    async def rate_becomes(aeng: AsyncEngine, want: float) -> None:
        for _ in range(100):  # an idle engine takes a snapshot every 0.5 s
            if aeng.stats().tokens_per_s == pytest.approx(want):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"tokens_per_s {aeng.stats().tokens_per_s}, want {want}")

    async def main():
        async with _running(tiny_model_dir) as aeng:
            for rid in ("a", "b"):
                assert len([d async for d in aeng.generate(rid, PROMPT, GREEDY)]) == 12
                await rate_becomes(aeng, 12 / window)
                await rate_becomes(aeng, 0.0)

    asyncio.run(main())


def test_a_colocated_stream_keeps_alive_while_the_engine_is_mid_step(tiny_model_dir):
    """The engine thread takes a new request between steps. Behind a long one (a big prefill
    chunk on a slow CPU: bfloat16 without native support took >10 s a step) the stream still
    sends its keepalives, and the gateway does not take the wait for a stall; a stream that
    leaves during the wait takes its request back out of the engine."""
    from pdserve.protos.pdserve.v1 import decode_pb2

    async def main():
        async with _running(tiny_model_dir) as aeng:
            svc = DecodeService(aeng, ReservationTable(aeng, 30.0),
                                TierMetrics("tiny", "decode", "d0"), stats=None,
                                keepalive_s=0.1)

            def busy() -> asyncio.Future:
                # a command holds the engine thread 0.7 s, as a long step would
                return asyncio.ensure_future(aeng._call(lambda: time.sleep(0.7)))

            step = busy()
            await asyncio.sleep(0.05)
            req = decode_pb2.ColocatedGenerateRequest(request_id="g", prompt_token_ids=PROMPT,
                                                      sampling=GREEDY.to_proto())
            chunks = [c async for c in svc.generate_chunks(req)]
            await step
            first = next(i for i, c in enumerate(chunks) if c.token_ids)
            assert first >= 4 and not any(c.token_ids or c.finish_reason
                                          for c in chunks[:first])
            assert sum(len(c.token_ids) for c in chunks) == 12 and chunks[-1].finish_reason

            step = busy()
            await asyncio.sleep(0.05)
            gen = svc.generate_chunks(decode_pb2.ColocatedGenerateRequest(
                request_id="left", prompt_token_ids=PROMPT, sampling=LONG.to_proto()))
            assert not (await anext(gen)).token_ids  # a keepalive, while the add waits
            await gen.aclose()
            await step
            await _until_finished(aeng)
            assert "left" not in aeng.engine.seqs
        assert_pool_clean(aeng.engine)

    asyncio.run(main())
