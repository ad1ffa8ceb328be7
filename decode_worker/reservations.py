"""ReservationTable: the decode worker's side of a KV transfer — the `KVSink` the
KV-transfer receiver writes through.

Life cycle of a reservation (all on the event loop thread):

    reserve()      OPEN       blocks held by a WAITING_FOR_KV sequence in the engine; a
                              one-time secret issued, which every KV push into it must show
    write_kv()     OPEN       K/V copied straight into those blocks (nobody else reads them)
    commit_kv()    COMMITTED  the engine appends the first token; the sequence runs
    abort_kv() / release() / expiry   gone: the engine frees the blocks

A reservation leaves the table *before* the engine is told to free its blocks, so a late
chunk can never write into blocks that were handed to someone else.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_cache import KVCacheSpec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprobs
from pdserve.kvtransfer.blocks import copy_blocks
from pdserve.kvtransfer.sink import KVCommitInfo

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
                 on_expired: Callable[[str], None] = lambda rid: None) -> None:
        self.aengine = aengine
        self.timeout_s = timeout_s
        self.on_expired = on_expired
        self._open: dict[str, _Entry] = {}
        self._by_request: dict[str, str] = {}
        self.commits: dict[str, KVCommitInfo] = {}  # request id -> commit (until it streams)
        self._task: asyncio.Task | None = None
        kv = aengine.engine.kv_cache
        self._kv = kv

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
        return self._kv.spec

    def reservation_num_blocks(self, reservation_id: str) -> int | None:
        e = self._open.get(reservation_id)
        if e is None or e.committed:
            return None
        return len(e.block_ids)

    def reservation_secret(self, reservation_id: str) -> str | None:
        e = self._open.get(reservation_id)
        return None if e is None or e.committed else e.secret

    def write_kv(self, reservation_id: str, layer: int, block_indices: list[int],
                 k: torch.Tensor, v: torch.Tensor) -> None:
        e = self._open.get(reservation_id)
        if e is None or e.committed:
            raise KeyError(reservation_id)
        phys = [e.block_ids[i] for i in block_indices]
        copy_blocks(self._kv.data[layer, 0], phys, k)
        copy_blocks(self._kv.data[layer, 1], phys, v)

    def commit_kv(self, reservation_id: str, commit: KVCommitInfo) -> None:
        e = self._open[reservation_id]
        e.committed = True
        self.commits[e.request_id] = commit
        lp = None
        if commit.first_token_logprob is not None:
            lp = TokenLogprobs(commit.first_token_id, commit.first_token_logprob,
                               commit.first_token_top_logprobs)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.aengine.commit(e.request_id, commit.first_token_id, lp))
        task.add_done_callback(lambda t: t.exception() and log.error(
            "commit of %s failed: %s", e.request_id, t.exception()))

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
