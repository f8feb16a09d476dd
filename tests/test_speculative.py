"""Speculative decoding (prompt lookup) inside the slot core's decode loop: `Model.generate(...,
prompt_lookup_num_tokens=k)` against the same call without it and transformers' assisted generation
run by PyTorch, the sampled distribution by a chi-square test, and the refused combinations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import hfjax
from distributions import same_distribution_p
from hfjax import GenerationError

# Prompts that repeat themselves, of three lengths, left-padded: their answers repeat too, so the
# lookup finds drafts the target accepts.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12],
    [40, 41, 42, 43, 44, 40, 41, 42],
]
PAD = 0
# A fixed-seed chi-square test: a correct sampler passes at this level, a wrong one fails.
P_VALUE = 1e-3


@pytest.fixture(scope="module")
def loaded(checkpoint):
    models = {}

    def load(family: str):
        if family not in models:
            models[family] = hfjax.load(checkpoint(family))
        return models[family]

    return load


def _left_padded(prompts) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    return ids, mask


def _torch_lookup(model, prompt, **settings) -> np.ndarray:
    """transformers' prompt-lookup generate in PyTorch for one prompt (it takes batches of one): its new tokens."""
    module = transformers.AutoModelForCausalLM.from_pretrained(model.path).eval()
    ids = torch.as_tensor([prompt])
    with torch.no_grad():
        out = module.generate(ids, attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=3, **settings)
    return out[0, len(prompt) :].numpy()


def _two_eos(new: np.ndarray) -> list[int]:
    """Two EOS tokens for answers `new` [3, T] made without any: one that row 0 makes early (held back
    there by min_new_tokens=3), and one that row 1 or 2 makes first at its fourth token or later,
    where it then stops."""
    early = int(new[0, 1])
    for row in (1, 2):
        for i in range(3, new.shape[1] - 1):
            if not np.isin(new[row, :i], [early, new[row, i]]).any() and new[row, i] != early:
                return [early, int(new[row, i])]
    raise AssertionError(f"no row makes a new token past its third: {new}")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_tokens_equal_the_plain_decode_and_transformers_prompt_lookup(loaded, family):
    model = loaded(family)
    ids, mask = _left_padded(PROMPTS)
    budget = 24
    unstopped = np.asarray(model.generate(ids, mask, max_new_tokens=budget, do_sample=False))[:, ids.shape[1] :]
    eos = _two_eos(unstopped)
    settings = dict(max_new_tokens=budget, min_new_tokens=3, eos_token_id=eos, pad_token_id=PAD, do_sample=False)
    plain = np.asarray(model.generate(ids, mask, **settings))
    speculative = np.asarray(model.generate(ids, mask, prompt_lookup_num_tokens=3, **settings))
    stats = model.last_generation_stats
    np.testing.assert_array_equal(speculative, plain)
    new = speculative[:, ids.shape[1] :]
    assert not np.isin(new[:, :3], eos).any() and np.isin(new[:, :-1], eos).any(), "the EOS rules were not exercised"
    assert stats.accepted_tokens > 0, f"no draft was accepted: {stats}"
    assert stats.target_forwards < budget - 1, f"no round made more than one token: {stats}"
    for row, prompt in enumerate(PROMPTS):
        expected = _torch_lookup(model, prompt, **settings)
        np.testing.assert_array_equal(new[row, : len(expected)], expected)
        assert (new[row, len(expected) :] == PAD).all()


def test_streamed_and_windowed_greedy_decode_equals_the_plain_one(loaded):
    # A streamer runs the decode in chunks of a few tokens; a long answer crosses the cache's windows.
    model = loaded("llama")
    ids, mask = _left_padded(PROMPTS)
    settings = dict(max_new_tokens=70, min_new_tokens=70, do_sample=False)
    plain = np.asarray(model.generate(ids, mask, **settings))
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, prompt_lookup_num_tokens=4, **settings)), plain)
    assert model.last_generation_stats.accepted_tokens > 0

    class Collect:
        def __init__(self):
            self.parts = []

        def put(self, value):
            self.parts.append(np.asarray(value).reshape(len(PROMPTS), -1))

        def end(self):
            pass

    streamer = Collect()
    streamed = np.asarray(
        model.generate(ids, mask, streamer=streamer, prompt_lookup_num_tokens=4, max_new_tokens=20, do_sample=False)
    )
    np.testing.assert_array_equal(streamed, plain[:, : ids.shape[1] + 20])
    np.testing.assert_array_equal(np.concatenate(streamer.parts, axis=1), streamed)


