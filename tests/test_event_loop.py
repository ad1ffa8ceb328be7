"""pdserve.event_loop: the tiers run on uvloop where it is installed, on asyncio's loop when
`PDSERVE_EVENT_LOOP=asyncio` says so, and with a short GIL switch interval while they run."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

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


async def _interval() -> float:
    return sys.getswitchinterval()


def test_a_short_switch_interval_while_a_tier_runs(monkeypatch):
    monkeypatch.delenv(event_loop.SWITCH_ENV, raising=False)
    before = sys.getswitchinterval()
    assert event_loop.run(_interval()) == pytest.approx(event_loop.SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == before  # given back when the loop ends
    monkeypatch.setenv(event_loop.SWITCH_ENV, "0.005")
    assert event_loop.run(_interval()) == pytest.approx(0.005)


@pytest.mark.parametrize("value", ["0", "-1", "fast"])
def test_a_bad_switch_interval_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(event_loop.SWITCH_ENV, value)
    with pytest.raises(ValueError, match=event_loop.SWITCH_ENV):
        event_loop.run(_interval())
