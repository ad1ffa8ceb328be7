"""The engine's KV connector: the one door through which KV leaves a prefill engine and
enters a decode engine (the part vLLM's KV connector and SGLang's KV sender/receiver play).

Threads. Every connector method runs on the thread that steps the engine: AsyncEngine's
engine thread in a worker, the caller's own thread for an offline `LLMEngine`. Workers
never call it: they send AsyncEngine commands, which the engine thread applies between
steps in the order they were sent, so no other thread ever touches the cache, the pool or
a sequence. Transports sit outside: a `KVSaver` per request on the save side, the
decode worker's KV sink (fed by the gRPC receiver) on the load side.

Save side (prefill worker), one request:

    add_request(..., kv_saver=S)      S is registered with the request
    the step whose forward completes the prompt:
      after layer l's forward         save_layer(l): the prompt's blocks of layer l are
                                      copied out and handed to S.save_layer at once —
                                      on CUDA gathered and copied device -> pinned host on a
                                      side stream while layer l+1 computes, with an event
                                      the reader waits on; on the CPU a plain copy
      after the forward               step_done(): the compute stream waits for the side
                                      stream, so blocks freed this step are not rewritten
                                      while their copy is in flight
    finish or abort                   request_finished(): S is dropped

Load side (decode worker), one reservation:

    reserve(id, prompt, params)       blocks held by a WAITING_FOR_KV sequence
    write(id, layer, blocks, k, v, crc32c)*
                                      K/V copied into those blocks (logical block indices),
                                      checked against the sender's CRC-32C as they are
                                      copied (see below); a mismatch fails the reservation
    commit(id, first token, lp)       token ids checked against the vocabulary (ValueError,
                                      nothing changed), then the sequence runs next step;
                                      a reservation a write failed into never commits
    | abort(id)                       blocks freed; its stream ends with "abort"
    (expiry of an uncommitted reservation is the decode worker's timer; it ends in abort)

KV that arrives through `write` serves its own request only: it never enters the prefix
cache, nor do the blocks that request computes on top of it (their K/V depend on it).

Unverified bytes. A reservation's blocks come fresh from the pool (`BlockPool.allocate`:
ref count 1, no prefix hash; never matched against the prefix cache) and nothing reads
them before the commit, so `write` copies and checksums in one pass
(`kv_blocks.ingest_blocks`, exclusive): corrupt bytes can land in the reservation's own
blocks, but only there, and that reservation then never commits — its abort frees the
blocks with no hash, and whoever allocates them next overwrites them before reading. Each
write checks that every block it targets is still the reservation's alone (ref count 1,
no hash) and checks before copying when one is not.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.kv_blocks import (
    ChecksumMismatch,
    copy_blocks,
    gather_blocks,
    ingest_blocks,
)
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.protocol import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine, SeqDelta

log = logging.getLogger("pdserve.engine")


@dataclass(frozen=True)
class KVLayerCopy:
    """One layer's K and V of a request's prompt blocks, copied out of the cache."""

    layer: int
    block_indices: tuple[int, ...]  # logical, within the prompt's blocks: 0 .. n-1
    k: torch.Tensor  # [n, block_size, kv_heads, head_dim], host memory
    v: torch.Tensor
    ready: torch.cuda.Event | None = None  # recorded after the copy; None: ready now

    def wait(self) -> None:
        """Block until k and v hold the data (a no-op for a CPU copy)."""
        if self.ready is not None:
            self.ready.synchronize()


@dataclass(frozen=True)
class KVReservation:
    request_id: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int


class KVSaver(ABC):
    """Where one request's KV goes as its prompt completes (a push stream to a decode
    worker).

    Rules: `save_layer` is called on the engine thread, once per layer in layer order,
    during the forward of the step that completes the prompt. It must return at once
    (queue the copy; send it from another thread). The copy's tensors belong to the saver
    from then on, and whichever thread reads them calls `copy.wait()` first. An exception
    drops the saver (logged); the batch keeps running and the transfer stays incomplete,
    which its receiver refuses at commit.
    """

    @abstractmethod
    def save_layer(self, copy: KVLayerCopy) -> None: ...


class KVConnector(ABC):
    """KV in and out of one engine; the module docstring gives the life cycles.

    Rules: every method is called on the engine thread, between steps (load side and
    `add_saver`, `request_finished`) or inside a step (`save_layer`, `step_done`). Load-side
    methods address a reservation by its request id and raise KeyError when it is not
    waiting for KV (unknown, committed, aborted); `write` is applied in the order called
    and must never touch blocks outside the reservation; `commit` raises ValueError (the
    message starting with the field) and changes nothing when the commit is invalid.
    """

    # -- save side --------------------------------------------------------------------------
    @abstractmethod
    def add_saver(self, request_id: str, saver: KVSaver) -> None: ...

    @property
    @abstractmethod
    def saving(self) -> bool:
        """True while some request has a saver (the forward then calls save_layer)."""

    @abstractmethod
    def save_layer(self, layer: int, sampling: list[ScheduledSeq]) -> None:
        """Layer `layer` of this step's forward is done; `sampling` are the sequences whose
        last known token is computed in this step (a prompt completing among them)."""

    @abstractmethod
    def step_done(self) -> None:
        """The forward finished; called before the step frees any block."""

    @abstractmethod
    def request_finished(self, seq: Sequence) -> None: ...

    # -- load side --------------------------------------------------------------------------
    @abstractmethod
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                ) -> KVReservation:
        """ValueError: an invalid request; RuntimeError: no room."""

    @abstractmethod
    def write(self, request_id: str, layer: int, block_indices: Seq[int], k: torch.Tensor,
              v: torch.Tensor, crc32c: int | None = None) -> None:
        """k, v: `[L, n, ...]`, the same blocks of layers `layer` .. `layer + L - 1` (L = 1
        for one layer). crc32c: the CRC-32C of their bytes as the sender stated it, each
        layer's K then V, layer after layer (None: the caller checked them);
        ChecksumMismatch (a ValueError) when they differ."""

    @abstractmethod
    def commit(self, request_id: str, first_token_id: int,
               logprobs: TokenLogprobs | None = None) -> SeqDelta: ...

    @abstractmethod
    def abort(self, request_id: str) -> SeqDelta | None: ...


class PagedKVConnector(KVConnector):
    """The connector over an `LLMEngine`'s paged cache, scheduler and pool."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.kv = engine.kv_cache
        self._savers: dict[str, KVSaver] = {}
        # reservations a write into failed, with why: they never commit
        self._failed: dict[str, Exception] = {}
        data = self.kv.data
        self._side = torch.cuda.Stream(device=data.device) if data.is_cuda else None
        self._copied_this_step = False

    # -- save side --------------------------------------------------------------------------
    def add_saver(self, request_id: str, saver: KVSaver) -> None:
        if request_id not in self.engine.seqs:
            raise KeyError(request_id)
        self._savers[request_id] = saver

    @property
    def saving(self) -> bool:
        return bool(self._savers)

    def save_layer(self, layer: int, sampling: list[ScheduledSeq]) -> None:
        for s in sampling:
            rid = s.seq.request_id
            saver = self._savers.get(rid)
            if saver is None:
                continue
            n = self.engine.pool.blocks_needed(s.seq.num_prompt_tokens)
            k, v, ready = self._copy_out(layer, s.seq.block_table[:n])
            try:
                saver.save_layer(KVLayerCopy(layer, tuple(range(n)), k, v, ready))
            except Exception:
                log.exception("KV saver of %s failed at layer %d; dropped", rid, layer)
                self._savers.pop(rid, None)

    def _copy_out(self, layer: int, block_ids: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        k_src, v_src = self.kv.key(layer), self.kv.value(layer)
        if self._side is None:
            return gather_blocks(k_src, block_ids), gather_blocks(v_src, block_ids), None
        side = self._side
        side.wait_stream(torch.cuda.current_stream(k_src.device))  # layer l's K/V written
        with torch.cuda.stream(side):
            # allocated on the side stream, so the caching allocator keeps them for it
            k_dev, v_dev = gather_blocks(k_src, block_ids), gather_blocks(v_src, block_ids)
            k = torch.empty(k_dev.shape, dtype=k_dev.dtype, pin_memory=True)
            v = torch.empty(v_dev.shape, dtype=v_dev.dtype, pin_memory=True)
            k.copy_(k_dev, non_blocking=True)
            v.copy_(v_dev, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        self._copied_this_step = True
        return k, v, ready

    def step_done(self) -> None:
        if self._copied_this_step:
            assert self._side is not None
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._copied_this_step = False

    def request_finished(self, seq: Sequence) -> None:
        self._savers.pop(seq.request_id, None)
        self._failed.pop(seq.request_id, None)

    # -- load side --------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                ) -> KVReservation:
        seq = self.engine.reserve(request_id, prompt_token_ids, params)
        return KVReservation(request_id, tuple(seq.block_table), seq.num_prompt_tokens)

    def _waiting(self, request_id: str) -> Sequence:
        seq = self.engine.seqs.get(request_id)
        if seq is None or seq.status != SequenceStatus.WAITING_FOR_KV:
            raise KeyError(request_id)
        return seq

    def write(self, request_id: str, layer: int, block_indices: Seq[int], k: torch.Tensor,
              v: torch.Tensor, crc32c: int | None = None) -> None:
        table = self._waiting(request_id).block_table
        if request_id in self._failed:
            return  # it will never commit: spare the copy
        try:
            # numpy for the per-block work: a 4k prompt's chunk names 256 blocks, and this
            # runs once per received chunk on the engine thread
            idx = np.asarray(block_indices, dtype=np.intp)
            if idx.size and (idx.min() < 0 or idx.max() >= len(table)):
                raise IndexError(f"block indices {idx[:8].tolist()} outside the "
                                 f"reservation's {len(table)} blocks")
            phys = np.asarray(table, dtype=np.int64)[idx]
            caches = self.kv.layer_caches(layer, k.shape[0])
            if crc32c is None:
                for (k_dst, v_dst), k_l, v_l in zip(caches, k, v, strict=True):
                    copy_blocks(k_dst, phys, k_l)
                    copy_blocks(v_dst, phys, v_l)
            else:
                ingest_blocks(caches, phys, k, v, crc32c, exclusive=self._held_alone(phys))
        except Exception as e:
            self._failed[request_id] = e
            raise

    def _held_alone(self, block_ids: np.ndarray) -> bool:
        """Every block is held by one sequence only and is not in the prefix cache."""
        blocks = self.engine.pool.blocks
        return all(blocks[b].ref_count == 1 and blocks[b].block_hash is None
                   for b in block_ids.tolist())

    def commit(self, request_id: str, first_token_id: int,
               logprobs: TokenLogprobs | None = None) -> SeqDelta:
        self._waiting(request_id)
        vocab = self.engine.dims.vocab_size
        if not 0 <= first_token_id < vocab:
            raise ValueError(f"first_token_id: {first_token_id} is not in [0, {vocab})")
        if logprobs is not None and any(not 0 <= t < vocab for t, _ in logprobs.top):
            raise ValueError(f"first_token_top_logprobs: token ids must be in [0, {vocab})")
        failed = self._failed.get(request_id)
        if isinstance(failed, ChecksumMismatch):
            raise ValueError(str(failed))  # "crc32c: ...": the sender's bytes were bad
        if failed is not None:
            raise RuntimeError(f"a KV write into the reservation of {request_id!r} failed: "
                               f"{failed!r}")
        return self.engine.commit_remote_kv(request_id, first_token_id, logprobs)

    def abort(self, request_id: str) -> SeqDelta | None:
        return self.engine.abort_request(request_id)
