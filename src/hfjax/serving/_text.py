"""Token ids to streamed text: incremental decoding that holds back what may still change, and stop strings."""

from __future__ import annotations

# Tokens decoded before the new ones, for their context: a SentencePiece token decoded first
# loses its leading space, and a character split over byte-level tokens needs its first bytes.
_CONTEXT_TOKENS = 6
_UNFINISHED = 4  # a UTF-8 character has at most 4 bytes: held for at most as many tokens


class TextStream:
    """The text of a growing list of token ids, handed out in pieces that never change afterwards.

    Each `add` decodes only the new ids and a few before them (the text they add is the
    difference), so a long answer costs O(tokens), not a decode of everything at every chunk.
    Where the few tokens before read differently once the new ones follow (a tokenizer's
    clean-up of spaces), it decodes everything once instead.

    A piece is held back while it ends in an unfinished character (a byte-level token that is
    part of one) or in the start of a stop string. `add` returns the new safe text and whether
    a stop string appeared; the text never includes the stop string itself. As in vLLM, a stop
    string counts only where it ends in the text of a token after the first `min_tokens`.

    Example:
        >>> stream = TextStream(tokenizer, stops=("\\n\\n",))
        >>> piece, stopped = stream.add([1234, 98])
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), *, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.read = 0  # ids whose text is in self.text
        self.sent = 0  # characters of the text handed out
        self.unchecked = 0  # characters of the text in which no stop string may end (the first min_tokens tokens')
        self.exempt_final = min_tokens == 0  # whether `unchecked` is final

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """(the new text that is safe to send, whether a stop string has appeared)."""
        self.ids.extend(ids)
        self._decode_new()
        if self.read <= self.min_tokens:
            self.unchecked = len(self.text)
        elif not self.exempt_final:  # the first min_tokens ids' text is exempt, the rest is not
            self.unchecked = len(self.tokenizer.decode(self.ids[: self.min_tokens], skip_special_tokens=True))
            self.exempt_final = True
        start = max(self.sent, self.unchecked + 1)  # a stop string must end past both
        found = [i for i in (self.text.find(stop, max(start - len(stop), 0)) for stop in self.stops) if i >= 0]
        if found:
            end = min(found)
            piece, self.sent, self.text = self.text[self.sent : end], end, self.text[:end]
            return piece, True
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        end -= _held_for_stop(self.text, end, self.stops)
        piece = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece, False

    def _decode_new(self, *, final: bool = False) -> None:
        """Brings self.text up to the ids read so far. Ids that end in an unfinished character wait
        for its last bytes (at most _UNFINISHED of them; at the end of the request, none)."""
        if self.read == len(self.ids):
            return
        decode = self.tokenizer.decode
        context = max(self.read - _CONTEXT_TOKENS, 0)
        before = decode(self.ids[context : self.read], skip_special_tokens=True)
        after = decode(self.ids[context:], skip_special_tokens=True)
        if after.endswith("\ufffd") and len(self.ids) - self.read < _UNFINISHED and not final:
            return
        # (the context may begin inside a character: its bytes there read as U+FFFD, in both)
        if after.startswith(before) and self.text.endswith(before.lstrip("\ufffd")):
            self.text += after[len(before) :]
        else:  # the earlier tokens read differently with the new ones after them
            self.text = decode(self.ids, skip_special_tokens=True)
        self.read = len(self.ids)

    def rest(self) -> str:
        """The text still held back, at the end of the request."""
        self._decode_new(final=True)
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece


def _held_for_stop(text: str, end: int, stops: tuple[str, ...]) -> int:
    """How many characters before `end` in `text` could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, end), longest, -1):
            if text.endswith(stop[:size], 0, end):
                longest = size
                break
    return longest
