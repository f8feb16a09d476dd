"""The one check of a call's lengths: max_new_tokens and min_new_tokens against the prompt and the context.

`Model.generate` and the server's engine each call `check_limits` once per prompt, in their own
argument names (`LimitNames`); its `LimitError` says which limit failed (`field`), so the server
can answer on the request's own field (`LimitError.renamed`).
"""

from __future__ import annotations

import dataclasses
import numbers

from .._errors import GenerationError


@dataclasses.dataclass(frozen=True)
class LimitNames:
    """How the caller names each length in its messages."""

    max_new_tokens: str = "max_new_tokens"
    min_new_tokens: str = "min_new_tokens"
    prompt: str = "the prompt"
    context: str = "the model's context"  # e.g. "max_model_len=256"


class LimitError(GenerationError):
    """A length that does not fit; `field` is the one to change: "max_new_tokens", "min_new_tokens" or
    "prompt". `renamed(names)` is the same error in another caller's names (a server's request fields)."""

    def __init__(self, field: str, message, names: LimitNames):
        super().__init__(message(names))
        self.field, self.names, self._message = field, names, message

    def renamed(self, **names: str) -> str:
        """This error's one line, with the `LimitNames` fields given here in place of the caller's."""
        return self._message(dataclasses.replace(self.names, **names))


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_limits(
    prompt_tokens: int,
    max_new_tokens: int | None,
    *,
    context: int | None,
    min_new_tokens: int | None = None,
    names: LimitNames = LimitNames(),
) -> int:
    """Checks a prompt of `prompt_tokens` tokens with `max_new_tokens` new ones (None: the rest of the
    context) and, where given, `min_new_tokens` against `context` tokens (None: unknown, so only the
    values themselves are checked). Returns max_new_tokens, the rest of the context where it was None.

    Raises:
        LimitError: max_new_tokens not a whole number >= 1, min_new_tokens not one >= 0 or above
            max_new_tokens, or the prompt and max_new_tokens past the context; naming the value and the fix.
    """
    room = None if context is None else context - prompt_tokens
    if max_new_tokens is None and room is None:
        raise LimitError(
            "max_new_tokens",
            lambda n: f"{n.max_new_tokens} is unset and {n.context} unknown; pass {n.max_new_tokens}=N",
            names,
        )
    if max_new_tokens is not None and (not _whole(max_new_tokens) or max_new_tokens < 1):
        raise LimitError(
            "max_new_tokens",
            lambda n: (
                f"{n.max_new_tokens}={max_new_tokens!r} must be a positive integer; pass "
                + (f"one in [1, {room}]" if room is not None and room > 0 else f"e.g. {n.max_new_tokens}=32")
            ),
            names,
        )
    if min_new_tokens is not None and (not _whole(min_new_tokens) or min_new_tokens < 0):
        raise LimitError(
            "min_new_tokens",
            lambda n: f"{n.min_new_tokens}={min_new_tokens!r} must be an integer >= 0; pass e.g. {n.min_new_tokens}=0",
            names,
        )
    if room is not None and room < 1:
        raise LimitError(
            "prompt",
            lambda n: (
                f"{n.prompt} has {prompt_tokens} tokens; {n.context} leaves no room for an answer. Shorten {n.prompt}"
            ),
            names,
        )
    if room is not None and max_new_tokens is not None and max_new_tokens > room:
        raise LimitError(
            "max_new_tokens",
            lambda n: (
                f"{n.prompt} has {prompt_tokens} tokens and {n.max_new_tokens}={max_new_tokens}, "
                f"{prompt_tokens + max_new_tokens} in all, more than {n.context}; shorten {n.prompt} or pass "
                f"{n.max_new_tokens}<={room}"
            ),
            names,
        )
    given = max_new_tokens is not None
    max_new_tokens = room if max_new_tokens is None else int(max_new_tokens)
    if min_new_tokens is not None and min_new_tokens > max_new_tokens:
        raise LimitError(
            "min_new_tokens",
            lambda n: (
                f"{n.min_new_tokens}={min_new_tokens} is more than {n.max_new_tokens}={max_new_tokens}; "
                f"pass {n.min_new_tokens}<={max_new_tokens}"
                if given
                else f"{n.min_new_tokens}={min_new_tokens} is more than the {max_new_tokens} tokens {n.prompt} leaves of "
                f"{n.context}; pass {n.min_new_tokens}<={max_new_tokens} or a shorter prompt"
            ),
            names,
        )
    return max_new_tokens
