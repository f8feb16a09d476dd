"""hfjax's token choice (generation._sampling, per row) against transformers' own logits processors, run by
PyTorch on the CPU, and OpenAI's definition of the presence and frequency penalties."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
import transformers

from hfjax import testing, tolerances
from hfjax.generation import RowSampling, SamplingConfig, SamplingFeatures, _rows, _sampling, key_data

# Probabilities of float32 softmaxes of the same O(1) logits, processed by the same formulas.
PROBS = tolerances.DEFAULT
# A fixed-seed chi-square test: a correct sampler passes at this level, a wrong one fails.
P_VALUE = 1e-3

VOCAB = 50
PAD = VOCAB - 1  # only ever at pad positions, so counting pads as seen changes the result
LEFT_PADS = (0, 3, 6)  # per row of a [3, 12] history


@pytest.fixture(autouse=True)
def strict_jax():
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        yield


@functools.cache
def _tiny_model() -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_config(testing.tiny_config("llama", vocab_size=VOCAB))


def hf_process(logits: np.ndarray, input_ids: np.ndarray, attention_mask: np.ndarray, config: SamplingConfig):
    """transformers' processed logits [B, V] for `config`, built and ordered by transformers itself."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("presence_penalty", "frequency_penalty")}
    generation_config = transformers.GenerationConfig(**fields)
    processors = _tiny_model()._get_logits_processor(
        generation_config=generation_config,
        input_ids_seq_length=input_ids.shape[1],
        model_kwargs={"attention_mask": torch.from_numpy(attention_mask)},
    )
    return processors(torch.from_numpy(input_ids), torch.from_numpy(logits.copy())).numpy()


