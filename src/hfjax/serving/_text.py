"""Token ids to streamed text: incremental decoding that holds back what may still change, stop
strings, and each token's own bytes (for log-probabilities)."""

from __future__ import annotations

import codecs
import json
import re

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
    `skip_special_tokens=False` keeps special tokens' text (a tool call parser's markers).

    Example:
        >>> stream = TextStream(tokenizer, stops=("\\n\\n",))
        >>> piece, stopped = stream.add([1234, 98])
    """

    def __init__(
        self, tokenizer, stops: tuple[str, ...] = (), *, min_tokens: int = 0, skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = tuple(s for s in stops if s)
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.read = 0  # ids whose text is in self.text
        self.sent = 0  # characters of the text handed out
        self.unchecked = 0  # characters of the text in which no stop string may end (the first min_tokens tokens')
        self.exempt_final = min_tokens == 0  # whether `unchecked` is final
        self._last = (0, 0, "")  # (start, end, the text of ids[start:end]) of the last decode

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """(the new text that is safe to send, whether a stop string has appeared)."""
        self.ids.extend(ids)
        self._decode_new()
        if self.read <= self.min_tokens:
            self.unchecked = len(self.text)
        elif not self.exempt_final:  # the first min_tokens ids' text is exempt, the rest is not
            self.unchecked = len(
                self.tokenizer.decode(self.ids[: self.min_tokens], skip_special_tokens=self.skip_special_tokens)
            )
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
        end -= cut_start(self.text, end, self.stops)
        piece = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece, False

    def _decode_new(self, *, final: bool = False) -> None:
        """Brings self.text up to the ids read so far. Ids that end in an unfinished character wait
        for its last bytes (at most _UNFINISHED of them; at the end of the request, none)."""
        if self.read == len(self.ids):
            return
        decode = self.tokenizer.decode
        # The last decode read ids[start:read]: while that start is at most 2 x _CONTEXT_TOKENS back, it is
        # the context again and its text need not be decoded twice (a token at a time costs one decode).
        start, end, known = self._last
        if end == self.read and self.read - start <= 2 * _CONTEXT_TOKENS:
            context, before = start, known
        else:
            context = max(self.read - _CONTEXT_TOKENS, 0)
            before = decode(self.ids[context : self.read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[context:], skip_special_tokens=self.skip_special_tokens)
        if after.endswith("\ufffd") and len(self.ids) - self.read < _UNFINISHED and not final:
            return
        # (the context may begin inside a character: its bytes there read as U+FFFD, in both)
        if after.startswith(before) and self.text.endswith(before.lstrip("\ufffd")):
            self.text += after[len(before) :]
        else:  # the earlier tokens read differently with the new ones after them
            self.text = decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        self.read = len(self.ids)
        self._last = (context, self.read, after)

    def rest(self) -> str:
        """The text still held back, at the end of the request."""
        self._decode_new(final=True)
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece


def cut_start(text: str, end: int, marks: tuple[str, ...]) -> int:
    """How many characters before `end` in `text` could be the start of one of `marks` (a stop string,
    a tool call's opening) cut off there."""
    longest = 0
    for mark in marks:
        for size in range(min(len(mark) - 1, end), longest, -1):
            if text.endswith(mark[:size], 0, end):
                longest = size
                break
    return longest


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, {character: the byte it stands for}: the printable bytes stand
    for themselves, every other byte for a character from U+0100 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token for one raw byte


class TokenText:
    """A token's own bytes and the text it adds to an answer, for log-probabilities.

    `bytes_of(id)` is the token's own bytes, also where it holds only part of a UTF-8 character (a
    byte-level BPE token mapped back through the byte alphabet, a SentencePiece byte-fallback token
    `<0xE2>` its byte, any other token the UTF-8 of its text), so the bytes of the tokens of an
    answer join into the answer's UTF-8, as OpenAI's `bytes` field promises.

    `text_of(id, before)` is the text the token adds after the answer's tokens `before`, as vLLM
    reports a token: a token that leaves a character unfinished adds "", the one that finishes it
    adds the whole character.

    Example:
        >>> TokenText(tokenizer).bytes_of(tokenizer.convert_tokens_to_ids("Ã"))
        b'\\xc3'
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.byte_level = _byte_level_alphabet() if _decodes_byte_level(tokenizer) else None
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._own_bytes(token_id)
        return found

    def _own_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        if self.byte_level is not None and piece and all(c in self.byte_level for c in piece):
            return bytes(self.byte_level[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        text = self.tokenizer.decode([token_id])
        spaced = piece.replace("\u2581", " ")  # SentencePiece's word start: a space that decode drops first
        if "\u2581" in piece and spaced.strip() == text.strip():
            return spaced.encode("utf-8")
        return text.encode("utf-8")

    def text_of(self, token_id: int, before: list[int]) -> str:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for earlier in before[-(_UNFINISHED - 1) :]:  # a character's first bytes are in the last 3 tokens at most
            decoder.decode(self.bytes_of(earlier))
        return decoder.decode(self.bytes_of(token_id))


def _decodes_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder maps GPT-2's byte alphabet back to bytes (a ByteLevel decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return getattr(tokenizer, "byte_decoder", None) is not None  # transformers' Python GPT-2 tokenizer
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds, parts = set(), [decoder]
    while parts:
        part = parts.pop()
        kinds.add(part.get("type"))
        parts.extend(part.get("decoders") or [])
    return "ByteLevel" in kinds
