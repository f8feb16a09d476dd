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
from hfjax.generation import RowSampling, SamplingConfig, SamplingFeatures, _choose, key_data

pytest.importorskip("llguidance", reason="structured outputs need llguidance: pip install 'hfjax[serve]'")
import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.numpy  # noqa: E402

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


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
    token, scores = _choose.choose_tokens(logits, rows, features, jnp.zeros(3, jnp.int32))
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
    draws = jax.vmap(lambda p: _choose.choose_tokens(logits, rows, features, p[None])[0][0])(
        jnp.arange(4000, dtype=jnp.int32)
    )
    counts = np.bincount(np.asarray(draws), minlength=VOCAB)
    assert set(np.flatnonzero(counts)) == allowed
    ids = sorted(allowed)
    expected = np.asarray(jax.nn.softmax(logits[0, jnp.asarray(ids)]))
    np.testing.assert_allclose(counts[ids] / counts.sum(), expected, atol=0.03)


def test_no_constrained_row_leaves_the_scores_as_they_were():
    logits = jax.random.normal(jax.random.key(1), (2, VOCAB))
    rows, features = _rows([0.0, 1.0], [False, False], [{1}, {2}])
    masked, _ = _choose.choose_tokens(logits, rows, features, jnp.arange(2, dtype=jnp.int32))
    plain, _ = _choose.choose_tokens(logits, rows, SamplingFeatures(sampling=True), jnp.arange(2, dtype=jnp.int32))
    assert masked.tolist() == plain.tolist()


def test_a_tokenizer_llguidance_cannot_read_is_refused_with_its_reason():
    import tokenizers
    import transformers

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    words.decoder = tokenizers.decoders.WordPiece()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>")
    with pytest.raises(generation.ConstraintError, match="llguidance cannot read .*WordPiece"):
        generation.Grammars(tokenizer, vocab_size=3, eos_token_ids=[1])


# -- Model.generate ---------------------------------------------------------------------------------


class _LLGuidanceProcessor:
    """The reference: transformers' generate with llguidance's own mask as a logits processor (per row,
    advanced by the row's last token), the way a PyTorch user constrains generation."""

    def __init__(self, tokenizer, constraint, rows: int, prompt_length: int):
        lltokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id]
        )
        self.matchers = [llguidance.LLMatcher(lltokenizer, constraint.source(), log_level=0) for _ in range(rows)]
        self.mask = llguidance.numpy.allocate_token_bitmask(rows, len(tokenizer))
        self.prompt_length = prompt_length

    def __call__(self, input_ids, scores):
        import torch

        for row, matcher in enumerate(self.matchers):
            if input_ids.shape[1] > self.prompt_length and not matcher.is_stopped():
                assert matcher.consume_token(int(input_ids[row, -1]))
            llguidance.numpy.fill_next_token_bitmask(matcher, self.mask, row)
        allowed = np.unpackbits(self.mask.view(np.uint8), axis=1, bitorder="little")[:, : scores.shape[1]]
        allowed = np.pad(allowed, ((0, 0), (0, scores.shape[1] - allowed.shape[1])))
        return torch.where(torch.as_tensor(allowed, dtype=torch.bool), scores, -torch.inf)


@pytest.mark.parametrize(
    "keyword, value, constraint",
    [
        ("json_schema", SCHEMA, generation.Constraint.json_schema(SCHEMA)),
        ("regex", r"[a-z]{3,6}-[0-9]{2}", generation.Constraint.regex(r"[a-z]{3,6}-[0-9]{2}")),
        ("choice", ["yes", "no", "maybe"], generation.Constraint.choice(["yes", "no", "maybe"])),
        ("response_format", {"type": "json_object"}, generation.Constraint.json_object()),
    ],
)
def test_generate_follows_a_constraint_as_transformers_with_llguidances_mask_does(
    checkpoint, keyword, value, constraint
):
    import torch
    import transformers

    import hfjax

    path = checkpoint("llama")
    model = hfjax.load(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    batch = tokenizer(["The river", "The river ran past"], padding=True, return_tensors="np")
    expected = reference.generate(
        torch.as_tensor(batch["input_ids"]), attention_mask=torch.as_tensor(batch["attention_mask"]),
        max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        logits_processor=transformers.LogitsProcessorList(
            [_LLGuidanceProcessor(tokenizer, constraint, 2, batch["input_ids"].shape[1])]
        ),
    )  # fmt: skip
    got = model.generate(
        batch["input_ids"], batch["attention_mask"], max_new_tokens=24, do_sample=False, **{keyword: value}
    )
    np.testing.assert_array_equal(np.asarray(got)[:, : expected.shape[1]], expected.numpy())
    assert np.all(np.asarray(got)[:, expected.shape[1] :] == tokenizer.pad_token_id)


def test_sampled_generate_text_answers_all_follow_the_schema(checkpoint):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency: pip install jsonschema")
    import hfjax

    model = hfjax.load(checkpoint("llama"))
    answers = model.generate_text("The river", max_new_tokens=40, do_sample=True, temperature=1.0,
                                  num_return_sequences=8, json_schema=SCHEMA)  # fmt: skip
    for answer in answers:
        jsonschema.validate(json.loads(answer), SCHEMA)
    free = model.generate_text("The river", max_new_tokens=40, do_sample=True, num_return_sequences=8)
    assert not any(answer.startswith('{"n"') for answer in free)  # the negative control


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"regex": "a+", "choice": ["a"]}, "regex and choice given"),
        ({"regex": "a+", "num_beams": 2}, "num_beams=2 with a constraint"),
        ({"regex": "(a"}, "unclosed group"),
    ],
)
def test_generate_refuses_what_it_cannot_constrain(checkpoint, kwargs, says):
    import hfjax

    model = hfjax.load(checkpoint("llama"))
    with pytest.raises(hfjax.GenerationError, match=re.escape(says)):
        model.generate_text("The river", max_new_tokens=4, **kwargs)
