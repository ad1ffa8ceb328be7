"""The model as the gateway knows it: tokenizer, chat template, context length, and the
validation that turns client fields into a `GenerationRequest` (both client APIs call this,
so a field is checked one way, with the same message naming it).

Tokenizing and templating run on a small thread pool (`prompt_ids`), never on the event
loop: a long prompt must not stall /health, other requests' streams or heartbeats.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.engine.model_files import chat_text
from pdserve.gateway.errors import ErrorKind, GatewayError, invalid
from pdserve.gateway.request import GenerationRequest
from pdserve.protocol import (
    MAX_STOP_STRINGS,
    ProtocolError,
    SamplingParams,
    check_priority,
    check_timeout,
)


@dataclass(frozen=True)
class ModelCard:
    model_id: str
    max_context_tokens: int
    vocab_size: int


@dataclass(frozen=True)
class Prompt:
    """What a client sent as its prompt, before tokenization; `param` names its field."""

    param: str
    text: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None


class PromptProcessor:
    def __init__(self, model_id: str, tokenizer: Any | None, max_context_tokens: int,
                 vocab_size: int, default_max_tokens: int, tokenizer_threads: int = 2) -> None:
        self.card = ModelCard(model_id, max_context_tokens, vocab_size)
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self._aliases = {model_id, os.path.basename(model_id.rstrip("/")), ""}
        # tokenizing, templating and JSON parsing: CPU work kept off the event loop
        self.executor = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="tokenize")

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

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
    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, tokenized off the event loop. GatewayError(INVALID)."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if prompt.messages is not None:
            fn, arg = self.render_chat, prompt.messages
        else:
            fn, arg = self.encode_text, prompt.text or ""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, arg,
                                                                 prompt.param)

    def encode_text(self, text: str, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise invalid(f"{param}: this model has no tokenizer; send token ids", param)
        if not text:
            raise invalid(f"{param}: must not be empty", param)
        return list(self.tokenizer.encode(text))

    def render_chat(self, messages: Sequence[Mapping[str, str]], param: str = "messages"
                    ) -> list[int]:
        if not messages:
            raise invalid(f"{param}: must contain at least one message", param)
        try:
            text = chat_text(self.tokenizer, [dict(m) for m in messages])
        except ValueError as e:
            raise invalid(f"{param}: {e}", param) from e
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
        """The request's one SamplingParams: max_tokens resolved against the context left
        (unset: the default, capped by it; set: refused when it does not fit)."""
        ctx = self.card.max_context_tokens
        if num_prompt_tokens >= ctx:
            raise invalid(f"{prompt_param}: {num_prompt_tokens} tokens do not fit the model's "
                          f"context of {ctx} tokens (prompt + at least one output token)",
                          prompt_param)
        room = ctx - num_prompt_tokens
        kw = dict(fields)
        try:
            if kw.get("output_offset"):  # the gateway's own, for requests it migrates
                raise ProtocolError("output_offset", "is set by the gateway, not by clients")
            if kw.get("max_tokens") is None:
                kw["max_tokens"] = min(self.default_max_tokens, room)
            params = SamplingParams.from_fields(kw)
            if params.max_tokens > room:
                raise ProtocolError("max_tokens", f"prompt ({num_prompt_tokens} tokens) + "
                                    f"max_tokens ({params.max_tokens}) exceeds the model's "
                                    f"context of {ctx} tokens")
            if any(t >= self.card.vocab_size for t in params.stop_token_ids):
                raise ProtocolError("stop_token_ids",
                                    f"must be token ids in [0, {self.card.vocab_size})")
        except ProtocolError as e:
            raise invalid(e.message, e.field) from None
        except TypeError as e:  # a keyword SamplingParams does not have
            raise invalid(str(e)) from None
        return params

    def request(self, request_id: str | None, prompt_token_ids: Sequence[int],
                fields: Mapping[str, Any], stop: Sequence[str] = (), priority: int = 0,
                timeout_s: float | None = None, prompt_param: str = "prompt",
                arrival: float | None = None) -> GenerationRequest:
        ids = self.check_token_ids(prompt_token_ids, prompt_param)
        params = self.sampling(fields, len(ids), prompt_param)
        if any(not isinstance(s, str) for s in stop):
            raise invalid("stop: must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise invalid(f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop")
        try:
            timeout_s = check_timeout(timeout_s)
            priority = check_priority(priority)
        except ProtocolError as e:
            raise invalid(e.message, e.field) from None
        return GenerationRequest(
            request_id=request_id or uuid.uuid4().hex, prompt_token_ids=tuple(ids),
            params=params, stop=tuple(s for s in stop if s), priority=priority,
            timeout_s=timeout_s,
            arrival=time.monotonic() if arrival is None else arrival)
