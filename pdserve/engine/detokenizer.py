"""Incremental detokenization: token ids in, text deltas out, never splitting a character.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character; decoding it
alone yields U+FFFD. We decode a short window of recent tokens and hold text back while it
ends in U+FFFD, so every delta is whole characters and the deltas concatenate to the text
of the full sequence.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
_WINDOW = 6  # tokens of left context used to decode the next ones (merges and spaces)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids or [])[-_WINDOW:]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

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
