"""Structured outputs' request fields, as vLLM takes them, read into one `generation.Constraint`:

    response_format     OpenAI's: {"type": "text"} (no constraint), {"type": "json_object"}, or
                        {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                        (the schema is enforced whether `strict` is set or not)
    structured_outputs  vLLM's (the openai client's extra_body): one of {"json": a schema (object or
                        JSON text)}, {"regex": ...}, {"choice": [...]}, {"grammar": a Lark grammar},
                        {"json_object": true}

vLLM's older `guided_*` fields, which it removed, are refused with a 400 that names the field to send
instead. A problem is a `FieldError` naming the field; a constraint the grammar engine cannot compile
is the server's 400 too, with the engine's reason (`_routes_completions`, which compiles it off the event loop).
"""

from __future__ import annotations

from .. import generation
from ._tools import FieldError

FIELDS = ("response_format", "structured_outputs")
# vLLM's removed names, and what to send instead.
REMOVED = {
    "guided_json": "structured_outputs={'json': ...}",
    "guided_regex": "structured_outputs={'regex': ...}",
    "guided_choice": "structured_outputs={'choice': [...]}",
    "guided_grammar": "structured_outputs={'grammar': ...}",
    "guided_decoding_backend": "no backend field (hfjax serve's engine is llguidance)",
    "guided_whitespace_pattern": "no whitespace field (JSON is written as json.dumps writes it)",
}
_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def removed_field(name: str) -> str | None:
    """The message for a vLLM field that was removed (`REMOVED`), naming what to send; else None."""
    if name not in REMOVED:
        return None
    return f"{name} was removed from vLLM's API; send {REMOVED[name]} (in the openai client: extra_body)"


def constraint_of(body: dict) -> tuple[generation.Constraint | None, str | None]:
    """(the request's constraint, the field it came from), or (None, None) where it has none.

    Raises:
        FieldError: a malformed field, or both fields at once, naming the field.
    """
    given = [name for name in FIELDS if body.get(name) is not None and body.get(name) != {"type": "text"}]
    if len(given) > 1:
        raise FieldError("structured_outputs", "pass response_format or structured_outputs, not both")
    if not given:
        return None, None
    field = given[0]
    read = generation.Constraint.response_format if field == "response_format" else _structured_outputs
    try:
        constraint = read(body[field])
    except generation.ConstraintError as error:
        raise FieldError(field, f"{field}: {error}") from None
    return constraint, field


def _structured_outputs(value) -> generation.Constraint:
    if not isinstance(value, dict):
        raise FieldError(
            "structured_outputs", f"structured_outputs={value!r}: pass an object, such as {{'regex': ...}}"
        )
    chosen = {name: v for name, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(chosen) - set(_KINDS))
    if unknown:
        raise FieldError(
            "structured_outputs",
            f"structured_outputs.{unknown[0]} is not supported by hfjax serve; pass one of {', '.join(_KINDS)}",
        )
    if len(chosen) != 1:
        raise FieldError(
            "structured_outputs",
            f"structured_outputs sets {sorted(chosen) or 'nothing'}; pass exactly one of {', '.join(_KINDS)}",
        )
    ((name, given),) = chosen.items()
    kind = _KINDS[name]
    if kind == "json_object":
        if given is not True:
            raise FieldError("structured_outputs", f"structured_outputs.json_object={given!r}: pass true")
        return generation.Constraint.json_object()
    return getattr(generation.Constraint, kind)(given)