def test_penalties_and_sampling_give_the_plain_decodes_tokens(loaded):
    # Each position's choice sees the drafts before it (repetition penalty, n-gram bans); a sampled
    # token is the draw the plain decode makes there (the row's key folded with the position).
    model = loaded("llama")
    ids, mask = _left_padded(PROMPTS)
    settings = dict(
        max_new_tokens=16, do_sample=True, temperature=0.7, top_k=20, repetition_penalty=1.3,
        no_repeat_ngram_size=4, seed=3,
    )  # fmt: skip
    plain = np.asarray(model.generate(ids, mask, **settings))
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, prompt_lookup_num_tokens=3, **settings)), plain)


# Sampling: many rows of one repetitive prompt, each drawing its own tokens.
SAMPLES = 384
SAMPLED = dict(max_new_tokens=4, do_sample=True, temperature=1.5, top_k=6, num_return_sequences=SAMPLES)


def _scaled_llama(path, factor: float) -> hfjax.Model:
    """The checkpoint's Llama with its logits scaled by `factor` (sharper for factor > 1)."""
    module = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        module.lm_head.weight.mul_(factor)
    return hfjax.Model.from_module(module)


@pytest.fixture(scope="module")
def peaked(checkpoint):
    """The tiny Llama with its logits scaled up 12x (the tiny checkpoint's are nearly flat, so that
    temperature barely changes its distribution and a wrong one would pass)."""
    return _scaled_llama(checkpoint("llama"), 12.0)


def _draws(model, seed: int, **settings) -> np.ndarray:
    ids, mask = _left_padded(PROMPTS[:1])
    return np.asarray(model.generate(ids, mask, seed=seed, **{**SAMPLED, **settings}))[:, ids.shape[1] :]


def test_sampled_tokens_follow_the_plain_decodes_distribution(peaked):
    model = peaked
    speculative = _draws(model, seed=1, prompt_lookup_num_tokens=3)
    stats = model.last_generation_stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens, f"drafts were not both accepted and rejected: {stats}"
    plain = _draws(model, seed=2)  # other draws from the plain decode
    for step in (1, 2, 3):  # the tokens the decode's rounds make (the first comes from the prefill)
        assert same_distribution_p(speculative[:, step], plain[:, step]) > P_VALUE, f"new token {step}"
    # The negative control: the same test tells a distribution that is not the one asked for.
    colder = _draws(model, seed=2, temperature=0.5)
    assert max(same_distribution_p(speculative[:, s], colder[:, s]) for s in (1, 2, 3)) < P_VALUE


# -- a draft model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def unrelated_draft(checkpoint):
    """A draft with the target's vocabulary and other weights (one layer): its proposals often differ."""
    return checkpoint("llama", num_hidden_layers=1)


def test_a_draft_model_gives_the_plain_decodes_greedy_tokens_and_transformers_assisted_ones(
    loaded, checkpoint, unrelated_draft
):
    model = loaded("llama")
    ids, mask = _left_padded(PROMPTS)
    budget = 16
    unstopped = np.asarray(model.generate(ids, mask, max_new_tokens=budget, do_sample=False))[:, ids.shape[1] :]
    settings = dict(
        max_new_tokens=budget, min_new_tokens=3, eos_token_id=_two_eos(unstopped), pad_token_id=PAD, do_sample=False
    )
    plain = np.asarray(model.generate(ids, mask, **settings))
    # The target itself as its draft agrees everywhere: every draft is accepted, k + 1 tokens a forward.
    itself = checkpoint("llama")
    agreed = model.generate(
        ids, mask, max_new_tokens=budget, do_sample=False, assistant_model=itself, num_assistant_tokens=4
    )
    stats = model.last_generation_stats
    np.testing.assert_array_equal(np.asarray(agreed)[:, ids.shape[1] :], unstopped)
    assert stats.accepted_tokens == stats.drafted_tokens > 0, stats
    assert stats.target_forwards == -(-(budget - 1) // 5), stats
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, assistant_model=itself, num_assistant_tokens=4, **settings)), plain
    )
    draft = hfjax.load(unrelated_draft)
    other = np.asarray(model.generate(ids, mask, assistant_model=draft, num_assistant_tokens=3, **settings))
    np.testing.assert_array_equal(other, plain)
    assert model.last_generation_stats.drafted_tokens > model.last_generation_stats.accepted_tokens
    new = other[:, ids.shape[1] :]
    module = transformers.AutoModelForCausalLM.from_pretrained(model.path).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(unrelated_draft).eval()
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = module.generate(
                torch.as_tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                assistant_model=assistant, num_assistant_tokens=3, **settings,
            )[0, len(prompt) :].numpy()  # fmt: skip
        np.testing.assert_array_equal(new[row, : len(expected)], expected)


