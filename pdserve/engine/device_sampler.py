"""The device sampler: the whole batch sampled on the logits' device, one copy to the host.

Per-row parameters live in persistent tensors (`SamplingBuffers`, max-sized, filled in place
each step), so the same code runs eagerly and inside a captured CUDA graph: no host sync,
no data-dependent shape. The rules are those of the reference sampler (`sampler.py`):
penalties -> min_tokens ban -> greedy argmax | temperature -> top-k -> top-p -> min-p ->
exponential race with `sampling_noise`; logprobs of the raw distribution.

`SampleFlags` says which of those stages a step needs. Eagerly a step runs only those (a CPU
step should not sort the vocabulary for a batch of greedy rows); a captured graph runs
`SampleFlags.ALL`, where every stage is a no-op for the rows that do not use it. On the CPU,
float32 rows go from temperature to the race in one C call (cpu_kernels/sampling_filter.c,
which sorts only each row's candidates); the torch stages here are its definition.

On the CPU penalties and bans touch only the (row, token) pairs they concern
(`TouchedTokens`), taken from per-request tables carried across steps (`PenaltyTables`), and
are applied in the logits themselves, put back once the tokens are drawn; a captured graph
uses dense [rows, vocab] tensors instead.

The result of a step is ONE float64 tensor [rows, 2 + 2K] (token id, its logprob, K top
logprobs, their ids — float64 holds every id exactly), copied once to a pinned host buffer,
non-blocking, and synchronised once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.sampler import SampleRow, min_p_filter, min_p_threshold
from pdserve.engine.sampling_noise import exponential_race, row_keys, row_seed
from pdserve.protocol import SamplingParams, TokenLogprobs

MAX_LOGPROBS = 20  # SamplingParams.logprobs' bound; what a captured step computes

# columns of SamplingBuffers.floats / .ints (_MIN_P_LOG: min_p_threshold of _MIN_P)
_TEMP, _TOP_P, _MIN_P, _REP, _PRES, _FREQ, _GREEDY, _MIN_P_LOG = range(8)
_TOP_K, _SEED, _POS = range(3)


@dataclass(frozen=True)
class SampleFlags:
    """Which sampling stages a step runs (all of them in a captured graph)."""

    penalties: bool = False  # repetition / presence / frequency
    ban: bool = False  # min_tokens not reached: EOS and stop ids masked
    random: bool = False  # some row is not greedy
    sort: bool = False  # some row uses top-k or top-p
    min_p: bool = False
    logprobs: int = 0  # top logprobs computed per row (0: only the sampled token's)
    any_logprobs: bool = False
    greedy: bool = True  # some row is greedy (its argmax taken)

    @staticmethod
    def of(rows: list[SampleRow], vocab: int) -> SampleFlags:
        ps = [r.params for r in rows]
        return SampleFlags(
            penalties=any(p.penalized for p in ps),
            ban=any(len(r.output_token_ids) < r.params.min_tokens for r in rows),
            random=any(not p.greedy for p in ps),
            sort=any(not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0) for p in ps),
            min_p=any(not p.greedy and p.min_p > 0.0 for p in ps),
            logprobs=max((p.logprobs or 0 for p in ps), default=0),
            any_logprobs=any(p.logprobs is not None for p in ps),
            greedy=any(p.greedy for p in ps),
        )


SampleFlags.ALL = SampleFlags(True, True, True, True, True, MAX_LOGPROBS, True, True)


def _touched_lists(rows: list[SampleRow], vocab: int) -> tuple[list[int], ...]:
    """(row, token) pairs as parallel lists: seen tokens of rows with a repetition penalty
    (prompt and output, once each), output tokens of rows with a presence or frequency
    penalty (once per occurrence), banned ids of rows short of min_tokens. The dense path's
    (a captured graph's tensors), rebuilt every step from each row's whole history."""
    seen_r, seen_t, out_r, out_t, ban_r, ban_t = [], [], [], [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            toks = set(r.prompt_token_ids) | set(r.output_token_ids)
            seen_t.extend(t for t in toks if t < vocab)
            seen_r.extend([i] * (len(seen_t) - len(seen_r)))
        if p.presence_penalty or p.frequency_penalty:
            out_t.extend(t for t in r.history if t < vocab)
            out_r.extend([i] * (len(out_t) - len(out_r)))
        if len(r.output_token_ids) < p.min_tokens:
            ban_t.extend(t for t in (*r.eos_token_ids, *p.stop_token_ids) if t < vocab)
            ban_r.extend([i] * (len(ban_t) - len(ban_r)))
    return seen_r, seen_t, out_r, out_t, ban_r, ban_t


@dataclass(frozen=True)
class TouchedTokens:
    """A CPU step's penalties and bans as flat indices into its [rows, vocab] logits
    (row * vocab + token): every (row, token) pair a penalty touches, once, with its row and
    its count in the row's output history; and the banned pairs.

    One pair per distinct token of a row, whichever penalties the row has: a row without a
    repetition penalty has 1.0 there (x / 1 and x * 1 are x), one without presence and
    frequency has 0 and 0 (x - (0 * c + 0 * b) is x, -0.0 included), so the one formula
    over all pairs gives, pair by pair, what the dense formula gives."""

    pairs: torch.Tensor  # int64 [P], distinct
    rows: torch.Tensor  # int64 [P]: the pair's row (of the logits and of SamplingBuffers)
    counts: torch.Tensor  # float32 [P]: occurrences in the output history (0: seen only)
    banned: torch.Tensor  # int64 [B], distinct
    repetition: bool  # some row has a repetition penalty (else that stage is skipped)
    counting: bool  # some row has a presence or frequency penalty


@dataclass(eq=False)
class _PenaltyTable:
    """One request's penalised tokens, carried from step to step: its distinct tokens (prompt
    and output with a repetition penalty, else the output history) and each one's count in
    the output history, in arrays grown by doubling; the first `read` output tokens are in.

    It is the table of these lists and parameters (`advance` checks identity): the engine
    hands every step the request's own `Sequence` lists, which only grow at the end."""

    prompt: list[int]
    output: list[int]
    params: SamplingParams
    counting: bool  # presence / frequency: output tokens are counted
    tokens: np.ndarray  # int64 [capacity], the first `size` in use
    counts: np.ndarray  # float32 [capacity]
    size: int
    slot: dict[int, int]  # token -> its index in `tokens`
    read: int  # len(output) when last read
    last: int | None  # output[read - 1] then

    @staticmethod
    def of(row: SampleRow, vocab: int) -> _PenaltyTable:
        """The table from the row's whole history (a request's first step with its table,
        or one whose output changed other than by appending): one `unique` over the
        seen-only tokens (the prompt, with a repetition penalty) and the counted ones."""
        p, out = row.params, row.output_token_ids
        counting = bool(p.presence_penalty or p.frequency_penalty)
        seen = np.array(row.prompt_token_ids if p.repetition_penalty != 1.0 else [],
                        dtype=np.int64)
        # counting: the output history (a migrated request's tail of the prompt included)
        tail = np.array(row.history if counting else out, dtype=np.int64)
        tokens, inverse = np.unique(np.concatenate([seen, tail]), return_inverse=True)
        counts = (np.bincount(inverse[len(seen):], minlength=len(tokens)) if counting
                  else np.zeros(len(tokens), dtype=np.int64))
        keep = (tokens >= 0) & (tokens < vocab)  # an overlap placeholder is no token
        tokens, counts = tokens[keep], counts[keep]
        n = len(tokens)
        cap = max(16, 2 * n)
        table = _PenaltyTable(row.prompt_token_ids, out, p, counting,
                              np.zeros(cap, dtype=np.int64), np.zeros(cap, dtype=np.float32),
                              n, dict(zip(tokens.tolist(), range(n))), len(out),
                              out[-1] if out else None)
        table.tokens[:n], table.counts[:n] = tokens, counts
        return table

    def advance(self, row: SampleRow, vocab: int) -> bool:
        """Read the output tokens appended since the last step; False (nothing read: build
        the row's table anew) when this is not the row's table or its output changed other
        than by appending: the request left and another took its lists' place, or an overlap
        placeholder that was read has been replaced (a penalised row never samples after one,
        see overlap.py)."""
        out = row.output_token_ids
        if (out is not self.output or row.prompt_token_ids is not self.prompt
                or row.params is not self.params or len(out) < self.read
                or (self.read and out[self.read - 1] != self.last)):
            return False
        if len(out) == self.read:
            return True
        for t in out[self.read:]:  # one token a decode step
            if not 0 <= t < vocab:  # not a token (an overlap placeholder)
                continue
            i = self.slot.get(t)
            if i is None:
                i = self.size
                if i == len(self.tokens):
                    self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
                    self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
                self.tokens[i] = t
                self.slot[t] = i
                self.size = i + 1
            if self.counting:
                self.counts[i] += 1
        self.read, self.last = len(out), out[-1]
        return True


