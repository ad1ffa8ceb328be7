"""The OpenAI-compatible wire format: request bodies of /v1/completions and
/v1/chat/completions parsed into checked fields, and deltas rendered back into OpenAI's
response objects and SSE chunks. Pure functions; `http_api.py` does the I/O."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.gateway.errors import GatewayError, invalid
from pdserve.gateway.request import GenerationDelta, Usage
from pdserve.protocol import SAMPLING_FIELDS, ProtocolError, TokenLogprobs, check_timeout

TokenText = Callable[[int], str]

MAX_JSON_DEPTH = 32  # a chat request nests 4 deep; anything near this is an attack

# sampling fields OpenAI spells its own way (max_completion_tokens, chat's logprobs flag)
_OWN_SPELLING = ("max_tokens", "logprobs")


@dataclass(frozen=True)
class OpenAIRequest:
    chat: bool
    model: str | None
    prompt_text: str | None = None  # completions: text ...
    prompt_token_ids: tuple[int, ...] | None = None  # ... or token ids
    messages: tuple[dict, ...] = ()  # chat
    sampling: dict = field(default_factory=dict)  # SamplingParams keyword arguments
    stop: tuple[str, ...] = ()
    priority: int = 0
    timeout_s: float | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # render logprobs in the response
    request_id: str | None = None


# -- parsing ---------------------------------------------------------------------------------
# a JSON string, escapes included (the unrolled form keeps the regex linear)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in `raw`, found without parsing it (strings are
    blanked first, so brackets inside them do not count)."""
    steps = _NESTING[np.frombuffer(_JSON_STRING.sub(b'""', raw), np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def _check_text(v: Any, path: str) -> None:
    """Every string can be encoded as UTF-8 (JSON escapes can spell lone surrogates)."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise invalid(f"{path}: contains a lone surrogate (\\u{ord(v[e.start]):04x} at "
                          f"character {e.start}), which is not text",
                          path.split("[", 1)[0].split(".", 1)[0]) from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_text(k, path)
            _check_text(x, f"{path}.{k}" if path else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_text(x, f"{path}[{i}]")


def decode_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """The request body as a dict. CPU-bound for big bodies: call it off the event loop."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"body: not valid UTF-8 ({e.reason} at byte {e.start})", "body") from e
    if json_depth(raw) > max_depth:
        raise invalid(f"body: JSON nests deeper than {max_depth} levels", "body")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(f"body: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})",
                      "body") from e
    if not isinstance(body, dict):
        raise invalid("body: must be a JSON object", "body")
    _check_text(body, "")
    return body


def _get(body: Mapping[str, Any], name: str, kind: str, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool)
          and math.isfinite(v),
          "bool": isinstance(v, bool),
          "str": isinstance(v, str),
          "dict": isinstance(v, dict),
          "list": isinstance(v, list)}[kind]
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise invalid(f"{name}: must be {article} {kind}, got {json.dumps(v)[:40]}", name)
    return float(v) if kind == "number" else v


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or any(not isinstance(s, str) for s in v):
        raise invalid("stop: must be a string or a list of strings", "stop")
    return tuple(s for s in v if s)


def _timeout(body: Mapping[str, Any], header: str | None) -> float | None:
    t = _get(body, "timeout", "number")
    if t is None and header:
        try:
            t = float(header)
        except ValueError:
            raise invalid(f"timeout: X-Request-Timeout {header!r} is not a number of seconds",
                          "timeout") from None
    try:
        return check_timeout(t)
    except ProtocolError as e:
        raise invalid(e.message, e.field) from None


def _common(body: Mapping[str, Any], timeout_header: str | None) -> dict[str, Any]:
    n = _get(body, "n", "int", 1)
    if n != 1:
        raise invalid(f"n: only n=1 is supported, got {n}", "n")
    if _get(body, "best_of", "int", 1) != 1:
        raise invalid("best_of: only best_of=1 is supported", "best_of")
    # passed as sent: SamplingParams checks types and ranges, naming the field
    sampling = {k: body.get(k) for k in SAMPLING_FIELDS if k not in _OWN_SPELLING}
    opts = _get(body, "stream_options", "dict", {})
    stream = _get(body, "stream", "bool", False)
    return {"model": _get(body, "model", "str"), "sampling": sampling, "stop": _stop(body),
                "priority": _get(body, "priority", "int", 0),
                "timeout_s": _timeout(body, timeout_header), "stream": stream,
                "include_usage": bool(stream and opts.get("include_usage")),
                "request_id": _get(body, "request_id", "str")}


def parse_completion(body: Mapping[str, Any], timeout_header: str | None = None
                     ) -> OpenAIRequest:
    c = _common(body, timeout_header)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
        if not text:
            raise invalid("prompt: must not be empty", "prompt")
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = tuple(prompt)
    elif prompt is None:
        raise invalid("prompt: is required", "prompt")
    else:
        raise invalid("prompt: must be a string or a list of token ids (batches of several "
                      "prompts are not supported: send one request per prompt)", "prompt")
    if _get(body, "echo", "bool", False):
        raise invalid("echo: is not supported", "echo")
    if body.get("suffix"):
        raise invalid("suffix: is not supported", "suffix")
    lp = _get(body, "logprobs", "int")
    c["sampling"]["logprobs"] = lp
    c["sampling"]["max_tokens"] = _get(body, "max_tokens", "int")
    return OpenAIRequest(chat=False, prompt_text=text, prompt_token_ids=ids,
                         logprobs=lp is not None, **c)


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise invalid(f"messages[{i}]: must be an object with a string 'role'", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is understood
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or \
                    not isinstance(p.get("text"), str):
                raise invalid(f"messages[{i}].content: only text parts are supported",
                              "messages")
            parts.append(p["text"])
        content = "".join(parts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise invalid(f"messages[{i}].content: must be a string or a list of text parts",
                      "messages")
    return {"role": m["role"], "content": content}


def parse_chat(body: Mapping[str, Any], timeout_header: str | None = None) -> OpenAIRequest:
    c = _common(body, timeout_header)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages: must be a non-empty list of messages", "messages")
    messages = tuple(_message(m, i) for i, m in enumerate(msgs))
    want = _get(body, "logprobs", "bool", False)
    top = _get(body, "top_logprobs", "int")
    if top is not None and not want:
        raise invalid("top_logprobs: needs logprobs: true", "top_logprobs")
    c["sampling"]["logprobs"] = (top or 0) if want else None
    mt = _get(body, "max_completion_tokens", "int")
    c["sampling"]["max_tokens"] = mt if mt is not None else _get(body, "max_tokens", "int")
    return OpenAIRequest(chat=True, messages=messages, logprobs=want, **c)


# -- rendering -------------------------------------------------------------------------------
def usage_json(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


def completion_logprobs(lps: tuple[TokenLogprobs, ...], token_text: TokenText,
                        offset: int = 0) -> dict:
    tokens = [token_text(x.token_id) for x in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{token_text(t): lp for t, lp in x.top} for x in lps],
            "text_offset": offsets}


def chat_logprobs(lps: tuple[TokenLogprobs, ...], token_text: TokenText) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(x.token_id, x.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in lps]}


def error_json(e: GatewayError) -> dict:
    return {"error": {"message": e.message, "type": e.kind.openai_type, "param": e.param,
                      "code": e.code.lower()}}


class Renderer:
    """Builds one request's response objects (ids, timestamps, logprob rendering)."""

    def __init__(self, req: OpenAIRequest, request_id: str, model_id: str, created: int,
                 token_text: TokenText) -> None:
        self.req = req
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + request_id
        self.model = model_id
        self.created = created
        self.token_text = token_text
        self._offset = 0

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _lp(self, d: GenerationDelta) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.chat:
            return chat_logprobs(d.logprobs, self.token_text)
        out = completion_logprobs(d.logprobs, self.token_text, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out

    def chunk(self, d: GenerationDelta, first: bool) -> dict:
        if self.req.chat:
            delta: dict = {"role": "assistant", "content": d.text} if first else \
                {"content": d.text}
            choice = {"index": 0, "delta": delta, "logprobs": self._lp(d),
                      "finish_reason": d.finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": d.text, "logprobs": self._lp(d),
                      "finish_reason": d.finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, u: Usage) -> dict:
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_json(u)}

    def full(self, deltas: list[GenerationDelta]) -> dict:
        """The non-streaming response from every delta of the request."""
        last = deltas[-1]
        text = "".join(d.text for d in deltas)
        merged = GenerationDelta(text, logprobs=tuple(x for d in deltas for x in d.logprobs))
        lp = self._lp(merged)
        if self.req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": last.finish_reason}
            out = {**self._head("chat.completion"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp,
                      "finish_reason": last.finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        out["usage"] = usage_json(last.usage or Usage(0, 0))
        return out