def history(seed: int, batch: int = 3, length: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded token ids [B, S] int64 and their attention mask [B, S] int64."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, PAD, (batch, length))
    attention_mask = np.ones((batch, length), np.int64)
    for row, pads in enumerate(LEFT_PADS[:batch]):
        input_ids[row, :pads] = PAD
        attention_mask[row, :pads] = 0
    return input_ids, attention_mask


def softmax(scores: np.ndarray) -> np.ndarray:
    return torch.softmax(torch.from_numpy(np.array(scores)), dim=-1).numpy()


def rows_of(configs, seed: int = 0, biases=None) -> RowSampling:
    """Each config's row, as the programs take them (device arrays), every row keyed by `seed` and its index."""
    biases = biases or [{} for _ in configs]
    rows = RowSampling.build(
        [(c, b, key_data(seed)) for c, b in zip(configs, biases)], vocab_size=None, bias_slots=max(map(len, biases))
    )
    rows = jax.tree_util.tree_map(jnp.asarray, rows)
    return RowSampling(*rows.leaves()[:-1], key=_rows.row_keys(rows.key))


@functools.partial(jax.jit, static_argnames="features")
def _process(logits, seen, counts, rows, *, features):
    return _sampling.process_logits(
        _sampling.add_biases(logits, rows, features), rows, features, seen=seen, counts=counts
    )


def jit_process(logits, seen, config: SamplingConfig, counts=None):
    """[B, V]: every row processed with `config`."""
    features = SamplingFeatures.of([config])
    return _process(logits, seen, counts, rows_of([config] * logits.shape[0]), features=features)


@functools.partial(jax.jit, static_argnames="features")
def _next(logits, seen, rows, positions, *, features):
    return _sampling.pick(_sampling.process_logits(logits, rows, features, seen=seen), rows, positions, features)


def jit_next(logits, seen, config: SamplingConfig, seed: int = 0, positions=None):
    """[B] int32: every row's next token with `config`, rows keyed by `seed` and their index."""
    rows = rows_of([config] * logits.shape[0], seed)
    positions = jnp.zeros(logits.shape[0], jnp.int32) if positions is None else positions
    return _next(logits, seen, rows, positions, features=SamplingFeatures.of([config]))


CASES = {
    "repetition_penalty": SamplingConfig(repetition_penalty=1.3),
    "reward_repetition": SamplingConfig(repetition_penalty=0.7),
    "temperature": SamplingConfig(do_sample=True, temperature=0.7),
    "hot_temperature": SamplingConfig(do_sample=True, temperature=1.8),
    "top_k": SamplingConfig(do_sample=True, top_k=5),
    "top_k_above_vocab": SamplingConfig(do_sample=True, top_k=VOCAB + 10, top_p=0.8),
    "top_p": SamplingConfig(do_sample=True, top_p=0.9),
    "tiny_top_p": SamplingConfig(do_sample=True, top_p=1e-9),
    "min_p": SamplingConfig(do_sample=True, min_p=0.05),
    "min_p_one": SamplingConfig(do_sample=True, min_p=1.0),
    "all": SamplingConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    "top_k_top_p": SamplingConfig(do_sample=True, temperature=1.5, top_k=20, top_p=0.6),
    "top_p_min_p_penalty": SamplingConfig(do_sample=True, top_p=0.95, min_p=0.1, repetition_penalty=1.5),
    # transformers applies the warpers only when sampling; greedy keeps just the penalty.
    "greedy_ignores_warpers": SamplingConfig(
        do_sample=False, temperature=0.5, top_k=3, top_p=0.5, min_p=0.2, repetition_penalty=1.3
    ),
}


def _penalty_counts_pads() -> bool:
    """Whether the installed transformers counts a batch's left pads as seen tokens when it penalises
    repetition (its generate passes no `prompt_ignore_length` before 5.23); hfjax follows the fix."""
    config = transformers.GenerationConfig(repetition_penalty=1.3)
    processors = _tiny_model()._get_logits_processor(
        generation_config=config, input_ids_seq_length=2, model_kwargs={"attention_mask": torch.ones(1, 2)}
    )
    penalty = next(p for p in processors if isinstance(p, transformers.RepetitionPenaltyLogitsProcessor))
    return penalty.prompt_ignore_length is None


@pytest.mark.parametrize("name", CASES)
def test_process_logits_matches_transformers(name):
    config = CASES[name]
    if config.repetition_penalty != 1.0 and _penalty_counts_pads():
        pytest.skip(
            f"transformers {transformers.__version__} penalises the left pads of a batch as seen tokens "
            "(5.23 and later ignore them, as hfjax does)"
        )
    logits = np.random.default_rng(0).normal(0.0, 2.0, (3, VOCAB)).astype(np.float32)  # [3, V]
    input_ids, attention_mask = history(seed=1)
    expected = hf_process(logits, input_ids, attention_mask, config)  # [3, V]
    assert not np.array_equal(expected, logits), f"{name}: transformers left the logits unchanged"

    seen = _sampling.seen_mask(jnp.asarray(input_ids), jnp.asarray(attention_mask), VOCAB)
    got = np.asarray(jit_process(jnp.asarray(logits), seen, config))  # [3, V]

    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected), err_msg="kept tokens differ")
    np.testing.assert_array_equal(got[~np.isfinite(got)], -np.inf)
    kept = np.isfinite(expected)
    np.testing.assert_allclose(got[kept], expected[kept], rtol=0, atol=PROBS.atol)
    np.testing.assert_allclose(softmax(got), softmax(expected), rtol=0, atol=PROBS.atol)


def test_process_logits_accepts_no_seen_without_penalty():
    logits = np.random.default_rng(2).normal(0.0, 2.0, (3, VOCAB)).astype(np.float32)
    input_ids, attention_mask = history(seed=3)
    config = SamplingConfig(do_sample=True, temperature=0.7, top_k=5)
    expected = hf_process(logits, input_ids, attention_mask, config)
    got = np.asarray(jit_process(jnp.asarray(logits), None, config))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    np.testing.assert_allclose(softmax(got), softmax(expected), rtol=0, atol=PROBS.atol)