class PenaltyTables:
    """The CPU's penalty state: one `_PenaltyTable` per request with a penalty in the last
    step, so that a step reads only the tokens appended since the one before.

    Rebuilding each row's seen set and output counts from its whole history every step, as
    lists, then tensors, then a `unique`, grew with the history: with the clone of the
    logits 7-20 ms a step for 64 rows of ~300 tokens; with the tables a step reads one token
    a row and concatenates the rows' arrays, 0.7-1.5 ms with the in-place penalties
    (docs/bench/cpu-s24/penalty_calls.txt). A table built from a whole history (`cold`
    there) costs about what a step cost before, once per request.

    Keyed by the row's output list: the request's own (`Sequence.output_token_ids`), held by
    its table, so no other list has its id while the table lives. Eviction is by step:
    `touched` keeps the tables of its own rows and drops every other, so a request that
    finished, was aborted or preempted, or skipped a step loses its table at the next step
    (rebuilt from its lists when it samples again). At most one step's rows are held,
    whatever happens to the requests, and no engine path has to remember to drop one."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._tables: dict[int, _PenaltyTable] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        self._tables = {}

    def touched(self, rows: list[SampleRow]) -> TouchedTokens:
        """The step's pairs (`TouchedTokens`); the tables of `rows` updated, others dropped."""
        vocab = self.vocab
        kept: dict[int, _PenaltyTable] = {}
        where: list[int] = []
        tokens: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        sizes: list[int] = []
        banned: list[int] = []
        repetition = counting = False
        for i, r in enumerate(rows):
            p = r.params
            if p.penalized:
                key = id(r.output_token_ids)
                table = self._tables.get(key)
                if table is None or not table.advance(r, vocab):
                    table = _PenaltyTable.of(r, vocab)
                kept[key] = table
                repetition = repetition or p.repetition_penalty != 1.0
                counting = counting or table.counting
                if table.size:
                    where.append(i)
                    tokens.append(table.tokens[:table.size])
                    counts.append(table.counts[:table.size])
                    sizes.append(table.size)
            if len(r.output_token_ids) < p.min_tokens:
                base = i * vocab
                banned.extend(base + t for t in dict.fromkeys((*r.eos_token_ids,
                                                               *p.stop_token_ids))
                              if 0 <= t < vocab)
        self._tables = kept
        if sizes:  # concatenate copies: the tables change in place next step
            at = np.repeat(np.array(where, dtype=np.int64), sizes)
            tok, cnt = np.concatenate(tokens), np.concatenate(counts)
        else:
            at = tok = np.zeros(0, dtype=np.int64)
            cnt = np.zeros(0, dtype=np.float32)
        return TouchedTokens(torch.from_numpy(at * vocab + tok), torch.from_numpy(at),
                             torch.from_numpy(cnt), torch.tensor(banned, dtype=torch.long),
                             repetition, counting)