def test_a_draft_models_sampled_tokens_follow_the_plain_decodes_distribution(peaked, checkpoint):
    # The draft (the same Llama, 100x sharper than the target) proposes from its own distribution, and
    # is rejected often; speculative sampling's rule keeps the target's. Where its most likely token is
    # the target's, a rejection never draws it (the residual max(p - q, 0) is 0 there): drawing the
    # correction from p instead fails this test (p < 1e-4 at the second new token).
    model = peaked
    draft = _scaled_llama(checkpoint("llama"), 100.0)
    samples = dict(num_return_sequences=1024)
    speculative = _draws(model, seed=1, assistant_model=draft, num_assistant_tokens=3, **samples)
    stats = model.last_generation_stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens, f"drafts were not both accepted and rejected: {stats}"
    plain = _draws(model, seed=2, **samples)
    for step in (1, 2, 3):
        assert same_distribution_p(speculative[:, step], plain[:, step]) > P_VALUE, f"new token {step}"
    colder = _draws(model, seed=2, temperature=0.5, **samples)
    assert max(same_distribution_p(speculative[:, s], colder[:, s]) for s in (1, 2, 3)) < P_VALUE


@pytest.mark.parametrize(
    "other, message",
    [
        (dict(num_beams=2), r"prompt_lookup_num_tokens=3 with num_beams=2: .*pass num_beams=1"),
        (dict(regex="[0-9]+"), r"prompt_lookup_num_tokens=3 with a constraint .*pass one of them"),
        (dict(prompt_lookup_num_tokens=0), r"prompt_lookup_num_tokens=0 must be an integer >= 1"),
        (dict(max_matching_ngram_size=0), r"max_matching_ngram_size=0 must be an integer >= 1"),
        (dict(assistant_model="draft"), r"prompt_lookup_num_tokens=3 with assistant_model: pass one drafter"),
        (
            dict(prompt_lookup_num_tokens=None, assistant_model="draft", num_beams=2),
            r"assistant_model with num_beams=2: .*pass num_beams=1",
        ),
        (
            dict(prompt_lookup_num_tokens=None, assistant_model="draft", regex="[0-9]+"),
            r"assistant_model with a constraint .*pass one of them",
        ),
        (
            dict(prompt_lookup_num_tokens=None, assistant_model="other_vocabulary"),
            r"assistant_model has a vocabulary of 640 tokens and the model 512",
        ),
    ],
    ids=[
        "beam_search",
        "constraint",
        "no_tokens",
        "no_ngram",
        "two_drafters",
        "draft_and_beam_search",
        "draft_and_constraint",
        "other_vocabulary",
    ],  # fmt: skip
)
def test_what_speculation_does_not_combine_with_is_refused_by_name(loaded, checkpoint, other, message):
    model = loaded("llama")
    ids, mask = _left_padded(PROMPTS)
    drafts = {
        "draft": checkpoint("llama", num_hidden_layers=1),
        "other_vocabulary": checkpoint("llama", vocab_size=640),
    }
    if "assistant_model" in other:
        other = {**other, "assistant_model": drafts[other["assistant_model"]]}
    with pytest.raises(GenerationError, match=message):
        model.generate(ids, mask, max_new_tokens=4, **{"prompt_lookup_num_tokens": 3, **other})


