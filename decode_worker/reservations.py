"""ReservationTable: the decode worker's table of open reservations (ids, deadlines) and
the `KVSink` the KV-transfer receiver writes through. It holds no tensors and touches no
engine state: every reserve, write, commit and abort is a command to the engine's KV
connector, applied on the engine thread (`AsyncEngine`).

Life cycle of a reservation (the table's side runs on the event loop thread):

    reserve()      OPEN       the connector holds blocks for a WAITING_FOR_KV sequence; a
                              one-time secret issued, which every KV push into it must show
    write_kv()     OPEN       K/V queued to the engine thread, copied into those blocks and
                              checked against the chunk's CRC-32C there
    commit_kv()    COMMITTED  (awaited) the connector checks the first token and the
                              sequence runs; a refused commit reopens it for the abort
    abort_kv() / release() / expiry   gone: the connector frees the blocks

A reservation leaves the table *before* the engine is told to free its blocks, and the
engine applies commands in the order sent, so a late chunk can never write into blocks
that were handed to someone else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_spec import KVCacheSpec
from pdserve.kvtransfer.sink import KVCommitInfo
from pdserve.protocol import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pdserve.decode")


@dataclass
class _Entry:
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float
    secret: str = ""
    committed: bool = False
    commit: KVCommitInfo | None = None


class ReservationTable:
    def __init__(self, aengine: AsyncEngine, timeout_s: float,
                 on_expired: Callable[[str], None] = lambda rid: None,
                 on_released: Callable[[str], None] = lambda rid: None) -> None:
        """on_released(reservation id): an uncommitted reservation left the table (its KV
        will never commit), whatever the reason."""
        self.aengine = aengine
        self.timeout_s = timeout_s
        self.on_expired = on_expired
        self.on_released = on_released
        self._open: dict[str, _Entry] = {}
        self._by_request: dict[str, str] = {}
        self.commits: dict[str, KVCommitInfo] = {}  # request id -> commit (until it streams)
        self._task: asyncio.Task | None = None
        self._spec = aengine.engine.kv_spec  # immutable: the layout Reserve replies with

    # -- reservations -----------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> tuple[str, int, str]:
        """(reservation id, blocks, secret). ValueError: bad request; RuntimeError: no
        room."""
        res = await self.aengine.reserve(request_id, prompt_token_ids, params)
        rid = uuid.uuid4().hex
        secret = secrets.token_hex(16)  # 128 bits
        self._open[rid] = _Entry(request_id, res.block_ids, time.monotonic() + self.timeout_s,
                                 secret)
        self._by_request[request_id] = rid
        return rid, len(res.block_ids), secret

    def request_id(self, reservation_id: str) -> str | None:
        e = self._open.get(reservation_id)
        return e.request_id if e else None

    def release(self, reservation_id: str, reason: str) -> bool:
        """Forget an uncommitted reservation and free its blocks. False if not open."""
        e = self._open.get(reservation_id)
        if e is None or e.committed:
            return False
        del self._open[reservation_id]
        self._by_request.pop(e.request_id, None)
        log.info("reservation %s released: %s", reservation_id, reason)
        self.on_released(reservation_id)
        asyncio.get_running_loop().create_task(self.aengine.cancel_reservation(e.request_id))
        return True

    def forget(self, reservation_id: str) -> None:
        """Drop a reservation's entry once its Decode stream is done with it."""
        e = self._open.pop(reservation_id, None)
        if e is not None:
            self._by_request.pop(e.request_id, None)

    def num_open(self) -> int:
        return sum(1 for e in self._open.values() if not e.committed)

    # -- KVSink -----------------------------------------------------------------------------
    @property
    def kv_spec(self) -> KVCacheSpec:
        return self._spec

    def reservation_num_blocks(self, reservation_id: str) -> int | None:
        e = self._open.get(reservation_id)
        if e is None or e.committed:
            return None
        return len(e.block_ids)

    def reservation_secret(self, reservation_id: str) -> str | None:
        e = self._open.get(reservation_id)
        return None if e is None or e.committed else e.secret

    def write_kv(self, reservation_id: str, layer: int, block_indices: list[int],
                 k: torch.Tensor, v: torch.Tensor, crc32c: int
                 ) -> concurrent.futures.Future:
        e = self._open.get(reservation_id)
        if e is None or e.committed:
            raise KeyError(reservation_id)
        return self.aengine.write_kv(e.request_id, layer, block_indices, k, v, crc32c)

    async def commit_kv(self, reservation_id: str, commit: KVCommitInfo) -> None:
        e = self._open.get(reservation_id)
        if e is None or e.committed:
            raise KeyError(reservation_id)
        e.committed = True  # neither expires nor takes KV while the engine commits
        self.commits[e.request_id] = commit  # before the first token can reach Decode
        lp = None
        if commit.first_token_logprob is not None:
            lp = TokenLogprobs(commit.first_token_id, commit.first_token_logprob,
                               commit.first_token_top_logprobs)
        task = asyncio.ensure_future(self.aengine.commit(e.request_id, commit.first_token_id,
                                                         lp))
        # registered before the shield's own callback: runs before this coroutine resumes
        task.add_done_callback(lambda t: self._commit_done(e, t))
        # the KV is complete and checked: a cancelled push does not undo its commit
        await asyncio.shield(task)

    def _commit_done(self, e: _Entry, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None:
            # refused: open again, so the receiver's abort (or expiry) frees the blocks
            e.committed = False
            self.commits.pop(e.request_id, None)

    def abort_kv(self, reservation_id: str, reason: str) -> None:
        self.release(reservation_id, reason)

    # -- expiry -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._expire_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            now = time.monotonic()
            for rid, e in list(self._open.items()):
                if not e.committed and now > e.deadline:
                    if self.release(rid, f"not committed within {self.timeout_s:g}s"):
                        self.on_expired(rid)
