"""One chat or completion answer in OpenAI's shapes, built from the engine's events of its choices:
the whole answer, or its server-sent events as the tokens arrive (`Answer`).
"""

import json
import secrets
import time

from . import _protocol, _tools
from ._protocol import ApiError
from ._requests import Event
from ._text import TokenText


class Answer:
    """One chat or completion answer, built from the engine's events of its n choices.

    A stream sends one event per engine event of a choice: the tokens that arrived together (a decode
    chunk's steps), as vLLM merges the deltas its consumer has not read yet. Its text is theirs, less
    what is held back (a partial UTF-8 character, the start of a possible stop string) to arrive with
    the token that releases it; its log-probabilities are one entry per token; on the answer's last
    the finish_reason. A cancelled answer ends with an event without a token.

    A chat answer read for tool calls (`generation.tool_parser`) streams its content until the text
    could be the start of a call (the parser's `held_from`); the rest is held back to the end, where
    the calls found go out as OpenAI's `delta.tool_calls` (each call's id, type and name, then its
    arguments) and finish_reason "tool_calls", or, where none is found, the held text as content.
    """

    def __init__(
        self, model: str, chat: bool, choices: int, prompt_tokens: int, token_text: TokenText,
        generation: _protocol.Generation,
    ):  # fmt: skip
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.generation = generation
        self.content_sent = [0] * choices  # characters of each choice's text streamed as content
        self.model, self.chat, self.token_text = model, chat, token_text
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.text = [""] * choices
        self.ids: list[list[int]] = [[] for _ in range(choices)]  # the answer's tokens so far
        self.logprobs: list[list[dict] | None] = [None] * choices  # one entry per token (`_entry`)
        self.token_chars = [0] * choices  # characters of the logprobs' token texts so far (text_offset)
        self.finish: list[str | None] = [None] * choices
        self.completion_tokens = [0] * choices

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.finish)

    def _record(self, index: int, event: Event) -> list[dict] | None:
        """Adds the event to choice `index`; returns its tokens' log-probability entries (None: not asked)."""
        entries = None if event.logprobs is None else []
        for token, logprob in zip(event.token_ids, event.logprobs or [None] * len(event.token_ids)):
            if logprob is not None:
                entries.append(self._entry(logprob, self.ids[index]))
            self.ids[index].append(token)
        if event.eos and event.logprobs is not None:  # the EOS token's, last
            entries.append(self._entry(event.logprobs[-1], self.ids[index]))
        self.text[index] += event.text
        if entries is not None:
            self.logprobs[index] = self.logprobs[index] or []
            self.logprobs[index].extend(entries)
            self.token_chars[index] += sum(len(e["token"]) for e in entries)
        self.completion_tokens[index] = event.completion_tokens
        if event.finish_reason is not None:
            self.finish[index] = "stop" if event.finish_reason in ("stop", "cancelled") else event.finish_reason
            if event.finish_reason == "error":
                raise ApiError(500, "the engine failed while generating this answer; see the server's log")
        return entries

    def collect(self, index: int, event: Event) -> None:
        self._record(index, event)

    def usage(self) -> dict:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }  # fmt: skip

    def _entry(self, logprob, before: list[int]) -> dict:
        """One token's log-probabilities in OpenAI's chat shape: its text after the answer's tokens
        `before` (`TokenText.text_of`), its own bytes, and the same of its alternatives."""

        def entry(token_id: int, value: float) -> dict:
            text = self.token_text.text_of(token_id, before)
            return {"token": text, "logprob": value, "bytes": list(self.token_text.bytes_of(token_id))}

        return {**entry(logprob.token_id, logprob.logprob), "top_logprobs": [entry(t, v) for t, v in logprob.top]}

    def _chat_logprobs(self, entries: list[dict] | None) -> dict | None:
        return None if entries is None else {"content": entries}

    @staticmethod
    def _completion_logprobs(entries: list[dict] | None, offset: int) -> dict | None:
        """The completions endpoint's shape; `offset`: the characters of the answer's tokens before these."""
        if entries is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{top["token"]: top["logprob"] for top in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    def _envelope(self, choices: list, *, chunk: bool) -> dict:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _tool_calls(self, index: int) -> _tools.Calls | None:
        """The tool calls of choice `index`'s finished answer (None: none, or not read for them)."""
        parser = self.generation.tool_parser if self.chat else None
        if parser is None:
            return None
        return parser.parse(self.text[index], self.generation.prompt, self.generation.tools or [])

    def whole(self) -> dict:
        choices = []
        for i, text in enumerate(self.text):
            if self.chat:
                message, finish = {"role": "assistant", "content": text}, self.finish[i]
                calls = self._tool_calls(i)
                if calls is not None:  # as vLLM: "tool_calls" however the answer ended
                    message = {"role": "assistant", "content": calls.content, "tool_calls": _tools.openai_calls(calls)}
                    finish = "tool_calls"
                choice = {
                    "index": i, "message": message, "logprobs": self._chat_logprobs(self.logprobs[i]),
                    "finish_reason": finish,
                }  # fmt: skip
            else:
                choice = {
                    "index": i, "text": text, "logprobs": self._completion_logprobs(self.logprobs[i], 0),
                    "finish_reason": self.finish[i],
                }  # fmt: skip
            choices.append(choice)
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def opening(self):
        if self.chat:
            for i in range(len(self.text)):
                delta = {"role": "assistant", "content": ""}
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                yield self._sse(self._envelope([choice], chunk=True))

    def stream(self, index: int, event: Event):
        """The server-sent event of one engine event: the tokens that arrived together (a decode chunk's,
        or a prefill's first), their text and log-probabilities, and on the answer's last the
        finish_reason. Nothing where it has nothing to say (its tokens' text held back, no logprobs asked)."""
        offset = self.token_chars[index]
        entries = self._record(index, event)
        reason, text = self.finish[index], event.text
        parser = self.generation.tool_parser if self.chat else None
        if parser is not None:  # stream the content up to where a tool call could begin
            answer, sent = self.text[index], self.content_sent[index]
            text = answer[sent : max(parser.held_from(answer, sent), sent)]
            self.content_sent[index] = sent + len(text)
            if reason is not None:
                yield from self._stream_calls(index, text, entries, reason)
                return
        if not text and entries is None and reason is None:
            return
        if self.chat:
            delta = {"content": text} if text or reason is None else {}
            choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(entries), "finish_reason": reason}
        else:
            logprobs = self._completion_logprobs(entries, offset)
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        yield self._sse(self._envelope([choice], chunk=True))

    def _stream_calls(self, index: int, text: str, token_entries: list[dict] | None, reason: str):
        """The last events of a chat answer read for tool calls: its last content, then the calls found
        (each call's id, type and name, then its arguments) and finish_reason "tool_calls", or the text
        held back as content and the answer's own finish_reason."""
        calls = self._tool_calls(index)
        held = self.text[index][self.content_sent[index] :]
        if calls is not None:
            held = (calls.content or "")[self.content_sent[index] :]
        text += held
        self.content_sent[index] += len(held)

        def chunk(delta: dict, entries=None, finish=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(entries), "finish_reason": finish}
            return self._sse(self._envelope([choice], chunk=True))

        if calls is None:
            yield chunk({"content": text} if text else {}, token_entries, reason)
            return
        if text or token_entries is not None:
            yield chunk({"content": text}, token_entries)
        for k, call in enumerate(_tools.openai_calls(calls)):
            function = call["function"]
            opening = {
                "index": k,
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": ""},
            }
            yield chunk({"tool_calls": [opening]})
            yield chunk({"tool_calls": [{"index": k, "function": {"arguments": function["arguments"]}}]})
        self.finish[index] = "tool_calls"
        yield chunk({}, finish="tool_calls")

    def usage_chunk(self) -> str:
        return self._sse({**self._envelope([], chunk=True), "usage": self.usage()})