def test_a_call_off_the_slot_core_is_refused_by_name(loaded):
    model = loaded("mamba")  # a recurrent state cannot take back rejected drafts
    ids, mask = _left_padded(PROMPTS)
    with pytest.raises(
        GenerationError,
        match=r"prompt_lookup_num_tokens=3 \(speculative decoding\) runs on the slot core.*MambaForCausalLM.*leave it out",
    ):
        model.generate(ids, mask, max_new_tokens=4, prompt_lookup_num_tokens=3)


def _slot_decode(slot_model, ids, mask, steps: int):
    """As a server drives the core: one prefill chunk of every prompt (`ids`, `mask`: left-padded), then
    one decode call of `steps` tokens with log-probabilities. Returns its `Chosen`."""
    from hfjax import generation

    rows, length = ids.shape[0], slot_model.length
    lengths = mask.sum(axis=1).astype(np.int32)
    features = generation.SamplingFeatures()
    sampling = generation.RowSampling.empty(rows, vocab_size=None, bias_slots=0)
    every = np.ones(rows, bool)
    programs = generation.SlotPrograms(slot_model, prefill_chunk=ids.shape[1], steps=steps, features=features)
    state = slot_model.empty_state(features)
    state, _ = programs.prefill(
        state, sampling, np.arange(rows, dtype=np.int32), ids, np.zeros(rows, np.int32), lengths, every, every,
        np.True_, window=length,
    )  # fmt: skip
    _, chosen = programs.decode(state, sampling, every, np.int32(steps), np.True_, decoding_rows=rows, window=length)
    return chosen


def test_the_slot_programs_over_a_speculative_slot_model_give_the_plain_tokens_and_log_probabilities(loaded):
    # Each row's first `Chosen.made` tokens are the plain decode's, with its log-probabilities.
    from hfjax import generation

    model = loaded("llama")
    ids, mask = _left_padded(PROMPTS)
    rows, steps, length = len(PROMPTS), 12, 64

    def decode(slot_model):
        return _slot_decode(slot_model, ids, mask, steps)

    plain = decode(generation.SlotModel(model, rows, length))
    speculation = generation.Speculation(method="ngram", num_speculative_tokens=3)
    speculative = decode(generation.SpeculativeSlotModel(model, rows, length, speculation))
    np.testing.assert_array_equal(np.asarray(speculative.made), steps)
    assert int(np.asarray(speculative.accepted).sum()) > 0, "no draft was accepted"
    np.testing.assert_array_equal(np.asarray(speculative.token), np.asarray(plain.token))
    np.testing.assert_array_equal(np.asarray(speculative.top_token), np.asarray(plain.top_token))
    for field in ("logprob", "top_logprob"):
        np.testing.assert_allclose(
            np.asarray(getattr(speculative, field)), np.asarray(getattr(plain, field)), atol=1e-4
        )


def test_rows_whose_drafts_are_rejected_draft_less_and_keep_the_plain_tokens(loaded, unrelated_draft):
    # An unrelated draft model's proposals are almost all rejected: after each wholly rejected round a
    # row drafts nothing for 1, 2, 4, ... rounds (`Speculation.backoff_rounds`), with the same tokens.
    from hfjax import generation

    model, draft = loaded("llama"), hfjax.load(unrelated_draft)
    ids, mask = _left_padded(PROMPTS)
    rows, steps, length = len(PROMPTS), 24, 64
    plain = _slot_decode(generation.SlotModel(model, rows, length), ids, mask, steps)
    drafted = {}
    for rounds in (0, 8):
        speculation = generation.Speculation(method="draft_model", num_speculative_tokens=3, backoff_rounds=rounds)
        chosen = _slot_decode(
            generation.SpeculativeSlotModel(model, rows, length, speculation, draft), ids, mask, steps
        )
        np.testing.assert_array_equal(np.asarray(chosen.made), steps)
        np.testing.assert_array_equal(np.asarray(chosen.token), np.asarray(plain.token))
        drafted[rounds] = np.asarray(chosen.drafted)
    # Always drafting offers k tokens in every round but the last; backing off, a row rejected every
    # time offers in rounds 1, 3, 6, 11, 20 (pauses of 1, 2, 4, 8) of its 24 rounds or fewer.
    assert (drafted[8] < drafted[0] // 2).all(), drafted
