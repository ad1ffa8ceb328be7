"""The gateway's prefill backlog: a burst waits at the gateway, in order, holding nothing,
and is let through as the prefill tier drains it; the budget follows the measured rate."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway import prefill_backlog
from pdserve.gateway.prefill_backlog import PrefillBacklog


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_burst_waits_in_order_and_enters_as_places_free():
    async def main():
        b = PrefillBacklog(max_tokens=100, max_calls=3)
        order: list[int] = []

        async def one(i: int, n: int) -> None:
            await b.acquire(n, num_workers=1)
            order.append(i)

        tasks = [asyncio.create_task(one(i, 40)) for i in range(5)]
        await _settle()
        assert order == [0, 1] and (b.tokens, b.calls, b.num_waiting) == (80, 2, 3)
        b.release(40)
        await _settle()
        assert order == [0, 1, 2]
        b.release(40)
        b.release(40)
        await _settle()
        assert order == [0, 1, 2, 3, 4] and b.num_waiting == 0
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_one_prompt_always_enters_and_calls_are_capped_per_worker():
    async def main():
        b = PrefillBacklog(max_tokens=10, max_calls=2)
        await b.acquire(500, num_workers=1)  # longer than the budget, but alone: enters
        assert b.calls == 1
        b.release(500)
        for _ in range(4):  # two workers: twice the calls
            await b.acquire(1, num_workers=2)
        waiter = asyncio.create_task(b.acquire(1, num_workers=2))
        await _settle()
        assert not waiter.done() and b.calls == 4
        b.release(1)
        await _settle()
        assert waiter.done() and b.calls == 4

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_and_lets_the_next_in():
    async def main():
        b = PrefillBacklog(max_tokens=100, max_calls=8)
        await b.acquire(60, 1)
        big = asyncio.create_task(b.acquire(90, 1))  # does not fit behind the first
        small = asyncio.create_task(b.acquire(30, 1))  # would fit, but waits its turn
        await _settle()
        assert not big.done() and not small.done()
        big.cancel()
        await _settle()
        assert small.done() and (b.tokens, b.calls, b.num_waiting) == (90, 2, 0)
        with pytest.raises(asyncio.CancelledError):
            await big

    asyncio.run(main())


def test_budget_follows_the_measured_drain_rate(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(prefill_backlog.time, "monotonic", lambda: now[0])

    async def main():
        b = PrefillBacklog(max_tokens=4096, max_calls=64, horizon_s=5.0)
        assert b.drain_rate() is None and b.budget(2) == 8192
        await b.acquire(200, 1)
        now[0] += 2.0  # 200 tokens prefilled in 2 busy seconds: 100 tokens/s
        b.release(200)
        assert b.drain_rate() == pytest.approx(100.0)
        assert b.budget(1) == 500
        now[0] += 60.0  # idle time does not count as drain time
        await b.acquire(300, 1)
        await b.acquire(200, 1)
        third = asyncio.create_task(b.acquire(1, 1))  # 501 > 500: waits
        await _settle()
        assert not third.done()
        now[0] += 1.0
        b.release(300)  # 500 tokens in 3 busy seconds
        await _settle()
        assert third.done() and b.drain_rate() == pytest.approx(500 / 3)

    asyncio.run(main())
