"""Incremental detokenization that never emits half a UTF-8 character, and
stop strings that never leak into the output.

tokenizers' DecodeStream returns nothing until a token completes a
character. Text that could still turn out to be the start of a stop string is
held back until it cannot. When the output ends inside a character, the final
text is what decoding every token gives, its replacement character included,
as Hugging Face's `decode` of the same tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped = False
        self._ids: list[int] = []
        self._pending = False  # the last tokens have not completed a character yet

    def push(self, token_id: int, stop: bool = True) -> None:
        """Appends a token's text; with `stop`, ends at a stop string."""
        self._ids.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        self._pending = not piece
        if piece:
            self.text += piece
        if stop and self._stop and not self.stopped:
            search_from = max(0, self._emitted - self._hold)
            found = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
            if found:
                self.text = self.text[: min(found)]
                self.stopped = True

    def take(self, final: bool) -> str:
        """New text to emit; `final` flushes what was held back, a character the
        output ended inside of included."""
        if final and self._pending and not self.stopped:
            whole = str(self._backend.decode(self._ids, skip_special_tokens=True))
            if whole.startswith(self.text):
                self.text = whole
            self._pending = False
        end = (
            len(self.text)
            if final or self.stopped
            else max(self._emitted, len(self.text) - self._hold)
        )
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def token_text(self, token_id: int) -> str:
        """A token's own text, for logprobs (partial characters shown as replacements)."""
        return str(self._backend.decode([token_id], skip_special_tokens=False))