def test_top_p_keeps_every_token_tied_at_the_cut():
    # Four equal logits and top_p=0.5: transformers keeps whichever two its sort puts last;
    # hfjax keeps all four rather than choose by token id. Untied tokens are cut as in transformers.
    logits = np.array([[3.0, 1.0, 1.0, 1.0, 1.0, -2.0]], np.float32)
    config = SamplingConfig(do_sample=True, top_p=0.5)
    got = np.asarray(jit_process(jnp.asarray(logits), None, config))
    np.testing.assert_array_equal(np.isfinite(got), [[True, False, False, False, False, False]])
    logits[0, 0] = 1.0
    got = np.asarray(jit_process(jnp.asarray(logits), None, config))
    np.testing.assert_array_equal(np.isfinite(got), [[True, True, True, True, True, False]])


def test_greedy_is_argmax_of_penalized_logits():
    rng = np.random.default_rng(4)
    logits = rng.normal(0.0, 1.0, (3, VOCAB)).astype(np.float32)  # [3, V]
    # Each row's raw favourite is in its history and only just ahead of a runner-up that is
    # not, so the penalty must change the choice.
    favourite, runner_up = np.array([3, 17, 40]), np.array([4, 30, 2])
    logits[np.arange(3), favourite] = 3.0
    logits[np.arange(3), runner_up] = 2.6
    input_ids, attention_mask = history(seed=5)
    input_ids = np.where(input_ids == runner_up[:, None], favourite[:, None], input_ids)
    input_ids[:, -1] = favourite
    config = SamplingConfig(repetition_penalty=1.3)

    expected = hf_process(logits, input_ids, attention_mask, config).argmax(axis=-1)  # [3]
    np.testing.assert_array_equal(expected, runner_up)
    seen = _sampling.seen_mask(jnp.asarray(input_ids), jnp.asarray(attention_mask), VOCAB)
    for seed in (0, 1):  # greedy ignores the key
        got = jit_next(jnp.asarray(logits), seen, config, seed)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), expected)


def test_first_argmax_matches_numpy_argmax_with_ties_nan_and_minus_inf():
    rng = np.random.default_rng(6)
    scores = rng.normal(0.0, 1.0, (6, VOCAB)).astype(np.float32)  # [6, V]
    scores[1, [7, 30]] = 5.0  # a tie: the first wins
    scores[2, [11, 20]] = np.nan  # a NaN wins, the first of them
    scores[3] = -np.inf  # nothing allowed: index 0
    scores[4, VOCAB - 1] = 9.0  # the last index
    scores[5, :3] = np.inf  # +inf ties
    got = jax.jit(_sampling.first_argmax)(jnp.asarray(scores))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.argmax(scores, axis=-1))
    np.testing.assert_array_equal(np.asarray(got)[1:], [7, 11, 0, VOCAB - 1, 0])


# Sampling: a vocabulary of 8 where temperature, top-k and top-p each change the distribution.
TINY_LOGITS = np.array([[2.0, 1.6, 1.3, 1.0, 0.6, 0.2, -0.3, -1.0]], np.float32)  # [1, 8]
TINY = SamplingConfig(do_sample=True, temperature=0.8, top_k=6, top_p=0.9)
DRAWS = 20_000


@functools.cache
def tiny_counts() -> np.ndarray:
    """How often each of the 8 tokens is drawn in DRAWS jitted draws (DRAWS rows, each its own key); [8] int64."""
    logits = jnp.asarray(np.repeat(TINY_LOGITS, DRAWS, axis=0))
    tokens = np.asarray(jit_next(logits, None, TINY, seed=1234))  # [DRAWS]
    return np.bincount(tokens, minlength=TINY_LOGITS.shape[1])


def tiny_hf_probs(config: SamplingConfig) -> np.ndarray:
    input_ids = np.zeros((1, 1), np.int64)
    return softmax(hf_process(TINY_LOGITS, input_ids, np.ones_like(input_ids), config))[0]  # [8]


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    expected = probs[support].astype(np.float64)
    return scipy.stats.chisquare(counts[support], counts.sum() * expected / expected.sum()).pvalue


