"""The served path's per-token plumbing: the engine's deltas reach a stream in batches (all
that are queued when the reader comes back), the decode worker sends each batch as one
TokenChunk, and an idle stream still gets its keepalives."""

from __future__ import annotations

import asyncio

from conftest import assert_pool_clean, tiny_engine

from pdserve.decode_worker.reservations import ReservationTable
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.async_engine import AsyncEngine
from pdserve.metrics import TierMetrics, TokenTimer
from pdserve.protocol import SamplingParams

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def _until_finished(aeng: AsyncEngine) -> None:
    for _ in range(600):
        if not aeng.engine.seqs and aeng.stats().running == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine did not finish the request")


def test_queued_deltas_come_as_one_batch_with_the_same_tokens(tiny_model_dir):
    async def main():
        eng = tiny_engine(tiny_model_dir, num_threads=1)
        aeng = AsyncEngine(eng)
        aeng.start()
        try:
            one_by_one = [d async for d in aeng.generate("a", PROMPT, GREEDY)]
            await aeng.add_request("b", PROMPT, GREEDY)
            await _until_finished(aeng)  # every step done before the reader comes
            batches = [b async for b in aeng.stream_batches("b")]
        finally:
            await aeng.stop()
        assert len(batches) == 1 and len(batches[0]) == 12
        assert [d.new_token_ids for d in batches[0]] == [d.new_token_ids for d in one_by_one]
        assert batches[0][-1].finished and not any(d.finished for d in batches[0][:-1])
        assert_pool_clean(eng)

    asyncio.run(main())


def test_idle_stream_gets_empty_batches_then_its_end(tiny_model_dir):
    async def main():
        eng = tiny_engine(tiny_model_dir, num_threads=1)
        aeng = AsyncEngine(eng)
        aeng.start()
        try:
            await aeng.reserve("r", PROMPT, GREEDY)  # KV never comes: the stream is idle
            it = aiter(aeng.stream_batches("r", idle_s=0.05))
            assert await anext(it) == []
            assert await anext(it) == []
            assert await aeng.cancel_reservation("r")
            last = await anext(it)
            assert [d.finish_reason for d in last] == ["abort"]
        finally:
            await aeng.stop()
        assert_pool_clean(eng)

    asyncio.run(main())


def test_decode_worker_sends_queued_tokens_as_one_chunk(tiny_model_dir):
    async def main():
        eng = tiny_engine(tiny_model_dir, num_threads=1)
        aeng = AsyncEngine(eng)
        aeng.start()
        metrics = TierMetrics("tiny", "decode", "d0")
        svc = DecodeService(aeng, ReservationTable(aeng, 30.0), metrics, stats=None,
                            keepalive_s=5.0)
        try:
            await aeng.add_request("c", PROMPT, GREEDY)
            await _until_finished(aeng)
            timer = TokenTimer(metrics, 0.0)
            chunks = [c async for c in svc._stream("c", timer, None)]
        finally:
            await aeng.stop()
        assert len(chunks) == 1
        assert len(chunks[0].token_ids) == 12 and chunks[0].num_output_tokens == 12
        assert chunks[0].finish_reason  # the last delta's reason rides the same message
        assert timer.count == 12

    asyncio.run(main())
