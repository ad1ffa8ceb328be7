"""Seeded benchmark workloads: what to send, how long, and when.

A workload is a list of `BenchRequest` built before the run, so a run is reproducible
from `(workload name, parameters, seed, tokenizer)` alone:

1. lengths are drawn from a seeded `random.Random` (`fixed`, `mixed`, `long-prompt`,
   `shared-prefix`);
2. prompt text is built from a deterministic word source and trimmed with the real
   tokenizer until `len(encode(text))` equals the target exactly (`fit_text`);
3. arrival offsets are assigned separately (`with_arrivals`: all at once or Poisson at a
   rate), so one workload can be replayed at several rates (`rate_sweep`).

Output length is forced by the client (`max_tokens` plus `ignore_eos`), so
`output_tokens` is exact whenever the server honours `ignore_eos`.

Token counts are content counts: `encode(text, add_special_tokens=False)` where the
tokenizer accepts that keyword. For SmolLM2 (no BOS) that is also what a completions
server sees. Chat requests carry `prompt_tokens` = the length of the rendered chat template
when the tokenizer has `apply_chat_template` (exactly what the gateway prefills), else the
sum of the message contents.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Tokenizer(Protocol):
    """The two calls workloads need; a `transformers` tokenizer satisfies it."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. Exactly one of `prompt` / `messages` is set."""

    request_id: int
    prompt_tokens: int  # exact token count of `prompt`, or of the rendered chat (see module doc)
    output_tokens: int  # forced via max_tokens + ignore_eos
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    arrival_s: float = 0.0  # offset from the start of the run
    session_id: int | None = None  # multi-turn conversation this turn belongs to
    turn: int = 0  # 0-based turn index inside the session

    def __post_init__(self) -> None:
        assert (self.prompt is None) != (self.messages is None), "set prompt xor messages"
        assert self.prompt_tokens >= 1, self.prompt_tokens
        assert self.output_tokens >= 1, self.output_tokens
        assert self.arrival_s >= 0.0 and math.isfinite(self.arrival_s), self.arrival_s

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


# A fixed list of common English words: the deterministic word source for prompt text.
# Varied enough that prompts do not share accidental prefixes, plain enough to tokenize
# stably (mostly one token per word with a leading space).
_WORD_TEXT = """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change morning reason research girl guy moment air teacher force
    education foot boy age policy process music market sense nation plan college interest
    death experience effect use class control care field development role effort rate heart
    drug show leader light voice wife police mind price report decision son view relationship
    town road arm difference value building action model season society tax director position
    player record paper space ground form event official matter center couple site project
    activity star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie north love
    support technology step baby computer type attention film tree source organization hair
    window evidence population truth song ball garden river summer winter bridge engine stone
    green blue small large quick slow bright quiet early late simple open strong clear
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]
    except TypeError:  # a minimal tokenizer without the keyword
        return list(tokenizer.encode(text))


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Content tokens of `text` (no special tokens where the tokenizer can leave them out)."""
    return len(_encode(tokenizer, text))