def test_samples_follow_transformers_distribution():
    probs = tiny_hf_probs(TINY)
    assert 0 < (probs > 0).sum() < (tiny_hf_probs(dataclasses.replace(TINY, top_p=1.0)) > 0).sum()
    counts = tiny_counts()
    np.testing.assert_array_equal(counts[probs == 0], 0, err_msg="a filtered-out token was drawn")
    assert chi_square_p(counts, probs) > P_VALUE


def test_draws_over_several_blocks_follow_the_softmax_and_never_take_a_removed_token():
    # 30 allowed tokens spread over three blocks of the draw's two-level sum (the middle block holds one),
    # the rest -inf as top-k or top-p leave them.
    vocab = 2 * _sampling.DRAW_BLOCK + 40
    rng = np.random.default_rng(14)
    allowed = np.concatenate([rng.choice(_sampling.DRAW_BLOCK, 20, replace=False), [_sampling.DRAW_BLOCK + 7],
                              2 * _sampling.DRAW_BLOCK + rng.choice(40, 9, replace=False)])  # fmt: skip
    logits = np.full(vocab, -np.inf, np.float32)
    logits[allowed] = rng.normal(0.0, 1.0, len(allowed))
    uniform = jax.random.uniform(jax.random.key(15), (DRAWS,))
    draw = jax.jit(_sampling.inverse_cdf)
    tokens = np.asarray(draw(jnp.tile(jnp.asarray(logits), (DRAWS, 1)), uniform))
    counts = np.bincount(tokens, minlength=vocab)
    np.testing.assert_array_equal(counts[~np.isfinite(logits)], 0, err_msg="a removed token was drawn")
    assert chi_square_p(counts, softmax(logits)) > P_VALUE
    assert chi_square_p(counts, softmax(np.where(np.arange(vocab) == allowed[0], logits + 0.3, logits))) < P_VALUE
    # The ends of [0, 1): the first and the last allowed token, whatever the rounding of the sums.
    ends = jnp.asarray([0.0, np.nextafter(np.float32(1.0), np.float32(0.0))], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(draw(jnp.tile(jnp.asarray(logits), (2, 1)), ends)), [allowed.min(), allowed.max()]
    )


@pytest.mark.parametrize(
    "wrong",
    [dict(top_p=1.0), dict(temperature=1.0), dict(temperature=0.9)],
    ids=["without_top_p", "without_temperature", "temperature_0.9_for_0.8"],
)
def test_chi_square_rejects_a_wrong_distribution(wrong):
    # The same draws checked against a distribution that is not the one asked for must fail,
    # or the test above could not catch a wrong sampler.
    assert chi_square_p(tiny_counts(), tiny_hf_probs(dataclasses.replace(TINY, **wrong))) < P_VALUE


# Past its candidates a row selects over its whole row: top-k beyond them, a top-p set they do not hold.
@pytest.mark.parametrize("candidates", [1, 3, VOCAB])
@pytest.mark.parametrize("name", ["top_k", "top_p", "top_k_top_p", "all", "top_k_above_vocab", "tiny_top_p"])
def test_top_k_and_top_p_past_the_candidates_match_transformers(name, candidates):
    config = CASES[name]
    logits = np.random.default_rng(12).normal(0.0, 2.0, (3, VOCAB)).astype(np.float32)  # [3, V]
    logits[0] *= 8.0  # peaked: its top-p set is among few candidates, where the flat rows' is not
    input_ids, attention_mask = history(seed=13)
    expected = hf_process(logits, input_ids, attention_mask, dataclasses.replace(config, repetition_penalty=1.0))
    features = dataclasses.replace(SamplingFeatures.of([config]), repetition=False, candidates=candidates)
    rows = rows_of([dataclasses.replace(config, repetition_penalty=1.0)] * 3)
    got = np.asarray(_process(jnp.asarray(logits), None, None, rows, features=features))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected), err_msg="kept tokens differ")
    np.testing.assert_allclose(softmax(got), softmax(expected), rtol=0, atol=PROBS.atol)


