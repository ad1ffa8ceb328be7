"""Incremental detokenization: token ids in, text deltas out, never splitting a character.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character; decoding it
alone yields U+FFFD. We decode a short window of recent tokens and hold text back while it
ends in U+FFFD, so every delta is whole characters and the deltas concatenate to the text
of the full sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REPLACEMENT = "\ufffd"
_WINDOW = 6  # tokens of left context used to decode the next ones (merges and spaces)


def window_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """How a window of ids becomes text: the `tokenizers` backend directly where
    transformers' `decode` would return just what it returns (no clean-up of spaces),
    else `decode` itself. Every streamed token decodes two windows, and transformers'
    wrapper around the backend's call costs three times the call (10.5 against 3.5 us)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and callable(getattr(backend, "decode", None))
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decode = window_decoder(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = list(prompt_token_ids or [])[-_WINDOW:]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return ""  # an unfinished character (or nothing visible yet): wait for more
        delta = full[len(prefix):]
        self.prefix_offset = max(self.read_offset, len(self.token_ids) - _WINDOW)
        self.read_offset = len(self.token_ids)
        # keep memory bounded: only the window is ever decoded again
        if self.prefix_offset > 4 * _WINDOW:
            drop = self.prefix_offset - _WINDOW
            del self.token_ids[:drop]
            self.prefix_offset -= drop
            self.read_offset -= drop
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (even a U+FFFD)."""
        full = self._decode(self.token_ids[self.prefix_offset:])
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.read_offset = len(self.token_ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta
