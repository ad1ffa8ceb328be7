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

The result of a step is ONE float64 tensor [rows, 2 + 2K] (token id, its logprob, K top
logprobs, their ids — float64 holds every id exactly), copied once to a pinned host buffer,
non-blocking, and synchronised once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.sampler import SampleRow, min_p_filter, min_p_threshold
from pdserve.engine.sampling_noise import exponential_race, row_keys, row_seed
from pdserve.protocol import TokenLogprobs

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

    @staticmethod
    def of(rows: list[SampleRow], vocab: int) -> SampleFlags:
        ps = [r.params for r in rows]
        return SampleFlags(
            penalties=any(p.repetition_penalty != 1.0 or p.presence_penalty
                          or p.frequency_penalty for p in ps),
            ban=any(len(r.output_token_ids) < r.params.min_tokens for r in rows),
            random=any(not p.greedy for p in ps),
            sort=any(not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0) for p in ps),
            min_p=any(not p.greedy and p.min_p > 0.0 for p in ps),
            logprobs=max((p.logprobs or 0 for p in ps), default=0),
            any_logprobs=any(p.logprobs is not None for p in ps),
        )


SampleFlags.ALL = SampleFlags(True, True, True, True, True, MAX_LOGPROBS, True)


def _touched_lists(rows: list[SampleRow], vocab: int) -> tuple[list[int], ...]:
    """(row, token) pairs as parallel lists: seen tokens of rows with a repetition penalty
    (prompt and output, once each), output tokens of rows with a presence or frequency
    penalty (once per occurrence), banned ids of rows short of min_tokens."""
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
    """A CPU step's penalties and bans as (row, token) index tensors: the seen tokens, the
    counted output tokens (each pair once, with its count), the banned ids."""

    seen: tuple[torch.Tensor, torch.Tensor]
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, tokens, float32 counts
    banned: tuple[torch.Tensor, torch.Tensor]

    @staticmethod
    def of(rows: list[SampleRow], vocab: int) -> TouchedTokens:
        seen_r, seen_t, out_r, out_t, ban_r, ban_t = _touched_lists(rows, vocab)
        pairs = torch.tensor(out_r, dtype=torch.long) * vocab + torch.tensor(out_t,
                                                                             dtype=torch.long)
        keys, counts = pairs.unique(return_counts=True)
        return TouchedTokens(
            (torch.tensor(seen_r, dtype=torch.long), torch.tensor(seen_t, dtype=torch.long)),
            (keys // vocab, keys % vocab, counts.to(torch.float32)),
            (torch.tensor(ban_r, dtype=torch.long), torch.tensor(ban_t, dtype=torch.long)))


class SamplingBuffers:
    """Per-row sampling parameters for up to `max_rows` rows, on one device.

    Life cycle: made once by the model runner; `fill` writes a step's rows (rows past them
    up to the padded count become greedy no-ops) before the step runs; the dense [rows,
    vocab] penalty tensors are allocated on first use (or by `ensure_dense` before capture)
    and cleared as soon as they are not needed.

    On the CPU (`sparse`, the default there) penalties and bans are kept as the (row, token)
    pairs they touch (`TouchedTokens`) and applied to those alone: fill + penalized with
    the dense [rows, vocab] tensors and their temporaries took 34 ms for 64 rows, 11 this
    way (docs/bench/cpu-s23/penalty_calls.py). A captured graph (CUDA) needs the dense
    tensors' fixed shapes.
    """

    def __init__(self, max_rows: int, vocab: int, device: torch.device,
                 sparse: bool | None = None) -> None:
        self.max_rows, self.vocab, self.device = max_rows, vocab, device
        self.sparse = device.type == "cpu" if sparse is None else sparse
        self.touched: TouchedTokens | None = None  # sparse: this step's pairs, if any
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
            self.touched = (TouchedTokens.of(rows, vocab) if flags.penalties or flags.ban
                            else None)
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
    x = penalized(logits, bufs, flags)
    tokens = greedy_tokens(x)
    if flags.random:
        drawn = _cpu_filtered_draw(x, f, i)
        if drawn is None:
            y = x / f[:, _TEMP, None]
            if flags.sort:
                y = _top_k_top_p(y, i[:, _TOP_K], f[:, _TOP_P])
            if flags.min_p:
                y = min_p_filter(y, f[:, _MIN_P_LOG])
            drawn = exponential_race(y, i[:, _SEED], i[:, _POS])
        tokens = torch.where(f[:, _GREEDY] > 0, tokens, drawn)
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
    presence (minus f * count + p * [count > 0]), then the min_tokens ban."""
    if bufs.sparse:
        return _penalized_touched(logits, bufs.floats, bufs.touched, flags)
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


def _penalized_touched(logits: torch.Tensor, f: torch.Tensor, touched: TouchedTokens | None,
                       flags: SampleFlags) -> torch.Tensor:
    """`penalized` on the touched pairs alone: per element the dense formula's operations,
    in its order (an untouched logit stays as it is, where the dense formula subtracts a
    zero)."""
    if touched is None or not (flags.penalties or flags.ban):
        return logits
    x = logits.clone()
    if flags.penalties:
        rows, toks = touched.seen
        if rows.numel():
            v, rep = x[rows, toks], f[rows, _REP]
            x[rows, toks] = torch.where(v > 0, v / rep, v * rep)
        rows, toks, counts = touched.counted
        if rows.numel():
            x[rows, toks] = x[rows, toks] - (f[rows, _FREQ] * counts
                                             + f[rows, _PRES] * (counts > 0).to(x.dtype))
    if flags.ban:
        rows, toks = touched.banned
        if rows.numel():
            x[rows, toks] = float("-inf")
    return x


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
