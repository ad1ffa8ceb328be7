"""The reference sampler: one row at a time, in plain torch, each rule as it is stated.

Order per row: penalties -> min_tokens masking -> (greedy argmax) | temperature -> top-k ->
top-p -> min-p -> draw. Logprobs are of the raw model distribution (before any processing),
which is what OpenAI-compatible servers report. A row draws with `sampling_noise.exponential_race`,
its noise keyed by (seed, output position), so a seeded row's tokens do not depend on what
else is in the batch, nor on the device. A re-admitted request
(`SamplingParams.output_offset`) counts the output it made elsewhere, now the tail of its
prompt, in that position and in the output-only penalties: it draws the same sequence it
would have drawn had it never moved.

The engine samples with `device_sampler` (the whole batch on the logits' device); this module
is the definition it is tested against.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_noise import exponential_race, row_seed
from pdserve.protocol import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]

    @property
    def position(self) -> int:
        """The output position of the token sampled now, what it made before a migration
        included: the seed stream's key (no list is built: this runs for every row of every
        step)."""
        return self.params.output_offset + len(self.output_token_ids)

    @property
    def history(self) -> list[int]:
        """The request's whole output so far, what it made before a migration included."""
        k = self.params.output_offset
        return (self.prompt_token_ids[-k:] if k else []) + self.output_token_ids


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    p = row.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                            dtype=torch.long)
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                   vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and (history := row.history):
        counts = torch.bincount(torch.tensor(history, dtype=torch.long),
                                minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
            logits.dtype)
    return logits


def min_p_threshold(min_p: float) -> float:
    """`min_p_filter`'s threshold for one row: log(min_p) of min_p rounded to float32 (what
    the buffer and the C filter hold), -inf for 0 (off); a float32 buffer rounds it once.
    Taken on the host with math.log, which is the libm log sampling_filter.c calls: a device
    log (Sleef's on the CPU, CUDA's) may differ from it in the last bit, and then the torch
    stages and the C filter would cut a row at different floats."""
    p = struct.unpack("f", struct.pack("f", min_p))[0]
    return math.log(p) if p > 0.0 else float("-inf")


def min_p_filter(y: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Min-p: a token is dropped when its probability is below min_p times the row's
    largest, tested as y - max(y) < log(min_p) (threshold [R]: `min_p_threshold`).

    The same rule as probs < min_p * max(probs) (the softmax's sum cancels; the max's
    probability is exp(0) of it), but in exact steps: one float32 subtraction and a
    comparison, which the C filter repeats bit for bit, where a softmax's exp and sum
    round differently in torch, C and CUDA, and a token at the edge could go either way.
    Fixed shapes and no sync: it runs in captured graphs (a -inf threshold keeps all)."""
    return y.masked_fill(y - y.amax(-1, keepdim=True) < threshold[:, None], float("-inf"))


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on one row of logits (float32)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                    float("-inf"))
    if p.min_p > 0.0:  # device_sampler's rule, so both samplers cut at the same float
        logits = min_p_filter(logits[None], torch.tensor([min_p_threshold(p.min_p)]))[0]
    return logits


def _draw(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    # argmax(p / E) with E ~ Exp(1) is an exact draw from p (the exponential race)
    return int(exponential_race(logits[None].cpu(), torch.tensor([row_seed(p.seed)]),
                                torch.tensor([position]))[0])


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[tuple[int, TokenLogprobs | None]]:
    """logits [S, vocab] float32 -> (token id, logprobs or None) per row."""
    assert logits.shape[0] == len(rows)
    simple = all(r.params.greedy and r.params.repetition_penalty == 1.0
                 and not r.params.presence_penalty and not r.params.frequency_penalty
                 and r.params.min_tokens <= len(r.output_token_ids) for r in rows)
    if simple:
        tokens = logits.argmax(-1).tolist()
    else:
        tokens = []
        for i, row in enumerate(rows):
            x = logits[i].clone()
            x = _apply_penalties(x, row)
            p = row.params
            if len(row.output_token_ids) < p.min_tokens:
                banned = [t for t in (*row.eos_token_ids, *p.stop_token_ids) if t < x.shape[-1]]
                if banned:
                    x[banned] = float("-inf")
            if p.greedy:
                tokens.append(int(x.argmax()))
            else:
                tokens.append(_draw(_filter(x, p), p, row.position))
    out: list[tuple[int, TokenLogprobs | None]] = []
    need_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    lps = logits[need_lp].log_softmax(-1) if need_lp else None
    j = 0
    for i, row in enumerate(rows):
        info = None
        if row.params.logprobs is not None:
            lp = lps[j]
            j += 1
            top = ()
            if row.params.logprobs:
                vals, idx = torch.topk(lp, row.params.logprobs)
                top = tuple(zip(idx.tolist(), vals.tolist()))
            info = TokenLogprobs(tokens[i], float(lp[tokens[i]]), top)
        out.append((tokens[i], info))
    return out
