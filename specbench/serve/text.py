"""Token ids to streamed text: incremental detokenization, stop strings, and where each piece came from.

Why not decode token by token: a byte-level tokenizer splits one character over several tokens
and a word's leading space depends on its neighbours, so each piece is the growth of the decoded
whole. Example: ids [9906, 11, 1917] decode to "Hello", "Hello,", "Hello, world": pieces "Hello",
",", " world". A piece that ends inside a character (U+FFFD) waits for the next token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

REPLACEMENT = "\ufffd"


@dataclass
class Piece:
    """Text a step added, and whether its tokens were accepted drafts or the target's own."""

    text: str
    source: str  # draft | target


class TextStream:
    """Feeds generated ids in, gives back text pieces that are safe to send (no half character, no
    text that a stop string could still claim)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # decoded text of every id so far (what pieces have been cut from)
        self.sent = 0  # characters of `text` already sent
        self.pending: list[tuple[str, str]] = []  # (piece, source) decoded but not yet sent
        self.stopped = False

    def add(self, token_ids: Sequence[int], sources: Sequence[str]) -> tuple[list, bool]:
        """Pieces ready to send after these tokens, and whether a stop string ended the text."""
        for token, source in zip(token_ids, sources):
            self.ids.append(token)
            decoded = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if decoded.endswith(REPLACEMENT) or not decoded.startswith(self.text):
                continue  # half a character, or a retokenized tail: the next token settles it
            self.pending.append((decoded[len(self.text):], source))
            self.text = decoded
        cut = self._stop_at()
        if cut is not None:
            self.stopped = True
            return [Piece(text, source) for text, source in self._release(cut)], True
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return [Piece(text, source) for text, source in self._release(len(self.text) - hold)], False

    def flush(self) -> list:
        return [Piece(text, source) for text, source in self._release(len(self.text))]

    def _stop_at(self):
        """Where the first stop string begins in the text not yet sent (one that began earlier would
        have been whole, and found, before its start was sent: the last len(stop) - 1 characters wait)."""
        found = [index for s in self.stop if (index := self.text.find(s, self.sent)) >= 0]
        return min(found) if found else None

    def _release(self, until: int) -> list[tuple[str, str]]:
        """The pending pieces up to character `until` of the text (a piece cut there is split)."""
        out, position = [], self.sent
        while self.pending and position < until:
            text, source = self.pending[0]
            room = until - position
            if len(text) <= room:
                out.append(self.pending.pop(0))
                position += len(text)
            else:
                out.append((text[:room], source))
                self.pending[0] = (text[room:], source)
                position += room
        if self.stopped:
            self.pending = []
        self.sent = position
        return [(text, source) for text, source in out if text]

