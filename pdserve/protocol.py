"""The request vocabulary every tier shares: sampling parameters (one set of defaults, one
validator), finish reasons (one map to the proto enum and to OpenAI's strings), per-token
logprobs, block ceil-division, and the limits a client value must respect.

Torch-free and grpc-free on purpose: the gateway, the client, the workers and the engine
all import it, and the gateway process never loads torch. Every validation error is a
`ProtocolError` whose `.field` names the offending field, so the client APIs report it as
`param` (HTTP) or in the INVALID_ARGUMENT message (gRPC) without parsing text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.protos.pdserve.v1 import common_pb2

# max_tokens when a request sets none; the gateway caps it by the context left
DEFAULT_MAX_TOKENS = 256
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_TIMEOUT_S = 24 * 3600.0  # a deadline further out than a day is a client bug


class ProtocolError(ValueError):
    """A client value out of range or of the wrong type; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


def cdiv(n: int, d: int) -> int:
    """ceil(n / d) for non-negative integers: the blocks `n` tokens fill."""
    return -(-n // d)


# -- finish reasons --------------------------------------------------------------------------
STOP, LENGTH, ABORT = "stop", "length", "abort"
_FINISH_TO_PROTO = {STOP: common_pb2.FINISH_REASON_STOP,
                    LENGTH: common_pb2.FINISH_REASON_LENGTH,
                    ABORT: common_pb2.FINISH_REASON_ABORT}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_to_proto(reason: str | None) -> int:
    """UNSPECIFIED for None (a stream's messages before the last)."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PROTO[reason]


def finish_from_proto(value: int) -> str | None:
    """None for UNSPECIFIED (or a value this version does not know)."""
    return _FINISH_FROM_PROTO.get(value)


# OpenAI's finish_reason strings are ours ("stop", "length"); an aborted request never
# reaches a client as a completion: the gateway turns it into an error status.


# -- logprobs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-N alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# -- sampling parameters ---------------------------------------------------------------------
def _int(name: str, v: Any, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(name, f"must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ProtocolError(name, f"must be in [{lo}, {hi}], got {v}")


def _num(name: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ProtocolError(name, f"must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ProtocolError(name, f"must be a finite number, got {v}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Constructing one validates it (ProtocolError)."""

    max_tokens: int = DEFAULT_MAX_TOKENS  # the first (prefill-sampled) token included
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off (0 from a client or the wire means off too)
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-N alternatives to return with each token
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    # Output tokens this request generated before it was re-admitted elsewhere (migration by
    # recompute): they are the last `output_offset` prompt tokens. Its k-th token here is
    # its (output_offset + k)-th output token for everything that depends on the output's
    # history: the seed stream position and the output-only (presence/frequency)
    # penalties. Limits are not shifted: max_tokens and min_tokens count tokens generated
    # here (the gateway reduces them when it re-admits). Set by the gateway only: a
    # client's value is refused (`CLIENT_FIELDS`).
    output_offset: int = 0

    def __post_init__(self) -> None:
        # Accept lists from callers while keeping the object hashable and immutable.
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ProtocolError("stop_token_ids", "must be a list of token ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """A repetition, presence or frequency penalty: sampling reads the output's tokens."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty
                                                      or self.frequency_penalty)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> SamplingParams:
        """From client fields; None means unset (the default applies)."""
        unknown = set(fields) - set(SAMPLING_FIELDS)
        if unknown:
            name = sorted(unknown)[0]
            raise ProtocolError(name, "is not a sampling parameter")
        return cls(**{k: v for k, v in fields.items() if v is not None})

    def validate(self) -> None:
        _int("max_tokens", self.max_tokens, 1, INT32_MAX)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _num(name, getattr(self, name)))
        if self.temperature < 0:
            raise ProtocolError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ProtocolError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k != -1:
            _int("top_k", self.top_k, 1, INT32_MAX)
        if not 0.0 <= self.min_p <= 1.0:
            raise ProtocolError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ProtocolError("repetition_penalty",
                                f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ProtocolError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0, UINT32_MAX)
        if self.seed is not None:
            _int("seed", self.seed, 0, 2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise ProtocolError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        _int("output_offset", self.output_offset, 0, INT32_MAX)

    def to_proto(self, with_max_tokens: bool = True) -> common_pb2.SamplingParams:
        """`with_max_tokens=False` for a prefill worker, which samples only the first
        token: max_tokens travels once per request, to the decode worker."""
        m = common_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, output_offset=self.output_offset)
        if with_max_tokens:
            m.max_tokens = self.max_tokens
        if self.seed is not None:
            m.seed = self.seed
        if self.logprobs is not None:
            m.logprobs = self.logprobs
        return m

    @classmethod
    def from_proto(cls, m: common_pb2.SamplingParams, first_token_only: bool = False
                   ) -> SamplingParams:
        """ProtocolError when a value is out of range. `first_token_only`: a prefill
        worker's view (max_tokens 1, whatever the message says)."""
        kw = proto_fields(m)
        if first_token_only:
            kw["max_tokens"] = 1
            kw["min_tokens"] = min(kw["min_tokens"], 1)
        return cls.from_fields(kw)


SAMPLING_FIELDS = tuple(f for f in SamplingParams.__dataclass_fields__)
_PROTO_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields
assert {f.name for f in _PROTO_FIELDS} == set(SAMPLING_FIELDS), "proto and dataclass differ"


def proto_fields(m: common_pb2.SamplingParams) -> dict[str, Any]:
    """The message as `SamplingParams.from_fields` arguments: an `optional` field left
    unset is None (the default applies, not zero)."""
    out: dict[str, Any] = {}
    for f in _PROTO_FIELDS:
        v = getattr(m, f.name)
        if f.has_presence and not m.HasField(f.name):
            v = None
        out[f.name] = tuple(v) if f.is_repeated else v
    return out


def sampling_proto(**fields: Any) -> common_pb2.SamplingParams:
    """A proto message from client keyword arguments, unset (None) fields left unset —
    the gateway applies the defaults. For clients that must not fix the defaults."""
    m = common_pb2.SamplingParams()
    for name, v in fields.items():
        if name not in SAMPLING_FIELDS:
            raise ProtocolError(name, "is not a sampling parameter")
        if v is None:
            continue
        if name == "stop_token_ids":
            m.stop_token_ids.extend(v)
        else:
            setattr(m, name, v)
    return m


def check_timeout(t: Any) -> float | None:
    """A request's timeout in seconds: None (no deadline of its own) or in (0, a day]."""
    if t is None:
        return None
    t = _num("timeout", t)
    if not 0 < t <= MAX_TIMEOUT_S:
        raise ProtocolError("timeout", f"must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {t:g}")
    return t


def check_priority(p: Any) -> int:
    _int("priority", p, -INT32_MAX, INT32_MAX)
    return p
