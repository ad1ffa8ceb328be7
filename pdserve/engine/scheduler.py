"""The continuous-batching scheduler: pure bookkeeping, no tensors.

There is no separate prefill or decode phase: every step, each scheduled sequence's
computed tokens catch up to its tokens by up to the token budget. Per step:

1. Running sequences first, in admission order: a decode takes 1 token of the budget, an
   unfinished prefill the rest of its prompt (chunked to what the budget leaves). When the
   pool cannot hold a sequence's next tokens, the youngest running sequence is preempted
   (its blocks freed, it returns to the head of the queue and is recomputed later) until
   it fits.
2. Then waiting sequences, oldest first, while budget, blocks and `max_num_seqs` allow;
   each first takes what the prefix cache already holds of its prompt.
3. Sequences in WAITING_FOR_KV (disaggregated decode) are never scheduled: they hold
   blocks reserved for KV that another worker pushes, and join `running` on commit.
   Pushed KV serves its own request only: such a sequence enters no block into the
   prefix cache (its later blocks' K/V depend on the pushed ones) until a preemption
   makes it recompute everything here.

While at most `serial_queue` sequences wait, a step prefills one prompt only (the oldest
unfinished): prompts that arrive together then get their first tokens one after another,
where packed into one step they all waited for the step's end, and a prompt that shares a
prefix with the one ahead of it finds that prefix's blocks in the cache instead of computing
them beside it. Past that many the prompts are packed up to the budget, as fewer, larger
steps serve a backlog faster. On a virtual clock (docs/bench/cpu-s31/sched_sim.py;
docs/benchmarks.md section 6, session 34) this raised workload c's share within its SLOs
from 0.906 to 0.969 on one trace and from 0.875 to 0.953 on another (at 1.2x its speed), a
burst of 64 unchanged.

The output lists decodes (1 query token) before prefill chunks, the order the attention
backends expect.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token (so it samples)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)

    @property
    def empty(self) -> bool:
        return not self.scheduled


# Waiting sequences up to which a step prefills one prompt (module doc): c's queue on two
# cores rarely passes it, a burst's does at once. 4 and 2 scored below plain packing on the
# virtual clock (0.891 and 0.906 against 0.906 at the first trace's speed).
SERIAL_QUEUE = 8


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int,
                 serial_queue: int = SERIAL_QUEUE) -> None:
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.serial_queue = serial_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queues -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free_seq(self, seq: Sequence) -> None:
        """Return a sequence's blocks (finished, aborted or preempted)."""
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        assert status.finished
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free_seq(seq)

    # -- reservations for KV pushed by another worker ---------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.pool.blocks_needed(num_tokens))

    def reserve(self, seq: Sequence) -> None:
        """Blocks for the whole prompt, filled by a remote prefill; status WAITING_FOR_KV."""
        seq.block_table = self.pool.allocate(self.pool.blocks_needed(seq.num_prompt_tokens))
        seq.status = SequenceStatus.WAITING_FOR_KV

    def commit_remote_kv(self, seq: Sequence) -> None:
        """The prompt's KV has arrived: the sequence joins the running batch next step."""
        assert seq.status == SequenceStatus.WAITING_FOR_KV
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        seq.remote_kv = True
        self.running.append(seq)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chosen: list[ScheduledSeq] = []
        serial = len(self.waiting) <= self.serial_queue
        prefilling = False  # a prompt's chunk is in this step

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0 or (serial and prefilling and n > 1):
                i += 1
                continue
            prefilling = prefilling or n > 1
            if not self._grow_or_preempt(seq, n, out):
                break  # seq itself was preempted; everything after it already was
            chosen.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if serial and prefilling and seq.num_uncomputed_tokens > 1:
                break
            if not seq.block_table:
                self._take_prefix_hits(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            need = self.pool.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
            if not self.pool.can_allocate(need):
                # don't sit on prefix blocks while waiting: they may be what others need
                self._drop_prefix_hits(seq)
                break
            seq.block_table += self.pool.allocate(need)
            self.pool.record_prefix_query(seq.num_tokens, seq.num_cached_tokens)
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append(ScheduledSeq(seq, n))
            budget -= n
            prefilling = prefilling or n > 1

        out.scheduled = ([s for s in chosen if s.num_new_tokens == 1]
                         + [s for s in chosen if s.num_new_tokens > 1])
        return out

    def _grow_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        need = self.pool.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
        while not self.pool.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table += self.pool.allocate(need)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.remote_kv = False  # recomputed here from its tokens on resume
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _take_prefix_hits(self, seq: Sequence) -> None:
        # Leave at least one token to compute: its logits give the next token.
        tokens = seq.all_token_ids
        max_blocks = (len(tokens) - 1) // self.pool.block_size
        hits = self.pool.match_prefix(tokens, max_blocks)
        seq.block_table = hits
        seq.num_computed_tokens = len(hits) * self.pool.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.num_registered_blocks = len(hits)

    def _drop_prefix_hits(self, seq: Sequence) -> None:
        self.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def after_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Advance computed counts and enter newly full blocks into the prefix cache."""
        self.advance(scheduled)
        self.register_computed(scheduled)

    def advance(self, scheduled: list[ScheduledSeq]) -> None:
        """The step's tokens count as computed (overlap: as soon as it is launched, so the
        next step is scheduled after it)."""
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens

    def register_computed(self, scheduled: list[ScheduledSeq]) -> None:
        """Enter blocks the step filled into the prefix cache (overlap: once its results are
        in, when every token it computed is known). Finished sequences hold no blocks."""
        for s in scheduled:
            if not s.seq.is_finished:
                self._register_full_blocks(s.seq)

    def _register_full_blocks(self, seq: Sequence) -> None:
        if seq.remote_kv:
            return
        full = seq.num_computed_tokens // self.pool.block_size
        if full > seq.num_registered_blocks:
            self.pool.register_full_blocks(seq.block_table, seq.all_token_ids,
                                           seq.num_registered_blocks, full)
            seq.num_registered_blocks = full
