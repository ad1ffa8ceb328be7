"""pdserve.event_loop: the tiers run on uvloop where it is installed, on asyncio's loop when
`PDSERVE_EVENT_LOOP=asyncio` says so."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from pdserve import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_uvloop_by_default(monkeypatch):
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_loop_module()).startswith("uvloop")


def test_asyncio_when_asked(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.loop_name() == "asyncio"
    assert event_loop.run(_loop_module()).startswith("asyncio")
