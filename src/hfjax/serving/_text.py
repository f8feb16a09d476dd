"""Token ids to streamed text: incremental decoding that holds back what may still change, and stop strings."""

from __future__ import annotations


class TextStream:
    """The text of a growing list of token ids, handed out in pieces that never change afterwards.

    A piece is held back while it ends in an unfinished character (a byte-level token that is
    part of one) or in the start of a stop string. `add` returns the new safe text and whether
    a stop string appeared; the text never includes the stop string itself.

    Example:
        >>> stream = TextStream(tokenizer, stops=("\\n\\n",))
        >>> piece, stopped = stream.add([1234, 98])
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed out
        self.text = ""

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """(the new text that is safe to send, whether a stop string has appeared)."""
        self.ids.extend(ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        found = [i for i in (self.text.find(stop, max(self.sent - len(stop), 0)) for stop in self.stops) if i >= 0]
        if found:
            end = min(found)
            piece, self.sent, self.text = self.text[self.sent : end], end, self.text[:end]
            return piece, True
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        end -= _held_for_stop(self.text[:end], self.stops)
        piece = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece, False

    def rest(self) -> str:
        """The text still held back, at the end of the request."""
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece


def _held_for_stop(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