def test_same_key_same_tokens_other_key_other_tokens():
    logits = jnp.zeros((256, VOCAB), jnp.float32)  # uniform: every draw is up to the key
    config = SamplingConfig(do_sample=True)
    first = np.asarray(jit_next(logits, None, config, seed=7))
    again = np.asarray(jit_next(logits, None, config, seed=7))
    other = np.asarray(jit_next(logits, None, config, seed=8))
    later = np.asarray(jit_next(logits, None, config, seed=7, positions=jnp.ones(256, jnp.int32)))
    np.testing.assert_array_equal(first, again)
    assert len(np.unique(first)) > VOCAB // 2, "draws from a uniform distribution barely vary"
    assert np.mean(first == other) < 0.2, "another key gave mostly the same tokens"
    assert np.mean(first == later) < 0.2, "another position gave mostly the same tokens"


def test_rows_with_different_settings_each_match_transformers():
    # One program, each row its own settings: a server's slots hold requests of every kind at once.
    configs = [CASES[name] for name in ("top_k", "min_p", "greedy_ignores_warpers", "hot_temperature", "top_k_top_p")]
    logits = np.random.default_rng(9).normal(0.0, 2.0, (len(configs), VOCAB)).astype(np.float32)
    input_ids, attention_mask = history(seed=10, batch=3)
    input_ids, attention_mask = np.resize(input_ids, (len(configs), 12)), np.ones((len(configs), 12), np.int64)
    seen = _sampling.seen_mask(jnp.asarray(input_ids), jnp.asarray(attention_mask), VOCAB)
    features = SamplingFeatures.of(configs)
    got = np.asarray(_process(jnp.asarray(logits), seen, None, rows_of(configs), features=features))
    for row, config in enumerate(configs):
        expected = hf_process(logits[row : row + 1], input_ids[row : row + 1], attention_mask[row : row + 1], config)[0]
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(expected), err_msg=str(config))
        np.testing.assert_allclose(softmax(got[row]), softmax(expected), rtol=0, atol=PROBS.atol)


def test_presence_and_frequency_penalties_follow_openais_definition():
    # OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j] the times the
    # answer so far holds token j (the prompt's tokens do not count).
    rng = np.random.default_rng(11)
    logits = rng.normal(0.0, 2.0, (3, VOCAB)).astype(np.float32)
    answer = rng.integers(0, VOCAB, (3, 9))
    counts = np.zeros((3, VOCAB), np.int32)
    for row, tokens in enumerate(answer):
        np.add.at(counts[row], tokens, 1)
    configs = [
        SamplingConfig(presence_penalty=p, frequency_penalty=f) for p, f in ((0.5, 0.0), (0.0, 0.7), (-1.2, 1.9))
    ]
    expected = np.stack([logits[i] - counts[i] * c.frequency_penalty - (counts[i] > 0) * c.presence_penalty
                         for i, c in enumerate(configs)])  # fmt: skip
    grown = jnp.zeros((3, VOCAB), jnp.int32)
    for column in range(answer.shape[1]):
        grown = _sampling.update_counts(grown, jnp.asarray(answer[:, column], jnp.int32))
    np.testing.assert_array_equal(np.asarray(grown), counts)
    got = _process(jnp.asarray(logits), None, grown, rows_of(configs), features=SamplingFeatures.of(configs))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=tolerances.BIASES.atol)


def test_single_token_biases_match_transformers_sequence_bias():
    logits = np.random.default_rng(12).normal(0.0, 1.0, (2, VOCAB)).astype(np.float32)
    biases = [{3: 2.5, 7: -float("inf")}, {7: 1.0, 40: -3.0, 41: 0.5}]
    configs = [SamplingConfig()] * 2
    features = SamplingFeatures.of(configs, bias_slots=3)
    got = np.asarray(_process(jnp.asarray(logits), None, None, rows_of(configs, biases=biases), features=features))
    for row, bias in enumerate(biases):
        processor = transformers.SequenceBiasLogitsProcessor({(token,): value for token, value in bias.items()})
        expected = processor(torch.zeros((1, 2), dtype=torch.long), torch.from_numpy(logits[row : row + 1].copy()))[0]
        np.testing.assert_allclose(got[row], expected.numpy(), rtol=0, atol=tolerances.BIASES.atol)