def fit_text(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Text of random words from `WORDS` that encodes to exactly `num_tokens` tokens.

    Draw about one word per token, cut the token ids at `num_tokens`, decode, and re-encode;
    a cut inside a word can re-merge differently, so repeat (re-cutting, or appending a
    word when it came out short) until the round trip is exact.
    """
    assert num_tokens >= 1, num_tokens
    text = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
    ids = _encode(tokenizer, text)
    for _ in range(64):
        while len(ids) < num_tokens:
            text += " " + " ".join(rng.choice(WORDS) for _ in range(num_tokens - len(ids)))
            ids = _encode(tokenizer, text)
        text = tokenizer.decode(ids[:num_tokens])
        ids = _encode(tokenizer, text)
        if len(ids) == num_tokens:
            return text
    raise ValueError(f"could not fit text to {num_tokens} tokens with this tokenizer")


def chat_prompt_tokens(tokenizer: Tokenizer, messages: Sequence[ChatMessage]) -> int:
    """Tokens the server prefills for `messages`: the rendered template where available."""
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is not None and getattr(tokenizer, "chat_template", None):
        rendered = template(
            [m.to_json() for m in messages], tokenize=False, add_generation_prompt=True
        )
        return count_tokens(tokenizer, rendered)
    return sum(count_tokens(tokenizer, m.content) for m in messages)


def log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] whose log is uniform: skewed towards `low`."""
    assert 1 <= low <= high, (low, high)
    value = round(math.exp(rng.uniform(math.log(low), math.log(high))))
    return min(high, max(low, value))


def _prompt_request(
    tokenizer: Tokenizer, rng: random.Random, request_id: int, input_len: int, output_len: int
) -> BenchRequest:
    return BenchRequest(
        request_id=request_id,
        prompt=fit_text(tokenizer, rng, input_len),
        prompt_tokens=input_len,
        output_tokens=output_len,
    )


def fixed(
    tokenizer: Tokenizer,
    num_requests: int,
    seed: int,
    *,
    input_len: int = 256,
    output_len: int = 128,
) -> list[BenchRequest]:
    """Every request has `input_len` prompt tokens and `output_len` output tokens."""
    rng = random.Random(seed)
    return [_prompt_request(tokenizer, rng, i, input_len, output_len) for i in range(num_requests)]


def mixed(
    tokenizer: Tokenizer,
    num_requests: int,
    seed: int,
    *,
    input_range: tuple[int, int] = (32, 512),
    output_range: tuple[int, int] = (16, 256),
) -> list[BenchRequest]:
    """Prompt and output lengths log-uniform in their ranges (most requests short)."""
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        input_len = log_uniform_int(rng, *input_range)
        output_len = log_uniform_int(rng, *output_range)
        out.append(_prompt_request(tokenizer, rng, i, input_len, output_len))
    return out


def long_prompt(
    tokenizer: Tokenizer,
    num_requests: int,
    seed: int,
    *,
    long_fraction: float = 0.2,
    long_range: tuple[int, int] = (1024, 2048),
    short_range: tuple[int, int] = (32, 256),
    output_range: tuple[int, int] = (16, 256),
) -> list[BenchRequest]:
    """Short chats with a `long_fraction` of long prompts (uniform in `long_range`) mixed in:
    the case disaggregation is for (long prefills must not stall the short streams)."""
    assert 0.0 <= long_fraction <= 1.0, long_fraction
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        if rng.random() < long_fraction:
            input_len = rng.randint(*long_range)
        else:
            input_len = log_uniform_int(rng, *short_range)
        output_len = log_uniform_int(rng, *output_range)
        out.append(_prompt_request(tokenizer, rng, i, input_len, output_len))
    return out


def shared_prefix(
    tokenizer: Tokenizer,
    num_requests: int,
    seed: int,
    *,
    system_len: int = 1024,
    question_range: tuple[int, int] = (32, 128),
    output_range: tuple[int, int] = (16, 128),
    multi_turn_fraction: float = 0.5,
    max_turns: int = 4,
) -> list[BenchRequest]:
    """Chats that all start with the same `system_len`-token system prompt.

    Requests are drawn as sessions: with probability `multi_turn_fraction` a session is a
    conversation of 2..`max_turns` turns, each turn resending the whole history (system,
    earlier questions, and earlier answers synthesized at their output length — the real
    answers are not known before the run); otherwise a single question. Turns are ordered
    by turn index, then session, so a conversation's later turns come after its earlier
    ones and other sessions' traffic in between. Message contents hit their token targets
    exactly; `prompt_tokens` is the rendered template length (see the module doc).
    """
    assert 0.0 <= multi_turn_fraction <= 1.0 and max_turns >= 2
    rng = random.Random(seed)
    system = ChatMessage("system", fit_text(tokenizer, rng, system_len))
    sessions: list[list[tuple[tuple[ChatMessage, ...], int]]] = []
    remaining = num_requests
    while remaining > 0:
        turns = 1
        if rng.random() < multi_turn_fraction:
            turns = min(remaining, rng.randint(2, max_turns))
        history: tuple[ChatMessage, ...] = (system,)
        session = []
        for _ in range(turns):
            question = ChatMessage(
                "user", fit_text(tokenizer, rng, log_uniform_int(rng, *question_range))
            )
            output_len = log_uniform_int(rng, *output_range)
            history = history + (question,)
            session.append((history, output_len))
            history = history + (ChatMessage("assistant", fit_text(tokenizer, rng, output_len)),)
        sessions.append(session)
        remaining -= turns

    out: list[BenchRequest] = []
    for turn in range(max(len(s) for s in sessions) if sessions else 0):
        for session_id, session in enumerate(sessions):
            if turn >= len(session):
                continue
            messages, output_len = session[turn]
            out.append(
                BenchRequest(
                    request_id=len(out),
                    messages=messages,
                    prompt_tokens=chat_prompt_tokens(tokenizer, messages),
                    output_tokens=output_len,
                    session_id=session_id if len(session) > 1 else None,
                    turn=turn,
                )
            )
    return out


WorkloadFn = Callable[..., list[BenchRequest]]
WORKLOADS: dict[str, WorkloadFn] = {
    "fixed": fixed,
    "mixed": mixed,
    "long-prompt": long_prompt,
    "shared-prefix": shared_prefix,
}


def make_workload(
    name: str, tokenizer: Tokenizer, num_requests: int, seed: int, **params: Any
) -> list[BenchRequest]:
    """Build workload `name` (a key of `WORKLOADS`); `params` go to its generator."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    return WORKLOADS[name](tokenizer, num_requests, seed, **params)


def with_arrivals(requests: Sequence[BenchRequest], rate: float, seed: int) -> list[BenchRequest]:
    """Copies of `requests` with arrival offsets: all at 0 for `rate=inf`, else a Poisson
    process of `rate` requests/s (seeded exponential gaps; the first request at 0).

    The gaps use their own stream derived from `seed`, so they are not correlated with
    the lengths a workload drew from `random.Random(seed)`."""
    assert rate > 0, rate
    if math.isinf(rate):
        return [dataclasses.replace(r, arrival_s=0.0) for r in requests]
    rng = random.Random(f"arrivals:{seed}")
    t = 0.0
    out = []
    for i, req in enumerate(requests):
        if i > 0:
            t += rng.expovariate(rate)
        out.append(dataclasses.replace(req, arrival_s=t))
    return out


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: the workload with arrivals at `rate`."""

    rate: float
    requests: tuple[BenchRequest, ...]


def rate_sweep(
    requests: Sequence[BenchRequest], rates: Sequence[float], seed: int
) -> list[PlannedRun]:
    """The same requests at each rate (same seed, so arrival gaps scale with 1/rate)."""
    return [PlannedRun(rate, tuple(with_arrivals(requests, rate, seed))) for rate in rates]
