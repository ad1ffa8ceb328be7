"""Output text: token ids in, client-ready text deltas out.

`IncrementalDetokenizer` (engine) turns ids into whole characters; `StopMatcher` then
holds back any tail that could still grow into a stop string, and cuts the text at the
first complete one (the match itself is not returned). `TextOutput` chains the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.engine.detokenizer import IncrementalDetokenizer


class StopMatcher:
    """Stop strings over a stream of text deltas, matches spanning deltas included."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Text that is safe to emit now. After a match, `stopped` is True and nothing more
        is emitted."""
        if self.stopped:
            return ""
        buf = self._held + delta
        if not self.stops:
            return buf
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[:min(hits)]
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of the stream: the held-back tail (it never became a stop string)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


class TextOutput:
    """Detokenize and apply stop strings for one request."""

    def __init__(self, tokenizer: Any | None, prompt_token_ids: Sequence[int],
                 stops: Sequence[str]) -> None:
        self._detok = (IncrementalDetokenizer(tokenizer, list(prompt_token_ids))
                       if tokenizer is not None else None)
        self._stop = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        """A stop string matched: the request is done, whatever the worker does next."""
        return self._stop.stopped

    def add(self, token_ids: Sequence[int]) -> str:
        if self._detok is None or not token_ids:
            return ""
        return self._stop.feed(self._detok.add(list(token_ids)))

    def finish(self) -> str:
        """The sequence ended at the worker: release what was held back."""
        if self._detok is None:
            return ""
        text = self._stop.feed(self._detok.flush())
        return text + self._stop.flush()