def test_seen_mask_and_update_seen():
    input_ids, attention_mask = history(seed=6)
    seen = np.asarray(_sampling.seen_mask(jnp.asarray(input_ids), jnp.asarray(attention_mask), VOCAB))
    expected = np.zeros((3, VOCAB), bool)
    for row in range(3):
        expected[row, input_ids[row][attention_mask[row] == 1]] = True
    np.testing.assert_array_equal(seen, expected)
    assert not seen[:, PAD].any()
    assert np.asarray(_sampling.seen_mask(jnp.asarray(input_ids), None, VOCAB))[1:, PAD].all()

    tokens = np.array([PAD, 0, input_ids[2, -1]])
    grown = np.asarray(_sampling.update_seen(jnp.asarray(seen), jnp.asarray(tokens)))
    appended = np.concatenate([input_ids, tokens[:, None]], axis=1)
    appended_mask = np.concatenate([attention_mask, np.ones((3, 1), np.int64)], axis=1)
    np.testing.assert_array_equal(
        grown, np.asarray(_sampling.seen_mask(jnp.asarray(appended), jnp.asarray(appended_mask), VOCAB))
    )

    traced = jax.jit(_sampling.seen_mask, static_argnums=2)(jnp.asarray(input_ids), jnp.asarray(attention_mask), VOCAB)
    np.testing.assert_array_equal(np.asarray(traced), expected)


def test_config_is_hashable_and_normalised():
    a = SamplingConfig(do_sample=np.bool_(True), temperature=1, top_k=np.int64(5), top_p=np.float32(0.5))
    b = SamplingConfig(do_sample=True, temperature=1.0, top_k=5, top_p=0.5)
    assert a == b and hash(a) == hash(b)
    assert type(a.temperature) is float and type(a.top_k) is int and type(a.do_sample) is bool
    assert SamplingConfig(temperature=0.0).temperature == 0.0  # greedy ignores temperature, as transformers


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(do_sample=True, temperature=0.0), r"temperature=0\.0 must be strictly positive.*do_sample=False"),
        (dict(temperature=-0.5), r"temperature=-0\.5 must be strictly positive"),
        (dict(temperature="hot"), r"temperature='hot' is not a finite number"),
        (dict(temperature=float("nan")), r"temperature=nan is not a finite number"),
        (dict(top_p=1.5), r"top_p=1\.5 is outside \(0, 1\]; pass a value such as 0\.9"),
        (dict(top_p=0.0), r"top_p=0\.0 is outside \(0, 1\]"),
        (dict(top_p=None), r"top_p=None is not a finite number"),
        (dict(top_k=-1), r"top_k=-1 is not a non-negative integer"),
        (dict(top_k=2.5), r"top_k=2\.5 is not a non-negative integer"),
        (dict(top_k="5"), r"top_k='5' is not a non-negative integer"),
        (dict(top_k=True), r"top_k=True is not a non-negative integer"),
        (dict(min_p=-0.1), r"min_p=-0\.1 is outside \[0, 1\]"),
        (dict(min_p=1.1), r"min_p=1\.1 is outside \[0, 1\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty=0\.0 must be strictly positive"),
        (dict(repetition_penalty=-1.2), r"repetition_penalty=-1\.2 must be strictly positive"),
        (dict(repetition_penalty=[1.2]), r"repetition_penalty=\[1\.2\] is not a finite number"),
        (dict(do_sample="yes"), r"do_sample='yes' is not a bool"),
        (dict(presence_penalty=2.5), r"presence_penalty=2\.5 is outside \[-2, 2\]"),
        (dict(frequency_penalty="x"), r"frequency_penalty='x' is not a finite number"),
    ],
)
def test_bad_settings_name_argument_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_bad_arrays_name_argument_and_shape():
    logits = jnp.zeros((2, VOCAB), jnp.float32)
    plain = SamplingConfig()
    penalised = SamplingConfig(repetition_penalty=1.3)
    rows = rows_of([penalised] * 2)
    with pytest.raises(ValueError, match=r"logits has shape \(2, 1, 50\)"):
        _sampling.process_logits(logits[:, None, :], rows_of([plain] * 2), SamplingFeatures.of([plain]))
    with pytest.raises(ValueError, match=r"seen is None but the settings need a bool array"):
        _sampling.process_logits(logits, rows, SamplingFeatures.of([penalised]))
    with pytest.raises(ValueError, match=r"seen is int32 \(2, 50\)"):
        _sampling.process_logits(logits, rows, SamplingFeatures.of([penalised]), seen=jnp.zeros((2, VOCAB), jnp.int32))
    ids = jnp.array([[1, 2, VOCAB]])
    with pytest.raises(ValueError, match=r"input_ids\[0, 2\]=50 is outside \[0, vocab_size=50\)"):
        _sampling.seen_mask(ids, None, VOCAB)
    assert not np.asarray(_sampling.seen_mask(ids, jnp.array([[1, 1, 0]]), VOCAB))[0, 3:].any()  # a pad may be anything
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 2\) but input_ids has \(1, 3\)"):
        _sampling.seen_mask(ids, jnp.ones((1, 2), jnp.int32), VOCAB)
    with pytest.raises(ValueError, match=r"input_ids has shape \(3,\)"):
        _sampling.seen_mask(ids[0], None, VOCAB)


