"""Overlap scheduling: the engine schedules and prepares step N+1 while step N runs, so the
host is off the device's critical path in a steady decode batch (what SGLang and
mini-sglang call "one batch ahead" and vLLM "async scheduling").

One `OverlapStepper.step()` call, with step N launched by the call before it:

    1. schedule N+1        N's sampled tokens are not known yet: each sequence that samples
                           in N carries a placeholder token (`PLACEHOLDER`) as its last token
                           and N's tokens already count as computed, so the scheduler sees
                           the state after N
    2. prepare N+1         host metadata and sampling parameters; a placeholder input is
                           read on the device from N's sampler output (`PendingInputs`)
    3. wait for N          its sampled ids (one pinned copy); placeholders replaced, full
                           blocks entered in the prefix cache, stop / length checks, finished
                           sequences' blocks freed — N's deltas
    4. launch N+1          then its tokens count as computed and its placeholders appended
    5. return N's deltas   (AsyncEngine applies commands while N+1 runs)

On the CPU `launch` finishes before it returns, so the same steps run synchronously (and
are tested there). The edges:

- A sequence that finishes in N (stop token) was already scheduled into N+1: its row of
  N+1 is computed and thrown away. Its blocks are freed in step 3; N+1 writes its K/V into
  one of them, queued before any later step or KV write that could reuse the block.
- A sequence sure to finish in N (max_tokens, context length, prefill-only) gets no
  placeholder, so it is not scheduled into N+1 at all.
- An abort while N runs drops the sequence's placeholder (`forget`); N's row is ignored.
- A sequence preempted by N+1's schedule keeps its token from N (it resumes with it).
- Penalties read the token values of the output: when N+1 has such a row whose token N
  samples, step 3 runs before step 2 (that step is not overlapped).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.model_runner import PendingInputs, StepHandle
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine, SeqDelta

# the token of a sequence that the running step samples; never fed to the model (the runner
# gathers the real one on the device), and an embedding lookup fails loudly on it
PLACEHOLDER = -1


@dataclass(frozen=True)
class InFlight:
    """A launched step whose results the host has not read."""

    handle: StepHandle
    sched: SchedulerOutput
    # request id -> row of the step's sampler output, for sequences given a placeholder
    pending: dict[str, int]


@dataclass(frozen=True)
class _Published:
    """A step whose results a call published: what the engine's counters record of it."""

    sched: SchedulerOutput
    forward_s: float
    used_slots: int
    allocated_slots: int


class OverlapStepper:
    """Steps an LLMEngine one batch ahead (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None
        self._published: _Published | None = None

    def has_inflight(self) -> bool:
        return self.inflight is not None

    def drain(self) -> list[SeqDelta]:
        """Wait for the step in flight and publish it (before turning overlap off)."""
        return self._timed(self._finish)

    def forget(self, seq: Sequence) -> None:
        """An aborted sequence: drop its placeholder (the running step's row is ignored)."""
        f = self.inflight
        if f is not None and f.pending.pop(seq.request_id, None) is not None:
            assert seq.output_token_ids[-1] == PLACEHOLDER
            seq.output_token_ids.pop()

    def step(self) -> list[SeqDelta]:
        return self._timed(self._step)

    def _timed(self, fn: Callable[[], list[SeqDelta]]) -> list[SeqDelta]:
        """Run fn; the call's whole time counts as the time of the step it publishes (the
        sums stay the engine's busy time)."""
        t0 = time.perf_counter()
        self._published = None
        try:
            deltas = fn()
        except BaseException:
            self._drop_placeholders()
            self.inflight = None
            raise
        p = self._published
        if p is not None:
            self.engine._record_step(p.sched, deltas, p.forward_s, time.perf_counter() - t0,
                                     p.used_slots, p.allocated_slots)
        return deltas

    def _step(self) -> list[SeqDelta]:
        eng = self.engine
        sched = eng.scheduler.schedule()
        deltas: list[SeqDelta] = []
        if self._needs_history(sched.scheduled):
            deltas = self._finish()
            sched.scheduled = [s for s in sched.scheduled if not s.seq.is_finished]
        if sched.empty:
            return deltas + self._finish()
        conn = eng.kv_connector
        plan = eng.runner.prepare_step(sched.scheduled, conn.save_layer if conn.saving else None,
                                       self._pending_inputs(sched.scheduled))
        deltas += self._finish()
        try:
            handle = eng.runner.launch(plan)
        finally:
            conn.step_done()  # copies of this step's KV are done before any block is freed
        # a sequence finished in N keeps its row of N+1, but nothing more happens to it
        live = [s for s in sched.scheduled if not s.seq.is_finished]
        eng.scheduler.advance(live)
        pending = {}
        for row, s in enumerate(plan.sampling):
            seq = s.seq
            if not seq.is_finished and not self._finishes_surely(seq):
                seq.output_token_ids.append(PLACEHOLDER)
                pending[seq.request_id] = row
        self.inflight = InFlight(handle, sched, pending)
        return deltas

    def _finish(self) -> list[SeqDelta]:
        """Wait for the step in flight and publish it: step 3 of the module docstring."""
        f, self.inflight = self.inflight, None
        if f is None:
            return []
        eng = self.engine
        results = eng.runner.wait(f.handle)
        for seq_id in f.pending:  # the real tokens replace the placeholders below
            seq = eng.seqs[seq_id]
            assert seq.output_token_ids[-1] == PLACEHOLDER
            seq.output_token_ids.pop()
        scheduled = f.sched.scheduled
        eng.scheduler.register_computed(scheduled)
        live = [s for s in scheduled if not s.seq.is_finished]
        used = sum(s.seq.num_computed_tokens for s in live)
        allocated = sum(len(s.seq.block_table) for s in live) * eng.pool.block_size
        deltas = [eng._append_token(s.seq, tok, lp) for s, tok, lp in results
                  if not s.seq.is_finished]
        self._published = _Published(f.sched, eng.runner.last_timing.forward_s, used, allocated)
        return deltas

    def _pending_inputs(self, scheduled: list[ScheduledSeq]) -> PendingInputs | None:
        f = self.inflight
        if f is None or not f.pending:
            return None
        rows, flat = [], 0
        for s in scheduled:
            src = f.pending.get(s.seq.request_id)
            if src is not None:
                assert s.num_new_tokens == 1  # only the last token can be a placeholder
                rows.append((flat, src))
            flat += s.num_new_tokens
        if not rows:
            return None
        assert f.handle.packed is not None
        return PendingInputs(f.handle.packed, tuple(rows))

    def _needs_history(self, scheduled: list[ScheduledSeq]) -> bool:
        """A row whose sampling reads the output's token values samples after a placeholder."""
        f = self.inflight
        if f is None or not f.pending:
            return False
        for s in scheduled:
            p = s.seq.params
            if s.seq.request_id in f.pending and p.penalized:
                return True
        return False

    def _finishes_surely(self, seq: Sequence) -> bool:
        """True when the token being sampled ends the sequence whatever it is."""
        p = seq.params
        return (seq.prefill_only or seq.num_output_tokens + 1 >= p.max_tokens
                or seq.num_tokens + 1 >= self.engine.max_model_len)

    def _drop_placeholders(self) -> None:
        f = self.inflight
        if f is None:
            return
        for seq_id in list(f.pending):
            seq = self.engine.seqs.get(seq_id)
            if seq is not None:
                self.forget(seq)
