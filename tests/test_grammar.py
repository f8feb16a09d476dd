"""Structured outputs' two halves apart: the host's matcher (`generation.Grammars`) against llguidance
itself, and the device's mask in the token choice against a numpy reference (the argmax and the draws
over the allowed tokens only; unconstrained rows untouched)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hfjax import generation, testing
from hfjax.generation._choose import choose_tokens
from hfjax.generation._rows import RowSampling, SamplingFeatures, key_data
from hfjax.generation._settings import SamplingConfig

pytest.importorskip("llguidance", reason="structured outputs need llguidance: pip install 'hfjax[serve]'")
import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.numpy  # noqa: E402

EOS = 2
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tokenizer():
    return testing.tiny_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    # The model's logits are wider than the tokenizer's vocabulary (512), as padded embeddings are.
    return generation.Grammars(tokenizer, vocab_size=len(tokenizer) + 40, eos_token_ids=[EOS])


def _allowed(row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:vocab]).tolist())


def test_the_mask_is_llguidances_own(tokenizer, grammars):
    reference = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[EOS]),
        generation.Constraint.json_schema(SCHEMA).source(),
        log_level=0,
    )
    expected = llguidance.numpy.allocate_token_bitmask(1, len(tokenizer))
    matcher = grammars.matcher(generation.Constraint.json_schema(SCHEMA))
    row = np.zeros(grammars.words, np.int32)
    assert grammars.words == (len(tokenizer) + 40 + 31) // 32
    for token in [*tokenizer.encode('{"n": 42}', add_special_tokens=False)]:
        matcher.fill(row)
        llguidance.numpy.fill_next_token_bitmask(reference, expected, 0)
        assert _allowed(row, grammars.vocab_size) == _allowed(expected[0], len(tokenizer))
        assert token in _allowed(row, grammars.vocab_size)
        assert not matcher.stopped
        assert matcher.consume(token) and reference.consume_token(token)
    matcher.fill(row)
    assert matcher.stopped and matcher.accepting
    assert _allowed(row, grammars.vocab_size) == {EOS}  # logits past the tokenizer's vocabulary: never


def test_a_token_the_grammar_refuses_is_reported(tokenizer, grammars):
    matcher = grammars.matcher(generation.Constraint.choice(["yes", "no"]))
    assert not matcher.consume(tokenizer.convert_tokens_to_ids("{"))
    assert matcher.error


@pytest.mark.parametrize(
    "constraint, answers, refused",
    [
        (generation.Constraint.choice(["strongly agree", "agree", 'say "hi"']), ["agree", 'say "hi"'], "agreed"),
        (generation.Constraint.regex(r"[0-9]{3}-[a-z]+"), ["123-abc"], "12-abc"),
        (generation.Constraint.grammar('start: "(" start ")" | "x"'), ["((x))"], "((x)"),
        (generation.Constraint.json_object(), ['{"a": [1, {"b": null}]}'], "[1]"),
    ],
)
def test_each_kind_allows_its_answers_and_no_others(tokenizer, grammars, constraint, answers, refused):
    def complete(text: str) -> bool:
        matcher = grammars.matcher(constraint)
        return all(matcher.consume(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.accepting

    assert all(complete(answer) for answer in answers)
    assert not complete(refused)


def test_compiled_constraints_are_kept_per_constraint(grammars):
    first = grammars.compile(generation.Constraint.json_schema(SCHEMA))
    assert grammars.compile(generation.Constraint.json_schema(json.dumps(SCHEMA))) is first
    assert grammars.compile(generation.Constraint.regex("a+")) is not first


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: generation.Constraint.regex("(a"), "unclosed group"),
        (lambda: generation.Constraint.json_schema({"type": "frob"}), "frob"),
        (lambda: generation.Constraint.grammar("start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_constraint_llguidance_rejects_raises_its_reason(grammars, make, says):
    with pytest.raises(generation.ConstraintError, match=re.escape(says)):
        grammars.compile(make())


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: generation.Constraint.choice([]), "choice=[]"),
        (lambda: generation.Constraint.json_schema("[1"), "not JSON"),
        (lambda: generation.Constraint.json_schema([1]), "not an object"),
    ],
)
def test_malformed_constraints_name_the_value(make, says):
    with pytest.raises(generation.ConstraintError, match=re.escape(says)):
        make()


# -- the device's half: the mask in the token choice ------------------------------------------------

VOCAB = 100
WORDS = (VOCAB + 31) // 32


def _rows(temperatures, constrained, allowed_sets) -> tuple[RowSampling, SamplingFeatures]:
    configs = [SamplingConfig(do_sample=t > 0, temperature=t if t > 0 else 1.0) for t in temperatures]
    rows = RowSampling.build(
        [(c, {}, key_data(7 + i)) for i, c in enumerate(configs)], vocab_size=VOCAB, bias_slots=0, mask_words=WORDS
    )
    for i, tokens in enumerate(allowed_sets):
        bits = np.zeros(WORDS * 32, np.uint8)
        bits[list(tokens)] = 1
        rows.allowed[i] = np.packbits(bits, bitorder="little").view(np.int32)
    rows.constrained[:] = constrained
    features = SamplingFeatures(sampling=any(t > 0 for t in temperatures), mask_words=WORDS)
    return rows, features


def test_a_constrained_greedy_row_takes_the_most_likely_allowed_token_and_others_are_untouched():
    logits = jax.random.normal(jax.random.key(0), (3, VOCAB))
    allowed = [{5, 17, 64, 99}, {3}, set(range(VOCAB))]
    rows, features = _rows([0.0, 0.0, 0.0], [True, False, False], allowed)
    token, scores = choose_tokens(logits, rows, features, jnp.zeros(3, jnp.int32))
    expected = [
        max(allowed[0], key=lambda t: float(logits[0, t])),
        int(jnp.argmax(logits[1])),
        int(jnp.argmax(logits[2])),
    ]
    assert token.tolist() == expected
    assert np.isneginf(np.asarray(scores[0])).sum() == VOCAB - len(allowed[0])
    np.testing.assert_array_equal(np.asarray(scores[1:]), np.asarray(logits[1:]))


def test_constrained_draws_follow_the_softmax_over_the_allowed_tokens():
    allowed = {2, 3, 40, 97}
    logits = jnp.tile(jnp.linspace(-1.0, 1.0, VOCAB)[None], (1, 1))
    rows, features = _rows([1.0], [True], [allowed])
    draws = jax.vmap(lambda p: choose_tokens(logits, rows, features, p[None])[0][0])(jnp.arange(4000, dtype=jnp.int32))
    counts = np.bincount(np.asarray(draws), minlength=VOCAB)
    assert set(np.flatnonzero(counts)) == allowed
    ids = sorted(allowed)
    expected = np.asarray(jax.nn.softmax(logits[0, jnp.asarray(ids)]))
    np.testing.assert_allclose(counts[ids] / counts.sum(), expected, atol=0.03)


def test_no_constrained_row_leaves_the_scores_as_they_were():
    logits = jax.random.normal(jax.random.key(1), (2, VOCAB))
    rows, features = _rows([0.0, 1.0], [False, False], [{1}, {2}])
    masked, _ = choose_tokens(logits, rows, features, jnp.arange(2, dtype=jnp.int32))
    plain, _ = choose_tokens(logits, rows, SamplingFeatures(sampling=True), jnp.arange(2, dtype=jnp.int32))
    assert masked.tolist() == plain.tolist()


def test_a_tokenizer_llguidance_cannot_read_is_refused_with_its_reason():
    import tokenizers
    import transformers

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    words.decoder = tokenizers.decoders.WordPiece()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>")
    with pytest.raises(generation.ConstraintError, match="llguidance cannot read .*WordPiece"):
        generation.Grammars(tokenizer, vocab_size=3, eos_token_ids=[1])