# -- processors that read the tokens so far ------------------------------------------


def _buffer(input_ids: np.ndarray, lead: int, tail: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """input_ids [B, S] placed in a wider buffer as the decode loop holds them: `lead` foreign
    columns before (bucket padding), `tail` unwritten ones after. -> (buffer, start, end)."""
    batch, length = input_ids.shape
    buffer = np.full((batch, lead + length + tail), 7, np.int32)  # 7: a token that also occurs inside
    buffer[:, lead : lead + length] = input_ids
    return jnp.asarray(buffer), jnp.int32(lead), jnp.int32(lead + length)


def _repetitive_history(seed: int) -> np.ndarray:
    """[3, 16] int64 ids from a 6-token alphabet whose last 4 tokens also occur earlier, so that
    every n-gram size up to 4 bans a token; row 2 starts with pads."""
    ids = np.random.default_rng(seed).integers(5, 11, (3, 16))
    ids[:, 6:10] = ids[:, 12:]
    ids[2, :4] = PAD
    return ids


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_ngram_bans_match_transformers(size, seed):
    input_ids = _repetitive_history(seed)
    scores = np.random.default_rng(seed).standard_normal((3, VOCAB)).astype(np.float32)
    expected = transformers.NoRepeatNGramLogitsProcessor(size)(torch.from_numpy(input_ids), torch.from_numpy(scores))
    buffer, start, end = _buffer(input_ids, lead=5, tail=9)
    banned = jax.jit(_sampling.ngram_bans, static_argnums=(3, 4))(buffer, start, end, size, VOCAB)
    actual = np.where(np.asarray(banned), -np.inf, scores)
    assert np.isinf(expected.numpy()).any()  # the history repeats, so something is banned
    np.testing.assert_array_equal(actual, expected.numpy())


def test_columns_before_the_row_are_not_part_of_it():
    input_ids = np.array([[5, 5]])
    buffer, start, end = _buffer(input_ids, lead=4, tail=4)  # the lead is 7, 7, 7, 7
    assert not np.asarray(_sampling.ngram_bans(buffer, start, end, 3, VOCAB)).any()  # (7, 5, 5) is not in the row
    assert np.asarray(_sampling.ngram_bans(buffer, start, end, 2, VOCAB))[0, 5]
    bias = np.asarray(_sampling.sequence_bias(buffer, start, end, (((7, 5, 5, 20), 1.0), ((5, 5, 21), 2.0)), VOCAB))
    assert bias[0, 20] == 0 and bias[0, 21] == 2  # transformers skips a prefix longer than the row


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_bias_and_bad_words_match_transformers(seed):
    input_ids = _repetitive_history(seed)
    scores = np.random.default_rng(seed).standard_normal((3, VOCAB)).astype(np.float32)
    # Sequences ending as some rows end, of every prefix length up to 3, and a single token.
    tails = [tuple(int(t) for t in input_ids[row, -k:]) for row, k in ((0, 1), (1, 2), (2, 3))]
    biases = {(12,): 1.5, (*tails[0], 13): -2.0, (*tails[1], 14): 3.0, (*tails[2], 15): -0.5, (9, 9, 9, 16): 4.0}
    bad = [[17], [*tails[1], 18], [9, 19]]
    scores_t = torch.from_numpy(scores)
    ids_t = torch.from_numpy(input_ids)
    expected = transformers.SequenceBiasLogitsProcessor(sequence_bias=[[list(k), v] for k, v in biases.items()])(
        ids_t, scores_t
    )
    expected = transformers.NoBadWordsLogitsProcessor(bad, eos_token_id=None)(ids_t, expected).numpy()
    entries = tuple(biases.items()) + tuple((tuple(ids), -np.inf) for ids in bad)
    buffer, start, end = _buffer(input_ids, lead=3, tail=5)
    actual = scores + np.asarray(_sampling.sequence_bias(buffer, start, end, entries, VOCAB))
    assert not np.array_equal(
        expected, scores + np.asarray(_sampling.sequence_bias(buffer, start, end, entries[:1], VOCAB))
    )
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerances.BIASES.atol)


