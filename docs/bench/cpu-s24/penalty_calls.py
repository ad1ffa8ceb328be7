"""A CPU step's penalties in the steady state: fill + penalties of one decode step after
many, each row with 64 prompt tokens and a few hundred output tokens, one appended a step.

- before: session 23's path (kept below): every step each row's seen set and output
  history rebuilt as lists, then tensors, then a `unique`; the logits cloned and the pairs
  penalised in the copy;
- after: `PenaltyTables` (a row reads the tokens appended since its last step) and the
  pairs penalised in the logits and put back, as `sample_on_device` runs them;
- after, copy: the same tables through `penalized`, which penalises a copy;
- cold: after, with every row's table built from its whole history (a batch of requests
  sampling for the first time, or the step after each was preempted).

Median ms over 40 steps after 100 warm-up steps; `equal`: the step's penalised logits
against the dense [rows, vocab] formula (what a captured graph runs), bit for bit.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 python docs/bench/cpu-s24/penalty_calls.py
"""

import random
import statistics
import time
from dataclasses import dataclass

import torch

from pdserve.engine.device_sampler import (
    _FREQ,
    _PRES,
    _REP,
    SamplingBuffers,
    _penalize_touched_,
    _touched_lists,
    penalized,
)
from pdserve.engine.sampler import SampleRow
from pdserve.protocol import SamplingParams

torch.set_num_threads(2)
V = 49152
WARM, TIMED = 100, 40


@dataclass(frozen=True)
class OldTouched:
    """Session 23's TouchedTokens."""

    seen: tuple[torch.Tensor, torch.Tensor]
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    banned: tuple[torch.Tensor, torch.Tensor]


class OldTables:
    """Session 23's pairs: rebuilt from every row's whole history each step."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def touched(self, rows: list[SampleRow]) -> OldTouched:
        vocab = self.vocab
        seen_r, seen_t, out_r, out_t, ban_r, ban_t = _touched_lists(rows, vocab)
        pairs = (torch.tensor(out_r, dtype=torch.long) * vocab
                 + torch.tensor(out_t, dtype=torch.long))
        keys, counts = pairs.unique(return_counts=True)
        return OldTouched(
            (torch.tensor(seen_r, dtype=torch.long), torch.tensor(seen_t, dtype=torch.long)),
            (keys // vocab, keys % vocab, counts.to(torch.float32)),
            (torch.tensor(ban_r, dtype=torch.long), torch.tensor(ban_t, dtype=torch.long)))

    def clear(self) -> None:
        """Nothing is kept between steps."""


def old_penalized(logits, bufs, flags):
    """Session 23's _penalized_touched: a clone, then the seen and counted pairs."""
    touched, f = bufs.touched, bufs.floats
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


def in_place(logits, bufs, flags):
    """What sample_on_device runs: the pairs penalised in the logits, then put back."""
    saved = _penalize_touched_(logits, bufs.floats, bufs.touched, flags)
    if saved is not None:
        saved.put_back(logits)
    return logits


def make_rows(n: int, kw: dict, rng: random.Random) -> list[SampleRow]:
    params = SamplingParams(temperature=0.7, **kw)
    return [SampleRow(params, [rng.randrange(V) for _ in range(64)],
                      [rng.randrange(V) for _ in range(200)], (2,)) for _ in range(n)]


def append_token(rows: list[SampleRow], rng: random.Random) -> None:
    """A decode step's token per row: a third of them repeat one of the row's own."""
    for r in rows:
        out = r.output_token_ids
        out.append(rng.choice(out) if rng.random() < 1 / 3 else rng.randrange(V))


def steady(n: int, kw: dict, make_bufs, run) -> tuple[float, torch.Tensor]:
    rng = random.Random(n)
    rows = make_rows(n, kw, rng)
    bufs = make_bufs(n)
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(n))
    ts = []
    for step in range(WARM + TIMED):
        append_token(rows, rng)
        t0 = time.perf_counter()
        got = run(logits, bufs, bufs.fill(rows, n))
        if step >= WARM:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, got


def check(n: int, kw: dict) -> bool:
    """The after path's penalised logits equal the dense formula's after many steps."""
    rng = random.Random(n)
    rows = make_rows(n, kw, rng)
    touched = SamplingBuffers(n, V, torch.device("cpu"))
    for _ in range(WARM):
        append_token(rows, rng)
        touched.fill(rows, n)
    append_token(rows, rng)
    logits = torch.randn(n, V)
    dense = SamplingBuffers(n, V, torch.device("cpu"), sparse=False)
    want = penalized(logits, dense, dense.fill(rows, n))
    x = logits.clone()
    flags = touched.fill(rows, n)
    saved = _penalize_touched_(x, touched.floats, touched.touched, flags)
    ok = torch.equal(x, want) and torch.equal(penalized(logits, touched, flags), want)
    saved.put_back(x)
    return ok and torch.equal(x, logits)


def cold(n: int, kw: dict) -> float:
    rng = random.Random(n)
    rows = make_rows(n, kw, rng)
    logits = torch.randn(n, V)
    ts = []
    for _ in range(TIMED):
        bufs = SamplingBuffers(n, V, torch.device("cpu"))
        t0 = time.perf_counter()
        in_place(logits, bufs, bufs.fill(rows, n))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def before_bufs(n: int) -> SamplingBuffers:
    bufs = SamplingBuffers(n, V, torch.device("cpu"))
    bufs.tables = OldTables(V)
    return bufs


def after_bufs(n: int) -> SamplingBuffers:
    return SamplingBuffers(n, V, torch.device("cpu"))


print(f"{'':28} {'rows':>4} {'before':>8} {'after':>8} {'after,copy':>10} {'cold':>8} "
      f"{'fill only':>9}  equal")
for name, kw in (("repetition 1.1", {"repetition_penalty": 1.1}),
                 ("presence 0.5 + frequency 0.3", {"presence_penalty": 0.5,
                                                   "frequency_penalty": 0.3}),
                 ("all three", {"repetition_penalty": 1.1, "presence_penalty": 0.5,
                                "frequency_penalty": 0.3})):
    for n in (1, 64):
        before, b = steady(n, kw, before_bufs, old_penalized)
        after, _ = steady(n, kw, after_bufs, in_place)
        copy, c = steady(n, kw, after_bufs, penalized)
        # the same rows without penalties: what fill costs anyway
        plain, _ = steady(n, {}, after_bufs, penalized)
        ok = check(n, kw) and torch.equal(b, c)  # before and after, the same steps
        print(f"{name:28} {n:4} {before:8.3f} {after:8.3f} {copy:10.3f} {cold(n, kw):8.3f} "
              f"{plain:9.3f}  {ok}")