class SamplingBuffers:
    """Per-row sampling parameters for up to `max_rows` rows, on one device.

    Life cycle: made once by the model runner; `fill` writes a step's rows (rows past them
    up to the padded count become greedy no-ops) before the step runs; the dense [rows,
    vocab] penalty tensors are allocated on first use (or by `ensure_dense` before capture)
    and cleared as soon as they are not needed.

    On the CPU (`sparse`, the default there) penalties and bans are kept as the (row, token)
    pairs they touch (`TouchedTokens`) and applied to those alone: fill + penalized with
    the dense [rows, vocab] tensors and their temporaries took 34 ms for 64 rows, 11 this
    way (docs/bench/cpu-s23/penalty_calls.py). The pairs come from per-request tables kept
    across steps (`PenaltyTables`, owned here), so a step reads what was appended since the
    last one (docs/bench/cpu-s24/penalty_calls.txt). A captured graph (CUDA) needs the dense
    tensors' fixed shapes.
    """

    def __init__(self, max_rows: int, vocab: int, device: torch.device,
                 sparse: bool | None = None) -> None:
        self.max_rows, self.vocab, self.device = max_rows, vocab, device
        self.sparse = device.type == "cpu" if sparse is None else sparse
        self.touched: TouchedTokens | None = None  # sparse: this step's pairs, if any
        self.tables = PenaltyTables(vocab)  # sparse: the requests' penalty state
        self.floats = torch.zeros(max_rows, 8, dtype=torch.float32, device=device)
        self.ints = torch.zeros(max_rows, 3, dtype=torch.long, device=device)
        self.seen: torch.Tensor | None = None  # [R, V] bool: in prompt or output (repetition)
        self.counts: torch.Tensor | None = None  # [R, V] float32: output counts
        self.banned: torch.Tensor | None = None  # [R, V] bool: min_tokens not reached
        self._dense_rows = 0  # rows of the dense tensors that may hold non-zeros
        pin = device.type == "cuda"
        self._host_floats = torch.empty(max_rows, 8, dtype=torch.float32, pin_memory=pin)
        self._host_ints = torch.empty(max_rows, 3, dtype=torch.long, pin_memory=pin)
        self._host_out = torch.empty(max_rows, 2 + 2 * MAX_LOGPROBS, dtype=torch.float64,
                                     pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None

    def ensure_dense(self) -> None:
        if self.seen is None:
            shape, dev = (self.max_rows, self.vocab), self.device
            self.seen = torch.zeros(shape, dtype=torch.bool, device=dev)
            self.counts = torch.zeros(shape, dtype=torch.float32, device=dev)
            self.banned = torch.zeros(shape, dtype=torch.bool, device=dev)

    def fill(self, rows: list[SampleRow], padded: int) -> SampleFlags:
        """Write the rows' parameters (rows [len(rows), padded) as greedy no-ops)."""
        n, vocab = len(rows), self.vocab
        assert n <= padded <= self.max_rows, (n, padded, self.max_rows)
        fl, il = [], []
        for r in rows:
            p = r.params
            fl.append([1.0 if p.greedy else p.temperature, p.top_p, p.min_p,
                       p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                       float(p.greedy), min_p_threshold(p.min_p)])
            il.append([p.top_k if 0 < p.top_k < vocab else vocab,
                       0 if p.greedy else row_seed(p.seed), r.position])
        fl += [[1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, float("-inf")]] * (padded - n)
        il += [[vocab, 0, 0]] * (padded - n)
        hf, hi = self._host_floats[:padded], self._host_ints[:padded]
        hf.copy_(torch.tensor(fl, dtype=torch.float32))
        hi.copy_(torch.tensor(il, dtype=torch.long))
        self.floats[:padded].copy_(hf, non_blocking=True)
        self.ints[:padded].copy_(hi, non_blocking=True)
        flags = SampleFlags.of(rows, vocab)
        if self.sparse:
            if flags.penalties or flags.ban:
                self.touched = self.tables.touched(rows)
            else:  # no row has a table: every table is of a request not in this step
                self.tables.clear()
                self.touched = None
        elif flags.penalties or flags.ban or self._dense_rows:
            self._fill_dense(rows, flags)
        return flags

    def _fill_dense(self, rows: list[SampleRow], flags: SampleFlags) -> None:
        self.ensure_dense()
        if self._dense_rows:
            for t in (self.seen, self.counts, self.banned):
                t[:self._dense_rows].zero_()
        seen_r, seen_t, out_r, out_t, ban_r, ban_t = _touched_lists(rows, self.vocab)
        dev = self.device

        def idx(r: list[int], t: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.tensor(r, dtype=torch.long).to(dev, non_blocking=True),
                    torch.tensor(t, dtype=torch.long).to(dev, non_blocking=True))

        if seen_t:
            self.seen.index_put_(idx(seen_r, seen_t), torch.ones((), dtype=torch.bool,
                                                                 device=dev))
        if out_t:
            self.counts.index_put_(idx(out_r, out_t), torch.ones((), device=dev),
                                   accumulate=True)
        if ban_t:
            self.banned.index_put_(idx(ban_r, ban_t), torch.ones((), dtype=torch.bool,
                                                                 device=dev))
        self._dense_rows = len(rows) if (seen_t or out_t or ban_t) else 0

    def fetch(self, packed: torch.Tensor, rows: list[SampleRow]
              ) -> list[tuple[int, TokenLogprobs | None]]:
        """The one device -> host copy of a step's result, decoded per row."""
        return self.decode(self.copy_out(packed, len(rows)), rows)

    def copy_out(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """Start the copy of the first n rows to the host and return the host tensor they
        land in; `decode` waits for it. Valid until the next `copy_out`."""
        if self._copied is None:
            return packed[:n]
        width = packed.shape[1]
        # a contiguous view: a strided destination would go through a pageable temporary
        host = self._host_out.view(-1)[:n * width].view(n, width)
        host.copy_(packed[:n], non_blocking=True)
        self._copied.record()
        return host

    def decode(self, host: torch.Tensor, rows: list[SampleRow]
               ) -> list[tuple[int, TokenLogprobs | None]]:
        """Wait for `copy_out`'s copy and read each row's token (and logprobs)."""
        if self._copied is not None:
            self._copied.synchronize()
        k = (host.shape[1] - 2) // 2
        vals = host.tolist()
        out: list[tuple[int, TokenLogprobs | None]] = []
        for row, v in zip(rows, vals):
            tok = int(v[0])
            info = None
            if row.params.logprobs is not None:
                want = row.params.logprobs
                top = tuple((int(v[2 + k + j]), v[2 + j]) for j in range(want))
                info = TokenLogprobs(tok, v[1], top)
            out.append((tok, info))
        return out


def sample_on_device(logits: torch.Tensor, bufs: SamplingBuffers, flags: SampleFlags
                     ) -> torch.Tensor:
    """logits [R, V] float32 -> [R, 2 + 2K] float64: token, its logprob, K top (logprob, id).

    R rows of `bufs` are used (filled by `bufs.fill`); K = flags.logprobs."""
    r = logits.shape[0]
    f, i = bufs.floats[:r], bufs.ints[:r]
    # On the CPU the touched pairs are penalised in the logits themselves and put back once
    # the tokens are drawn: a clone of 64 x 49k logits (12.6 MB) cost 1-5 ms a step more
    # than the put-back (docs/bench/cpu-s24/penalty_calls.txt, "after,copy"). Put back
    # before the logprobs (they are of the raw logits), and the caller gets its logits as
    # they were.
    in_place = bufs.sparse and logits.is_contiguous()
    saved = _penalize_touched_(logits, bufs.floats, bufs.touched, flags) if in_place else None
    try:
        x = logits if in_place else penalized(logits, bufs, flags)
        # every row sampled: no argmax (~0.13 ms of a one-row step, the first pass over the
        # logits after the forward)
        tokens = greedy_tokens(x) if flags.greedy or not flags.random else None
        if flags.random:
            drawn = _cpu_filtered_draw(x, f, i)
            if drawn is None:
                y = x / f[:, _TEMP, None]
                if flags.sort:
                    y = _top_k_top_p(y, i[:, _TOP_K], f[:, _TOP_P])
                if flags.min_p:
                    y = min_p_filter(y, f[:, _MIN_P_LOG])
                drawn = exponential_race(y, i[:, _SEED], i[:, _POS])
            tokens = drawn if tokens is None else torch.where(f[:, _GREEDY] > 0, tokens, drawn)
    finally:
        if saved is not None:
            saved.put_back(logits)
    cols = [tokens.to(torch.float64)[:, None]]
    if flags.any_logprobs:
        lp = logits.log_softmax(-1)
        cols.append(lp.gather(1, tokens[:, None]).to(torch.float64))
        if flags.logprobs:
            top = lp.topk(flags.logprobs, dim=-1)
            cols += [top.values.to(torch.float64), top.indices.to(torch.float64)]
    else:
        cols.append(torch.zeros_like(cols[0]))
    return torch.cat(cols, dim=1)


def _cpu_filtered_draw(x: torch.Tensor, f: torch.Tensor, i: torch.Tensor
                       ) -> torch.Tensor | None:
    """The sampled rows' draws in one C call (temperature, top-k, top-p, min-p and the race;
    greedy rows' entries unused), for float32 rows on the CPU; None elsewhere. The torch
    stages below sort: one stream at top_p 0.95 took 15.6 ms a decode step against 6.9
    greedy; min-p's softmax and masks cost ~5-15 ms more."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    op = _cpu_filter()
    if op is None:
        return None
    return op(x.contiguous(), f[:, _TEMP].contiguous(), i[:, _TOP_K].contiguous(),
              f[:, _TOP_P].contiguous(), f[:, _MIN_P].contiguous(),
              f[:, _GREEDY].contiguous(), row_keys(i[:, _SEED], i[:, _POS]))


@functools.cache
def _cpu_filter() -> Callable[..., torch.Tensor] | None:
    """The C op, imported on first use; None (warned once) when it cannot start."""
    from pdserve.engine.cpu_kernels.library import op_or_none

    return op_or_none("sampling_filter", "filtered_race", "the C sampling filter",
                      "sampled rows are filtered with torch")


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1); for float32 rows on the CPU the C kernel, where torch's argmax took
    ~4 ms of a ~90 ms step for 64 rows of a 49k vocabulary. Not while a CUDA graph is being
    captured (a CPU tensor never is)."""
    op = _cpu_argmax() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if op is not None and x.dim() == 2 and x.stride(1) == 1:
        return op(x)
    return x.argmax(-1)


@functools.cache
def _cpu_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The C op, imported on first use; None (warned once) when it cannot start."""
    from pdserve.engine.cpu_kernels.library import op_or_none

    return op_or_none("argmax", "argmax_rows", "the C argmax", "greedy rows use torch's")


def penalized(logits: torch.Tensor, bufs: SamplingBuffers, flags: SampleFlags
              ) -> torch.Tensor:
    """Repetition (seen token: positive logit / r, negative * r), then frequency and
    presence (minus f * count + p * [count > 0]), then the min_tokens ban. The logits are
    not changed (sparse: a copy is penalised; `sample_on_device` penalises in place)."""
    if bufs.sparse:
        if bufs.touched is None or not (flags.penalties or flags.ban):
            return logits
        x = logits.clone(memory_format=torch.contiguous_format)
        _penalize_touched_(x, bufs.floats, bufs.touched, flags)
        return x
    r = logits.shape[0]
    x, f = logits, bufs.floats[:r]
    if flags.penalties:
        rep = f[:, _REP, None]
        x = torch.where(bufs.seen[:r], torch.where(x > 0, x / rep, x * rep), x)
        counts = bufs.counts[:r]
        x = x - (f[:, _FREQ, None] * counts + f[:, _PRES, None] * (counts > 0).to(x.dtype))
    if flags.ban:
        x = x.masked_fill(bufs.banned[:r], float("-inf"))
    return x


@dataclass(frozen=True)
class RawLogits:
    """The logits a step penalised in place, as they were: flat indices and their values."""

    index: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    def put_back(self, logits: torch.Tensor) -> None:
        flat = logits.view(-1)
        for idx, raw in zip(self.index, self.values):
            flat.index_copy_(0, idx, raw)


def _penalize_touched_(x: torch.Tensor, f: torch.Tensor, touched: TouchedTokens | None,
                       flags: SampleFlags) -> RawLogits | None:
    """`penalized` on the touched pairs alone, in place on x (contiguous [R, V]); what it
    overwrote, to put back (None: nothing). Per element the dense formula's operations in
    its order (an untouched logit stays as it is, where the dense formula subtracts a
    zero); every pair once, so one gather and one index_copy_ (pairs are distinct)."""
    if touched is None or not (flags.penalties or flags.ban):
        return None
    flat = x.view(-1)
    index: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    ban = touched.banned if flags.ban and touched.banned.numel() else None
    if ban is not None:  # raw values: taken before the penalties write any of them
        index.append(ban)
        values.append(flat.index_select(0, ban))
    if flags.penalties and touched.pairs.numel():
        idx, rows = touched.pairs, touched.rows
        raw = flat.index_select(0, idx)
        v = raw
        if touched.repetition:
            rep = f[:, _REP].index_select(0, rows)
            v = torch.where(v > 0, v / rep, v * rep)
        if touched.counting:
            counts = touched.counts
            v = v - (f[:, _FREQ].index_select(0, rows) * counts
                     + f[:, _PRES].index_select(0, rows) * (counts > 0).to(v.dtype))
        flat.index_copy_(0, idx, v.to(flat.dtype))
        index.append(idx)
        values.append(raw)
    if ban is not None:
        flat.index_fill_(0, ban, float("-inf"))
    return RawLogits(tuple(index), tuple(values)) if index else None


def _top_k_top_p(y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (ties at the k-th value kept) then top-p over what is left: a token
    is dropped when the mass sorted before it already reaches top_p (at least one stays).
    Each row from its largest logits where its set lies among them (TOP_CANDIDATES), else
    from the full sort."""
    rows, v = y.shape
    # the full row's logsumexp: the top-p mass of a row whose top-k is off (once per step)
    lse = y.logsumexp(-1) if bool((top_k >= v).any()) else None
    out = torch.empty_like(y)
    todo = torch.arange(rows, device=y.device)
    for n in TOP_CANDIDATES:
        if v <= 2 * n or not len(todo):
            break
        filtered, done = _top_k_top_p_candidates(y[todo], top_k[todo], top_p[todo], n,
                                                 None if lse is None else lse[todo])
        if len(todo) == rows and bool(done.all()):
            return filtered  # the common step: no copy row by row
        out[todo[done]] = filtered[done]
        todo = todo[~done]
    if len(todo):
        out[todo] = _top_k_top_p_sorted(y[todo], top_k[todo], top_p[todo])
    return out


def _top_k_top_p_sorted(y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> torch.Tensor:
    """`_top_k_top_p` from the whole sorted row: the definition."""
    srt, order = y.sort(dim=-1, descending=True)
    kth = srt.gather(1, (top_k - 1)[:, None])
    srt = srt.masked_fill(srt < kth, float("-inf"))
    y = y.masked_fill(y < kth, float("-inf"))
    probs = srt.softmax(-1)
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return y.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


# Sorting every row of the vocabulary to find a top-k or top-p set costs more than the step
# it samples for (64 x 49k on two cores: a 138-178 ms sort, 150-270 ms for the whole
# filter), while the set lies among a row's largest few thousand logits: SmolLM2-135M's
# sampled rows needed p50 266 / max 845 tokens for top-p 0.9 at temperature 0.7, p50 1,658 /
# max 4,179 at 1.0 (384 rows). Each row is taken from its candidates at these counts in turn
# (topk of 64 rows: 15 and 32 ms); only a row whose set reaches past the last is sorted.
TOP_CANDIDATES = (512, 4096)


def _top_k_top_p_candidates(y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            n: int, row_lse: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(`_top_k_top_p` from each row's n largest logits, [rows] bool: the rows it is right
    for). A row is not when its set may reach past the candidates: a top-k between n and
    the vocabulary, or a top-p whose mass the candidates do not reach. The mass is the
    row's softmax over every token top-k keeps, normalised by the full row's logsumexp
    (`row_lse`, computed here when not given) when top-k is off."""
    v = y.shape[-1]
    srt, order = y.topk(n, dim=-1)  # sorted, descending
    k_on = top_k < v
    kth = srt.gather(1, (top_k.clamp(max=n) - 1)[:, None])
    kth = kth.masked_fill(~k_on[:, None], float("-inf"))
    srt = srt.masked_fill(srt < kth, float("-inf"))
    # top-k on: the kept tokens are all candidates; off: every token counts in the mass
    if not bool(k_on.all()):
        row_lse = y.logsumexp(-1) if row_lse is None else row_lse
        lse = torch.where(k_on, srt.logsumexp(-1), row_lse)
    else:
        lse = srt.logsumexp(-1)
    probs = (srt - lse[:, None]).exp()
    before = probs.cumsum(-1) - probs
    p_on = top_p < 1.0
    closed = before[:, -1] + probs[:, -1] >= top_p
    done = ~(k_on & (top_k > n)) & ~(p_on & ~k_on & ~closed)
    drop = (before >= top_p[:, None]) & p_on[:, None]
    # past the candidates: dropped where top-k is on (below its k-th) or top-p closed
    beyond = (k_on | p_on)[:, None].expand(-1, v)
    full = beyond.clone().scatter_(1, order, drop | (srt == float("-inf")))
    return y.masked_fill(full, float("-inf")), done
