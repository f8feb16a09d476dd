"""Structured outputs on the host: constraints compiled by llguidance, and each row's matcher.

    Constraint   what an answer must be: a JSON schema, any JSON object, a regex, one of a few
                 strings, or a Lark grammar (frozen, hashable: the key of the compiled grammars)
    Grammars     one tokenizer's llguidance view and its compiled constraints (kept, least recently
                 used dropped first); hands out a `Matcher` per row
    Matcher      one row's place in its grammar: fills the row's allowed-token bitmask, takes the
                 token the row chose, says whether the answer may or must end

A bitmask row is [ceil(V / 32)] int32 over the model's logits width V, bit j of word i set where
token 32i + j is allowed (llguidance's layout); logits columns past the tokenizer's vocabulary are
never allowed. The device applies it in the token choice (`_sampling.allowed_only`).

JSON is written as `json.dumps` writes it (", " and ": " between items, no other whitespace), so a
model cannot spend its answer on whitespace.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Sequence
from typing import Literal

import numpy as np

from .._errors import GenerationError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KEPT_GRAMMARS = 256  # compiled constraints a `Grammars` keeps


class ConstraintError(GenerationError):
    """A constraint the grammar engine cannot compile; the message carries the engine's reason."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What an answer must be. `text`: the schema as canonical JSON, the regex, the choices as a JSON
    list, or the Lark grammar. Build one with the class methods.

    Example:
        >>> Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
        >>> Constraint.choice(["yes", "no"])
    """

    kind: Kind
    text: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ConstraintError(f"json_schema is not JSON ({error}); pass a JSON schema object") from None
        if not isinstance(schema, dict):
            raise ConstraintError(f"json_schema={schema!r} is not an object; pass a JSON schema object")
        return cls("json_schema", json.dumps(schema))  # (key order kept: llguidance writes properties in it)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError(f"regex={pattern!r}; pass a non-empty regular expression")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ConstraintError(f"choice={choices!r}; pass a list of one or more non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        if not isinstance(lark, str) or not lark.strip():
            raise ConstraintError(f"grammar={lark!r}; pass a Lark grammar with a `start` rule")
        return cls("grammar", lark)

    @classmethod
    def response_format(cls, value: dict) -> Constraint | None:
        """OpenAI's `response_format`: {"type": "text"} (None: no constraint), {"type": "json_object"},
        or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (enforced whether strict
        or not; without a schema, any JSON object)."""
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind != "json_schema":
            raise ConstraintError(
                f"response_format={value!r}: pass {{'type': 'text'}}, {{'type': 'json_object'}} or "
                "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}"
            )
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ConstraintError(f"response_format.json_schema={spec!r}: pass an object with a 'name' and a 'schema'")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ConstraintError(f"response_format.json_schema.strict={spec['strict']!r}: pass true or false")
        return cls.json_object() if spec.get("schema") is None else cls.json_schema(spec["schema"])

    def source(self) -> str:
        """The constraint as an llguidance grammar."""
        llguidance = _llguidance()

        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=_JSON_STYLE)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_STYLE)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":  # Lark string literals take JSON's escapes
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.text))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(self.text)


# Model.generate's keywords, one of which makes its constraint.
KEYWORDS = ("json_schema", "regex", "choice", "grammar", "response_format")


def constraint_of(arguments: dict) -> Constraint | None:
    """The constraint that `Model.generate`'s keywords (`KEYWORDS`, popped from `arguments`) ask for, or None."""
    given = {name: arguments.pop(name) for name in KEYWORDS if arguments.get(name) is not None}
    for name in KEYWORDS:
        arguments.pop(name, None)
    if len(given) > 1:
        raise ConstraintError(
            f"Model.generate: {' and '.join(given)} given; pass one constraint of {', '.join(KEYWORDS)}"
        )
    if not given:
        return None
    ((name, value),) = given.items()
    return getattr(Constraint, name)(value)


def bitmask_words(size: int) -> int:
    """int32 words of a bitmask row over `size` tokens (32 tokens a word)."""
    return (size + 31) // 32


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        raise ConstraintError(
            "structured outputs need llguidance, which is not installed; run `pip install 'hfjax[serve]'`"
        ) from None
    return llguidance


class Grammars:
    """Constraints compiled for one tokenizer, whose masks cover `vocab_size` logits (the model's
    width, which may exceed the tokenizer's vocabulary); the answer ends at `eos_token_ids`.
    Thread-safe: a server compiles off its event loop while its engine thread makes matchers."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Sequence[int]):
        llguidance = _llguidance()
        if not eos_token_ids:
            raise ConstraintError("structured outputs need an EOS token to end the answer; the tokenizer has none")
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.tokenizer_size = len(tokenizer)
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self.tokenizer_size, eos_token=list(eos_token_ids)
            )
        except ValueError as error:  # a slow tokenizer, or a decoder llguidance cannot read
            raise ConstraintError(
                f"llguidance cannot read {type(tokenizer).__name__} ({error}); structured outputs need a fast "
                "tokenizer with a byte-level or SentencePiece decoder"
            ) from None
        self._compiled: collections.OrderedDict[Constraint, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint):
        """The constraint's compiled llguidance matcher at its start (kept). Raises ConstraintError
        with llguidance's reason where it rejects the constraint."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        llguidance = _llguidance()
        try:
            matcher = llguidance.LLMatcher(self._tokenizer, constraint.source(), log_level=0)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ConstraintError(f"llguidance cannot compile this {constraint.kind}: {error}") from None
        if matcher.is_error():
            raise ConstraintError(f"llguidance cannot compile this {constraint.kind}: {matcher.get_error().strip()}")
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > KEPT_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: Constraint) -> Matcher:
        """A row's matcher at the start of `constraint` (compiled once, copied per row)."""
        return Matcher(self.compile(constraint).deep_copy(), self)


class Matcher:
    """One row's place in its grammar."""

    def __init__(self, matcher, grammars: Grammars):
        self._matcher = matcher
        self._fill = _llguidance().numpy.fill_next_token_bitmask
        self._words = bitmask_words(grammars.tokenizer_size)
        self._scratch = np.zeros((1, self._words), np.int32)  # llguidance's width: the tokenizer's
        self._shared = min(self._words, grammars.words)

    def fill(self, row: np.ndarray) -> None:
        """Writes the tokens allowed next into `row` [ceil(V / 32)] int32 (in place)."""
        self._fill(self._matcher, self._scratch, 0)
        row[: self._shared] = self._scratch[0, : self._shared]
        row[self._shared :] = 0

    def consume(self, token: int) -> bool:
        """Moves on by the token the row chose; False where the grammar does not allow it."""
        return bool(self._matcher.consume_token(int(token)))

    @property
    def stopped(self) -> bool:
        """The answer is complete: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The answer so far is a complete one (EOS may follow)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """llguidance's reason where the matcher left its grammar (a token it did not allow), else None."""
        return self._matcher.get_error() if self._matcher.is_error() else None
