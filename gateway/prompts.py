"""The model as the gateway knows it: tokenizer, chat template, context length, and the
validation that turns client fields into a `GenerationRequest` (both client APIs call this,
so a field is checked one way, with the same message naming it)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.gateway.errors import ErrorKind, GatewayError, invalid, param_of
from pdserve.gateway.request import GenerationRequest

# SamplingParams fields a client may set; None means "unset" (the default applies).
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
                   "stop_token_ids", "ignore_eos", "min_tokens")


@dataclass(frozen=True)
class ModelCard:
    model_id: str
    max_context_tokens: int
    vocab_size: int


class PromptProcessor:
    def __init__(self, model_id: str, tokenizer: Any | None, max_context_tokens: int,
                 vocab_size: int, default_max_tokens: int) -> None:
        self.card = ModelCard(model_id, max_context_tokens, vocab_size)
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self._aliases = {model_id, os.path.basename(model_id.rstrip("/")), ""}

    # -- model ------------------------------------------------------------------------------
    def is_model(self, model: str) -> bool:
        return model in self._aliases or os.path.basename(model.rstrip("/")) in self._aliases

    def check_model(self, model: str | None) -> None:
        if model is None or model in self._aliases:
            return
        raise GatewayError(ErrorKind.UNKNOWN_MODEL,
                           f"model: {model!r} does not exist; this gateway serves "
                           f"{self.card.model_id!r}", "model")

    # -- prompt -----------------------------------------------------------------------------
    def encode_text(self, text: str, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise invalid(f"{param}: this model has no tokenizer; send token ids", param)
        if not text:
            raise invalid(f"{param}: must not be empty", param)
        return list(self.tokenizer.encode(text))

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if not messages:
            raise invalid("messages: must contain at least one message", "messages")
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise invalid("messages: this model has no chat template", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises for roles or orders a template refuses
            raise invalid(f"messages: the chat template refused them: {e}", "messages") from e
        return list(self.tokenizer.encode(text))

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        vocab = self.card.vocab_size
        if not ids:
            raise invalid(f"{param}: must contain at least one token", param)
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
               for t in ids):
            raise invalid(f"{param}: token ids must be integers in [0, {vocab})", param)
        return list(ids)

    # -- the request ------------------------------------------------------------------------
    def sampling(self, fields: Mapping[str, Any], num_prompt_tokens: int,
                 prompt_param: str = "prompt") -> SamplingParams:
        ctx = self.card.max_context_tokens
        if num_prompt_tokens >= ctx:
            raise invalid(f"{prompt_param}: {num_prompt_tokens} tokens do not fit the model's "
                          f"context of {ctx} tokens (prompt + at least one output token)",
                          prompt_param)
        kw = {k: v for k, v in fields.items() if k in SAMPLING_FIELDS and v is not None}
        room = ctx - num_prompt_tokens
        if "max_tokens" not in kw:
            kw["max_tokens"] = min(self.default_max_tokens, room)
        elif isinstance(kw["max_tokens"], int) and kw["max_tokens"] > room:
            raise invalid(f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens "
                          f"({kw['max_tokens']}) exceeds the model's context of {ctx} tokens",
                          "max_tokens")
        if kw.get("top_k") == 0:
            kw["top_k"] = -1
        if any(not isinstance(t, int) or isinstance(t, bool) or t >= self.card.vocab_size
               for t in kw.get("stop_token_ids", ())):
            raise invalid(f"stop_token_ids: must be token ids in [0, {self.card.vocab_size})",
                          "stop_token_ids")
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            raise invalid(str(e), param_of(str(e))) from e

    def request(self, request_id: str | None, prompt_token_ids: Sequence[int],
                fields: Mapping[str, Any], stop: Sequence[str] = (), priority: int = 0,
                timeout_s: float | None = None, prompt_param: str = "prompt",
                arrival: float | None = None) -> GenerationRequest:
        ids = self.check_token_ids(prompt_token_ids, prompt_param)
        params = self.sampling(fields, len(ids), prompt_param)
        if any(not isinstance(s, str) for s in stop):
            raise invalid("stop: must be a string or a list of strings", "stop")
        if len(stop) > 16:
            raise invalid("stop: at most 16 stop strings", "stop")
        if timeout_s is not None and not timeout_s > 0:
            raise invalid(f"timeout: must be > 0 seconds, got {timeout_s}", "timeout")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise invalid("priority: must be an integer", "priority")
        return GenerationRequest(
            request_id=request_id or uuid.uuid4().hex, prompt_token_ids=tuple(ids),
            params=params, stop=tuple(s for s in stop if s), priority=priority,
            timeout_s=timeout_s,
            arrival=time.monotonic() if arrival is None else arrival)
