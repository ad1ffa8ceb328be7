"""Running a tier's main coroutine: on uvloop where it is installed and not turned off,
on asyncio's own loop otherwise.

The event loops of the gateway and the workers do per-token work (a gRPC message read or
written, an SSE event) on the same cores as the model's threads, so the loop's own cost
per callback shows up in every token's latency. `PDSERVE_EVENT_LOOP=asyncio` keeps the
standard loop (for comparison, or if a library misbehaves on uvloop).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

ENV = "PDSERVE_EVENT_LOOP"


def loop_name() -> str:
    """"uvloop" or "asyncio": the loop `run` will use."""
    if os.environ.get(ENV, "").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop `loop_name` names (logged)."""
    name = loop_name()
    log.info("event loop: %s", name)
    if name == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