def test_the_stop_rule_is_transformers_min_new_tokens_and_eos_criteria():
    """`hold_back` with every row's stop tokens compiled in (a tuple) and with each row's own ([R, H],
    ids past the vocabulary unused) gives transformers' MinNewTokensLengthLogitsProcessor's scores row
    by row, and `stopped` (on the device and on the host) its EosTokenCriteria."""
    from transformers.generation.stopping_criteria import EosTokenCriteria

    from hfjax.generation import _stops, stopped

    vocab, prompt, least = 32, 4, 3
    scores = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32)
    steps = np.asarray([0, 2, 3], np.int32)  # each row's new tokens so far: the first two are held back
    own = [[5, 9], [7], [5, 9, 11]]
    held = np.full((3, 3), vocab, np.int32)
    for row, tokens in enumerate(own):
        held[row, : len(tokens)] = tokens
    positions, bound = prompt + steps, np.full(3, prompt + least, np.int32)

    def transformers_rows(eos_of_row):
        rows = []
        for row, step in enumerate(steps):
            processor = transformers.MinNewTokensLengthLogitsProcessor(prompt, least, eos_of_row(row))
            so_far = torch.zeros((1, prompt + int(step)), dtype=torch.long)
            rows.append(processor(so_far, torch.from_numpy(scores[row : row + 1].copy()))[0].numpy())
        return np.stack(rows)

    compiled = jax.jit(_stops.hold_back, static_argnums=1)(jnp.asarray(scores), (5, 9), positions, bound)
    np.testing.assert_array_equal(np.asarray(compiled), transformers_rows(lambda row: [5, 9]))
    each = jax.jit(_stops.hold_back)(jnp.asarray(scores), jnp.asarray(held), positions, bound)
    np.testing.assert_array_equal(np.asarray(each), transformers_rows(lambda row: own[row]))
    assert np.isinf(np.asarray(each)[1, 7]) and not np.isinf(np.asarray(each)[1, 9])  # a row's own ids only

    tokens = np.asarray([[3, 9], [4, 5], [8, 8]], np.int32)  # each row's tokens so far, the last one new
    want = EosTokenCriteria([5, 9])(torch.from_numpy(tokens).long(), torch.zeros(3, vocab)).numpy()
    np.testing.assert_array_equal(np.asarray(jax.jit(stopped, static_argnums=1)(tokens[:, -1], (5, 9))), want)
    np.testing.assert_array_equal(stopped(tokens[:, -1], (5, 9)), want)
    assert not stopped(tokens, ()).any()
