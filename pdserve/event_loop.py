"""Running a tier's main coroutine: on uvloop where it is installed and not turned off,
on asyncio's own loop otherwise.

The event loops of the gateway and the workers do per-token work (a gRPC message read or
written, an SSE event) on the same cores as the model's threads, so the loop's own cost
per callback shows up in every token's latency. `PDSERVE_EVENT_LOOP=asyncio` keeps the
standard loop (for comparison, or if a library misbehaves on uvloop).

While a tier runs, the interpreter hands the GIL over after SWITCH_INTERVAL_S instead of
CPython's 5 ms (`PDSERVE_SWITCH_INTERVAL`, seconds, overrides it). A decode worker's engine
thread runs Python between its C calls (scheduling, sampling's set-up, handing tokens over)
while the event loop runs the previous token's gRPC write, and gRPC's poller thread wants
the GIL to wake the loop: whichever waits, waits up to the interval behind the other. One
float32 stream through `pdserve up`, 5 ms against 0.2 ms in every tier, six pairs
alternated: served TPOT 9.1-12.0 (mean 10.8) ms against 8.5-10.8 (mean 9.5), lower in
every pair; 64 streams 168-183 against 159-177 ms (docs/benchmarks.md section 6, session
24).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

ENV = "PDSERVE_EVENT_LOOP"
SWITCH_ENV = "PDSERVE_SWITCH_INTERVAL"
SWITCH_INTERVAL_S = 0.0002


def loop_name() -> str:
    """"uvloop" or "asyncio": the loop `run` will use."""
    if os.environ.get(ENV, "").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def switch_interval() -> float:
    """The GIL switch interval a tier runs with: PDSERVE_SWITCH_INTERVAL, else
    SWITCH_INTERVAL_S."""
    text = os.environ.get(SWITCH_ENV, "")
    if not text:
        return SWITCH_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{SWITCH_ENV}: expected seconds > 0, got {text!r}")
    return value


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop `loop_name` names (logged), with the GIL switch
    interval `switch_interval` gives while it runs."""
    name = loop_name()
    try:
        interval, before = switch_interval(), sys.getswitchinterval()
    except ValueError:
        main.close()  # never to run
        raise
    log.info("event loop: %s, GIL switch interval %g s", name, interval)
    sys.setswitchinterval(interval)
    try:
        if name == "uvloop":
            import uvloop

            return uvloop.run(main)
        return asyncio.run(main)
    finally:
        sys.setswitchinterval(before)
