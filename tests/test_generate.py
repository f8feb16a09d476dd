"""`Model.generate` against transformers' `generate` run by PyTorch on the same checkpoint."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import warnings

import jax
import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

import background
import hfjax
from hfjax import _backend, _buckets, _compilation_cache, testing, tolerances
from hfjax.bridge import _compile, _env, _specialize
from hfjax.generation import _engine, _planning, _settings, _slots

PROMPTS = ["Hello there, how are you doing today?", "Hi", "The quick brown fox"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """loaded(family) -> hfjax Model of the family's tiny checkpoint (one per module)."""
    models = {}

    def load(family: str, **kwargs):
        if (family, *kwargs.items()) not in models:
            models[(family, *kwargs.items())] = hfjax.load(checkpoint(family, **kwargs))
        return models[(family, *kwargs.items())]

    return load


@pytest.fixture
def decodes(monkeypatch):
    """A list that gains an entry per decode call of the slot core (hfjax serve's programs)."""
    from hfjax.generation import SlotPrograms

    calls = []
    decode = SlotPrograms.decode
    monkeypatch.setattr(SlotPrograms, "decode", lambda self, *a, **k: calls.append(1) or decode(self, *a, **k))
    return calls


def _batch(model, prompts=PROMPTS):
    model.tokenizer.padding_side = "left"
    encoded = model.tokenizer(prompts, padding=True, return_tensors="np")
    return encoded["input_ids"], encoded["attention_mask"]


def _torch_model(model):
    auto = (
        transformers.AutoModelForSeq2SeqLM
        if model.task == "text2text-generation"
        else transformers.AutoModelForCausalLM
    )
    return auto.from_pretrained(model.path).eval()


def _torch_output(model, ids, mask, **kwargs):
    """transformers' generate in PyTorch, as it returns: token ids, or a Generate*Output."""
    with torch.no_grad():
        return _torch_model(model).generate(
            torch.as_tensor(ids).long(), attention_mask=torch.as_tensor(mask).long(), **kwargs
        )


def _assert_generates_like_transformers(model, ids, mask, family: str, **settings) -> None:
    """model.generate's tokens are transformers' and its raw logits within `family`'s tolerance of theirs."""
    settings = dict(settings, return_dict_in_generate=True, output_logits=True)
    actual = model.generate(ids, mask, **settings)
    expected = _torch_output(model, ids, mask, **settings)
    np.testing.assert_array_equal(np.asarray(actual.sequences), expected.sequences.numpy())
    for mine, theirs in zip(actual.logits, expected.logits, strict=True):
        _assert_scores_equal(mine, theirs, tolerances.for_family(family))


def _torch_generate(model, ids, mask, **kwargs):
    return _torch_output(model, ids, mask, **kwargs).numpy()


# Models whose decode loop attends over cache windows: their answers are long enough to cross them.
WINDOWED_FAMILIES = [f for f in testing.GENERATION_FAMILIES if f not in ("mamba", "recurrent_gemma", "t5", "bart")]
LONG = 70  # new tokens: a 16-token prompt bucket and 70 tokens fill a 128-slot cache, read in windows of 64 and 128


@pytest.mark.parametrize("family", testing.GENERATION_FAMILIES)
def test_greedy_tokens_match_transformers(loaded, family):
    model = loaded(family)
    ids, mask = _batch(model)
    assert len(set(mask.sum(axis=1))) == 3  # three prompt lengths, left-padded
    # Sliding-window families (window 64) also mask by distance once the answer passes 64 tokens.
    new = (
        dict(max_new_tokens=LONG, min_new_tokens=LONG)
        if family in WINDOWED_FAMILIES
        else dict(max_new_tokens=NEW_TOKENS)
    )
    expected = _torch_generate(model, ids, mask, do_sample=False, **new)
    actual = np.asarray(model.generate(ids, mask, do_sample=False, **new))
    np.testing.assert_array_equal(actual, expected)
    if family in WINDOWED_FAMILIES:
        assert _planning.windows(_buckets.bucket(ids.shape[1]), 128) == (64, 128)


def test_mamba_generates_like_transformers_on_its_own_test_config():
    # transformers' MambaModelTester config, weights spread so that every step picks a new token (the
    # tiny family's answer repeats one token, which a decode loop that lost its state gives too).
    # transformers 5.24 renamed the cache argument `cache_params` to `cache` and swallows the old name
    # in **kwargs: each step then ran from no state.
    config = transformers.MambaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, intermediate_size=32, n_positions=512,
        bos_token_id=98, eos_token_id=98, pad_token_id=98, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    module = transformers.MambaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(
                torch.randn(parameter.shape, generator=torch.Generator().manual_seed(parameter.numel())) * 0.3
            )
    ids = torch.randint(0, 98, (4, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :1] = 0, 0  # left padding
    ids[mask == 0] = 98
    with torch.no_grad():
        expected = module.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False).numpy()
    assert min(len(set(row)) for row in expected[:, 7:]) >= 4, "the reference repeats itself: the test proves nothing"
    model = hfjax.Model.from_module(module)
    actual = model.generate(ids.numpy(), mask.numpy(), max_new_tokens=12, do_sample=False)
    np.testing.assert_array_equal(np.asarray(actual), expected)
    assert model.generation_programs.on_slot_core  # (a state per slot)


def test_bloom_runs_on_the_slot_core_with_transformers_logits(loaded):
    # Bloom takes no position_ids: its ALiBi comes from the 2-D mask, by each key's place among the
    # row's real tokens; the slots bias each key by its column. The logits of three left-padded rows
    # (the tiny checkpoint's tokens repeat, its logits do not) show a bias off by a row's pads.
    model = loaded("bloom")
    ids, mask = _batch(model)
    _assert_generates_like_transformers(model, ids, mask, "bloom", max_new_tokens=6)
    assert model.generation_programs.on_slot_core


@pytest.mark.parametrize("family", ["llama", "gemma2", "mamba"])
def test_each_row_of_a_padded_batch_is_what_its_prompt_alone_gives(loaded, family):
    model = loaded(family)
    ids, mask = _batch(model)
    batch = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS))[:, ids.shape[1] :]
    for row, prompt in enumerate(PROMPTS):
        alone_ids, alone_mask = _batch(model, [prompt])
        alone = np.asarray(model.generate(alone_ids, alone_mask, max_new_tokens=NEW_TOKENS))[:, alone_ids.shape[1] :]
        np.testing.assert_array_equal(batch[row, : alone.shape[1]], alone[0], err_msg=f"row {row}: {prompt!r}")


@pytest.mark.parametrize("family", ["zamba", "falcon_h1", "gpt_neo", "ctrl", "openai-gpt"])
def test_models_generator_recomputes_run_on_the_slot_core_like_transformers(loaded, decodes, family):
    # transformers compiles none of these in one whole program, so `Generator` runs them without a
    # cache; their forwards take transformers' static cache all the same, which the slots keep. Zamba's
    # and Falcon-H1's "hybrid" layers keep keys and values and a mamba state in one cache layer. GPT-1
    # takes no cache at all: its slots keep its tokens, and each step runs them whole.
    model = loaded(family)
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    actual = np.asarray(model.generate(ids, mask, **settings))
    assert decodes, "the call did not run on the slot core"
    np.testing.assert_array_equal(actual, _torch_generate(model, ids, mask, **settings))


def test_a_hybrid_whose_mlp_layers_keep_no_cache_runs_on_the_slot_core_like_transformers(loaded, decodes):
    # Nemotron-H mixes mamba, attention, and MLP and MoE layers without attention, for which transformers
    # 5.24 keeps a DummyLayer and 5.17 a recurrent cache layer that no layer writes: the slots pass
    # either through beside the others' states and keys and values.
    model = loaded("nemotron_h")
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, **settings)), _torch_generate(model, ids, mask, **settings)
    )
    assert decodes, "the call did not run on the slot core"


def test_chunked_attention_runs_on_the_slot_core_like_transformers(checkpoint, decodes):
    # Llama 4's chunked layers see the keys of their query's chunk of positions only: with chunks of 4,
    # the batch's prompts and new tokens cross several, beside a full-attention layer (a mask per kind).
    path = checkpoint(
        "llama4_text",
        task="text-generation",
        attention_chunk_size=4,
        layer_types=["chunked_attention", "full_attention"],
    )
    model = hfjax.load(path)
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, **settings)), _torch_generate(model, ids, mask, **settings)
    )
    assert decodes, "the call did not run on the slot core"


def test_a_model_that_keeps_no_cache_a_slot_can_hold_recomputes_its_tokens_on_the_slot_core(loaded, decodes):
    # RecurrentGemma keeps its state in its modules (transformers 5.17) or in a cache of its own (5.24):
    # each slot keeps its tokens so far and each step runs them whole, reading the logits at the row's
    # position. Its convolution and recurrence read a prompt's left pads (its logits move by ~2e-3
    # with two of them), so the programs lay each row's pads before its tokens, as transformers'
    # input_ids hold them: the logits of a padded batch and of one without pads, each as transformers'.
    model = loaded("recurrent_gemma")
    padded, padding = _batch(model)
    assert not padding.all() and padding[:, -3:].all()  # the last 3 columns: a batch without pads
    for ids, mask in ((padded, padding), (padded[:, -3:], padding[:, -3:])):
        _assert_generates_like_transformers(
            model, ids, mask, "recurrent_gemma", max_new_tokens=NEW_TOKENS, do_sample=False
        )
        assert decodes, "the call did not run on the slot core"
        decodes.clear()


def test_rwkv_recomputes_its_tokens_and_pads_on_the_slot_core_as_its_forward_reads_them(checkpoint, decodes):
    # RWKV takes no positions and reads no mask: its slots run each row's pads, then its tokens, from
    # column 0. The reference is transformers' forward over the whole sequence at every step: its own
    # generate, which carries RWKV's state, gives other logits than that forward on this checkpoint
    # (about 1 apart, transformers 5.24), so its tokens differ from both.
    model = hfjax.load(checkpoint("rwkv", task="text-generation"))
    ids, mask = _batch(model)
    assert not mask.all()
    sequence = torch.as_tensor(ids).long()
    with torch.no_grad():
        module = _torch_model(model)
        for _ in range(NEW_TOKENS):
            logits = module(sequence, use_cache=False).logits[:, -1]
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), sequence.numpy())
    assert decodes, "the call did not run on the slot core"


def test_a_model_whose_generate_runs_a_placeholder_token_is_refused_by_name(checkpoint):
    # XLNet's generate in transformers appends a token at every step and predicts it; hfjax's engines
    # run a causal LM's tokens so far, which gave other tokens, so both refuse it, saying why.
    model = hfjax.load(checkpoint("xlnet", task="text-generation"))
    ids, mask = _batch(model)
    with pytest.raises(hfjax.GenerationError, match=r"XLNetLMHeadModel: transformers' generate appends a placeholder"):
        model.generate(ids, mask, max_new_tokens=2)
    with pytest.raises(hfjax.GenerationError, match="XLNetLMHeadModel"):
        hfjax.generation.check_supported(model)  # (what `hfjax serve` asks at start)


def test_a_recomputed_model_that_is_not_causal_reads_only_its_tokens_so_far(checkpoint, decodes):
    # BertGeneration without is_decoder attends both ways: its slots' columns after a row's last token
    # (zeros, or an earlier step's) must be masked, as transformers' generate has no such tokens.
    model = hfjax.load(checkpoint("bert-generation", task="text-generation"))
    ids = np.random.default_rng(0).integers(5, 90, (2, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    _assert_generates_like_transformers(model, ids, mask, "bert-generation", max_new_tokens=NEW_TOKENS, do_sample=False)
    assert decodes, "the call did not run on the slot core"


@pytest.mark.parametrize("family", ["mamba2", "jamba", "zamba"])
def test_beam_search_over_recurrent_states_runs_on_the_slot_core_like_transformers(loaded, monkeypatch, family):
    # Each step moves every slot's keys and values and its recurrent layers' states to its beam's
    # parent (Mamba 2: states alone; Jamba: mamba layers beside attention ones; Zamba: both in one layer).
    searches = _count_searches(monkeypatch)
    model = loaded(family)
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, num_beams=3, num_return_sequences=2, do_sample=False)
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, **settings)), _torch_generate(model, ids, mask, **settings)
    )
    assert searches, "the search did not run on the slot core"


@pytest.mark.parametrize("family", ["mpt", "marian", "blenderbot", "whisper", "roformer", "trocr", "prophetnet"])
def test_models_that_take_no_position_ids_run_on_the_slot_core_like_transformers(checkpoint, decodes, family):
    # MPT's ALiBi reads key columns alone. Marian's, Blenderbot's and Whisper's causal LMs count positions
    # from their cache's length, left pads included: the slots look each row's own up, shifted by its pads.
    # RoFormer's rotary, TrOCR's and ProphetNet's positions count from the cache's length too, in ways the
    # slots do not know: their slots recompute them, each run from column 0 with the row's pads before it.
    model = hfjax.load(checkpoint(family, task="text-generation"))
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = _torch_generate(model, ids, mask, **settings)
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), expected)
    assert decodes, "the call did not run on the slot core"
    if family == "marian":  # the beams' steps look positions up too
        settings["num_beams"] = 2
        expected = _torch_generate(model, ids, mask, **settings)
        np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), expected)


def test_a_hybrid_linear_attention_model_generates_like_transformers(loaded):
    # Qwen3.5's linear-attention layers zero the prompt's pads by the last columns of the mask they
    # get (transformers' create_recurrent_attention_mask): the prefill must pass the prompt's mask.
    model = loaded("qwen3_5_text")
    ids, mask = _batch(model)
    expected = _torch_generate(model, ids, mask, do_sample=False, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, do_sample=False, max_new_tokens=NEW_TOKENS)), expected
    )
    assert model.generation_programs.on_slot_core  # (keys and values, and states)


def test_a_missing_mask_is_inferred_from_the_pad_token_like_transformers(loaded):
    model = loaded("llama")
    ids, mask = _batch(model)
    assert (mask == 0).any() and model.tokenizer.pad_token_id not in np.atleast_1d(model.generation_config.eos_token_id)
    with torch.no_grad():
        expected = _torch_model(model).generate(torch.as_tensor(ids).long(), max_new_tokens=NEW_TOKENS).numpy()
    actual = np.asarray(model.generate(ids, max_new_tokens=NEW_TOKENS))
    np.testing.assert_array_equal(actual, expected)
    np.testing.assert_array_equal(actual, np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS)))


@pytest.mark.parametrize("with_mask", [True, False])
def test_right_padded_prompts_warn_like_transformers(loaded, with_mask):
    model = loaded("llama")
    model.tokenizer.padding_side = "right"
    encoded = model.tokenizer(PROMPTS[:2], padding=True, return_tensors="np")
    mask = encoded["attention_mask"] if with_mask else None
    with pytest.warns(UserWarning, match="right-padding was detected"):
        model.generate(encoded["input_ids"], mask, max_new_tokens=2)
    ids, mask = _batch(model, PROMPTS[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(ids, mask if with_mask else None, max_new_tokens=2)


@pytest.mark.parametrize("family", ["llama", "recurrent_gemma"])
def test_right_padded_prompts_run_on_the_slot_core_as_left_padded_ones(loaded, decodes, family):
    # transformers reads a right-padded row's first new token off its last pad (at position 0) and
    # places the new tokens at positions 1, 2, ...; the slot core lays each row out as left padding
    # does. The answer is the caller's prompts, then transformers' new tokens for them left-padded.
    # RecurrentGemma's layers read the pads: the slots lay them before each row, as left padding has them.
    model = loaded(family)
    model.tokenizer.padding_side = "right"
    right = model.tokenizer(PROMPTS, padding=True, return_tensors="np")
    ids, mask = _batch(model)
    width = ids.shape[1]
    with pytest.warns(UserWarning, match="right-padding was detected"):
        actual = np.asarray(model.generate(right["input_ids"], right["attention_mask"], max_new_tokens=NEW_TOKENS))
    assert decodes, "the call did not run on the slot core"
    np.testing.assert_array_equal(actual[:, :width], right["input_ids"])
    expected = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(actual[:, width:], expected[:, width:])


def test_eos_stops_rows_and_pads_them_like_transformers(loaded):
    model = loaded("qwen3")
    ids, mask = _batch(model)
    free = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS))[:, ids.shape[1] :]
    eos = [int(free[0, 2]), int(free[1, 5])]  # tokens the rows produce mid-way: they must stop there
    expected = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=7)
    actual = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=7))
    np.testing.assert_array_equal(actual, expected)
    assert (actual[0, ids.shape[1] + 3 :] == 7).all()


def test_rows_that_stop_at_different_steps_end_the_answer_where_the_last_stops(loaded):
    model = loaded("llama")
    ids, mask = _batch(model, PROMPTS[:2])
    free = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS))[:, ids.shape[1] :]
    eos = [int(free[0, 1]), int(free[1, 4])]  # row 0 stops first, row 1 by its fifth token
    expected = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=7)
    actual = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=7))
    np.testing.assert_array_equal(actual, expected)
    assert actual.shape[1] <= ids.shape[1] + 5  # no step after both rows stopped


def test_min_new_tokens_holds_eos_back_like_transformers(loaded):
    model = loaded("llama")
    ids, mask = _batch(model)
    first = int(np.asarray(model.generate(ids, mask, max_new_tokens=1))[0, -1])
    settings = dict(max_new_tokens=8, min_new_tokens=4, eos_token_id=first)
    expected = _torch_generate(model, ids, mask, **settings)
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), expected)


def test_repetition_penalty_matches_transformers(loaded):
    model = loaded("llama")
    ids, mask = _batch(model, ["Hi"])  # greedy repeats a token on this prompt
    expected = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, repetition_penalty=1.5)
    plain = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
    assert not np.array_equal(expected, plain)  # the penalty changes this output
    actual = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS, repetition_penalty=1.5))
    np.testing.assert_array_equal(actual, expected)


def _decoder_length(model, ids) -> int:
    """The length transformers counts max_length and min_length from: the decoder's input."""
    return 1 if model.task == "text2text-generation" else ids.shape[1]


# Settings that change a plain greedy run, built from its new tokens [B, T], the decoder's input
# length and the tokens the checkpoint forces (which transformers refuses to suppress).
CONSTRAINTS = {
    "no_repeat_ngram_size": lambda new, start, forced: dict(no_repeat_ngram_size=2),
    "bad_words_ids": lambda new, start, forced: dict(
        bad_words_ids=[[int(new[0, 2])], [int(new[1, 2]), int(new[1, 3])]]
    ),
    "sequence_bias": lambda new, start, forced: dict(
        sequence_bias={(int(new[2, 2]),): -5.0, (int(new[0, 2]), int(new[0, 3])): -9.0}
    ),
    "suppress_tokens": lambda new, start, forced: dict(
        suppress_tokens=sorted({int(t) for t in new[:, 2:5].flat} - forced)
    ),
    "begin_suppress_tokens": lambda new, start, forced: dict(
        begin_suppress_tokens=sorted({int(t) for t in new[:2, :2].flat})
    ),
    "min_length": lambda new, start, forced: dict(min_length=start + 6, eos_token_id=int(new[0, 2])),
    "max_length": lambda new, start, forced: dict(max_length=start + 5, max_new_tokens=None),
}


# Every constraint on a decoder; on encoder-decoders those that count from the decoder's own start
# (lengths, the first step) or read its tokens. bart's tiny checkpoint decodes nothing but its
# forced first token, which transformers refuses to suppress (tested below).
CONSTRAINT_CASES = [(name, "llama") for name in CONSTRAINTS] + [
    ("min_length", "t5"), ("max_length", "t5"), ("begin_suppress_tokens", "t5"), ("suppress_tokens", "t5"),
    ("no_repeat_ngram_size", "bart"), ("sequence_bias", "bart"), ("bad_words_ids", "bart"),
]  # fmt: skip


@pytest.mark.parametrize("name, family", CONSTRAINT_CASES)
def test_token_constraints_match_transformers(loaded, decodes, family, name):
    model = loaded(family)
    ids, mask = _batch(model)
    plain = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
    start = _decoder_length(model, ids)
    config = model.generation_config
    forced = {config.forced_bos_token_id, config.forced_eos_token_id}
    settings = {"max_new_tokens": NEW_TOKENS, **CONSTRAINTS[name](plain[:, start:], start, forced)}
    expected = _torch_generate(model, ids, mask, **settings)
    assert not np.array_equal(expected, plain)  # the setting changes this output
    decodes.clear()
    actual = np.asarray(model.generate(ids, mask, **settings))
    np.testing.assert_array_equal(actual, expected)
    assert decodes  # every call runs on the slot core (T5: each row's relative position bias its own)


@pytest.mark.parametrize("family, beams", [("llama", 1), ("llama", 2), ("t5", 1), ("t5", 2)])
def test_encoder_no_repeat_ngram_size_matches_transformers(loaded, monkeypatch, decodes, family, beams):
    # n-grams of the encoder's input may not be repeated; a decoder's "encoder input" is its prompt,
    # pads included. A decoder's prompts are extended by their own greedy answers, so that the
    # answer to them would repeat the prompt's n-grams (the tiny llama repeats none of the plain prompts').
    model = loaded(family)
    ids, mask = _batch(model)
    if family == "llama":
        answer = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)[:, ids.shape[1] :]
        ids, mask = np.concatenate([ids, answer], axis=1), np.concatenate([mask, np.ones_like(answer)], axis=1)
    settings = {"max_new_tokens": NEW_TOKENS, "num_beams": beams}
    plain = _torch_generate(model, ids, mask, **settings)
    expected = _torch_generate(model, ids, mask, encoder_no_repeat_ngram_size=2, **settings)
    assert not np.array_equal(expected, plain)  # the setting changes this output
    searches = _count_searches(monkeypatch)
    decodes.clear()
    actual = np.asarray(model.generate(ids, mask, encoder_no_repeat_ngram_size=2, **settings))
    np.testing.assert_array_equal(actual, expected)
    # On the slot core, an encoder-decoder's n-grams from its slots' encoder ids (`SlotState.encoder_ids`)
    assert bool(searches if beams > 1 else decodes)


def _count_searches(monkeypatch) -> list:
    """A list that gains an entry per beam search call of the slot core (`SlotBeams.search`)."""
    from hfjax.generation import _slot_beams

    searches = []
    search = _slot_beams.SlotBeams.search
    monkeypatch.setattr(
        _slot_beams.SlotBeams, "search", lambda self, *a, **k: searches.append(1) or search(self, *a, **k)
    )
    return searches


def _assert_scores_equal(actual, expected, tolerance):
    # -inf (a filtered token) must be -inf on both sides; finite scores within the tolerance.
    actual, expected = np.asarray(actual), expected.numpy()
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=0, atol=tolerance.atol)


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_return_dict_in_generate_gives_transformers_scores_and_logits(loaded, family):
    model = loaded(family)
    ids, mask = _batch(model)
    tolerance = tolerances.for_family(model.config.model_type)
    greedy = dict(
        max_new_tokens=6,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        repetition_penalty=1.3,
        no_repeat_ngram_size=1,
    )
    expected = _torch_output(model, ids, mask, **greedy)
    actual = model.generate(ids, mask, **greedy)
    assert type(actual) is type(expected)
    np.testing.assert_array_equal(np.asarray(actual.sequences), expected.sequences.numpy())
    assert len(actual.scores) == len(expected.scores) == len(actual.logits) == len(expected.logits)
    for mine, theirs in zip(actual.scores + actual.logits, expected.scores + expected.logits):
        _assert_scores_equal(mine, theirs, tolerance)
    assert np.isneginf(np.asarray(actual.scores[-1])).any()  # the ban on repeats shows in the processed scores
    # Sampled tokens differ from PyTorch's draws, so only the first token's scores compare; top-k leaves -inf.
    sampled = dict(
        max_new_tokens=2, return_dict_in_generate=True, output_scores=True, do_sample=True, top_k=5, temperature=0.7
    )
    expected = _torch_output(model, ids, mask, **sampled)
    actual = model.generate(ids, mask, seed=0, **sampled)
    _assert_scores_equal(actual.scores[0], expected.scores[0], tolerance)
    kept = np.isfinite(np.asarray(actual.scores[0])).sum(axis=1)
    assert actual.logits is None and ((kept >= 1) & (kept <= 5)).all()  # top-k (bart forces its first token)
    plain = model.generate(ids, mask, max_new_tokens=2, output_scores=True)  # as in transformers: ids only
    assert isinstance(plain, jax.Array)


def test_return_dict_in_generate_alone_runs_on_the_slot_core_and_gives_transformers_output(loaded, decodes):
    model = loaded("llama")
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    expected = _torch_output(model, ids, mask, **settings)
    actual = model.generate(ids, mask, **settings)
    assert decodes, "the call did not run on the slot core"
    assert type(actual) is type(expected) and actual.scores is None and actual.logits is None
    np.testing.assert_array_equal(np.asarray(actual.sequences), expected.sequences.numpy())


def test_scores_and_logits_run_on_the_slot_core_and_equal_transformers_past_a_rows_eos(loaded, decodes):
    # Row 0 stops at its third token; transformers then feeds it pad tokens, which its repetition
    # penalty and n-gram ban read, while the other rows go on: every step's scores of every row,
    # the stopped one's included, are transformers'.
    model = loaded("llama")
    # Prompts of one length: transformers before 5.23 penalises a batch's left pads as seen tokens
    # (see test_sampling.py), a difference this test is not about.
    words = model.tokenizer(" ".join(PROMPTS * 3), return_tensors="np")["input_ids"][0]
    ids = np.stack([words[i : i + 12] for i in (0, 13, 26)]).astype(np.int64)
    mask = np.ones_like(ids)
    tolerance = tolerances.for_family(model.config.model_type)
    settings = dict(max_new_tokens=8, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2)
    free = _torch_generate(model, ids, mask, eos_token_id=None, **settings)[:, ids.shape[1] :]
    eos = int(free[0, 2])
    assert not np.isin(free[1:, :3], eos).any(), "another row stops as early: pick another prompt"
    settings.update(
        eos_token_id=eos, pad_token_id=7, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    expected = _torch_output(model, ids, mask, **settings)
    actual = model.generate(ids, mask, **settings)
    assert decodes, "the call did not run on the slot core"
    sequences = expected.sequences.numpy()
    assert (sequences[0, ids.shape[1] + 3 :] == 7).all() and len(expected.scores) > 4  # the others went on
    np.testing.assert_array_equal(np.asarray(actual.sequences), sequences)
    assert len(actual.scores) == len(expected.scores) == len(actual.logits) == len(expected.logits)
    for mine, theirs in zip(actual.scores + actual.logits, expected.scores + expected.logits):
        _assert_scores_equal(mine, theirs, tolerance)


def test_suppressing_a_forced_token_is_refused_as_transformers_refuses_it(loaded):
    model = loaded("bart")
    ids, mask = _batch(model)
    with pytest.raises(ValueError, match="forced_bos_token_id"):
        _torch_generate(model, ids, mask, max_new_tokens=4, suppress_tokens=[1])
    with pytest.raises(ValueError, match=r"suppress_tokens=\[1\] suppresses forced_bos_token_id=1"):
        model.generate(ids, mask, max_new_tokens=4, suppress_tokens=[1])


def test_decoder_start_token_id_is_taken_from_the_call(loaded):
    model = loaded("bart")
    ids, mask = _batch(model)
    expected = _torch_generate(model, ids, mask, max_new_tokens=6, decoder_start_token_id=5)
    assert (expected[:, 0] == 5).all()
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, max_new_tokens=6, decoder_start_token_id=5)), expected
    )


def test_an_encoder_decoder_without_a_decoder_start_token_starts_from_bos_like_transformers(loaded):
    model = loaded("bart", decoder_start_token_id=None)
    assert model.generation_config.decoder_start_token_id is None
    ids, mask = _batch(model)
    expected = _torch_generate(model, ids, mask, max_new_tokens=6)
    assert (expected[:, 0] == model.generation_config.bos_token_id).all()
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, max_new_tokens=6)), expected)
    model = loaded("bart", decoder_start_token_id=None, bos_token_id=None)
    with pytest.raises(ValueError, match="decoder_start_token_id"):  # transformers refuses it too
        _torch_generate(model, ids, mask, max_new_tokens=6)
    with pytest.raises(ValueError, match="neither decoder_start_token_id nor bos_token_id.*decoder_start_token_id=ID"):
        model.generate(ids, mask, max_new_tokens=6)


# Decoders with other position schemes, each with weights wide enough that rows' answers differ:
# Blenderbot's learned and Marian's sinusoidal tables, looked up per row (`POSITION_EMBEDDINGS`), and
# UMT5's relative position bias in every self-attention layer, per row (`RELATIVE_BIASES`).
OTHER_POSITIONS = {"blenderbot": {"init_std": 0.2}, "marian": {"init_std": 0.2}, "umt5": {"initializer_factor": 5.0}}


@pytest.mark.parametrize("family, beams", [("blenderbot", 1), ("marian", 1), ("marian", 2), ("umt5", 1)])
def test_encoder_decoders_of_other_position_schemes_run_on_the_slot_core_like_transformers(
    checkpoint, monkeypatch, decodes, family, beams
):
    model = hfjax.load(checkpoint(family, task="text2text-generation", **OTHER_POSITIONS[family]))
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, num_beams=beams)
    expected = _torch_generate(model, ids, mask, **settings)
    assert len({tuple(row) for row in expected.tolist()}) > 1  # the answers read the encoder's input
    searches = _count_searches(monkeypatch)
    actual = np.asarray(model.generate(ids, mask, **settings))
    np.testing.assert_array_equal(actual, expected)
    assert bool(searches if beams > 1 else decodes)


def test_prompt_lookup_on_an_encoder_decoder_runs_on_the_slot_core_like_transformers(checkpoint, decodes):
    # Drafts from each row's decoder tokens, verified over its slot's cross keys. transformers' prompt
    # lookup takes one prompt at a time; its greedy tokens are its plain greedy decode's.
    path = checkpoint("bart", init_std=0.2)
    model = hfjax.load(path)
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = _torch_generate(model, ids, mask, **settings)
    actual = np.asarray(model.generate(ids, mask, prompt_lookup_num_tokens=3, **settings))
    stats = model.last_generation_stats
    np.testing.assert_array_equal(actual, expected)
    # transformers' own prompt lookup on one prompt gives the same tokens (5.17's stops at BART's decoder
    # start token; 5.24's decodes)
    if Version(transformers.__version__) >= Version("5.24"):
        alone = _torch_generate(
            model, ids[:1, -mask[0].sum() :], mask[:1, -mask[0].sum() :], prompt_lookup_num_tokens=3, **settings
        )
        np.testing.assert_array_equal(actual[:1], alone)
    assert stats.accepted_tokens > 0 and decodes, stats
    # A draft model would need cross slots of its own: the draft is refused, naming its kind of past.
    with pytest.raises(ValueError, match=r"BartForConditionalGeneration keeps its past as 'encoder-decoder'"):
        model.generate(ids, mask, max_new_tokens=4, assistant_model=model)


@pytest.mark.parametrize(
    "family",
    [
        "m2m_100",
        "nllb-moe",
        "seamless_m4t",
        "seamless_m4t_v2",
        "pegasus",
        "pegasus_x",
        "plbart",
        "mvp",
        "bigbird_pegasus",
    ],
)
def test_encoder_decoders_whose_decoder_counts_positions_from_its_cache_run_on_the_slot_core(
    checkpoint, decodes, family
):
    # Their decoders' position tables count from the cache's length; the slots look each row's own up
    # (`_slots.POSITION_EMBEDDINGS`: M2M100's, NLLB-MoE's and SeamlessM4T's from padding_idx + 1). The second prompt
    # is padded on the right, as the encoder takes it.
    model = hfjax.load(checkpoint(family, task="text2text-generation"))
    ids = np.random.default_rng(0).integers(4, min(400, model.config.vocab_size), size=(2, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    ids[1, 4:] = model.config.pad_token_id
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = _torch_generate(model, ids, mask, **settings)
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), expected)
    assert decodes, "the call did not run on the slot core"


@pytest.mark.parametrize("family", ["fsmt", "led"])
def test_an_encoder_decoder_whose_decoder_masks_nothing_over_a_cache_runs_on_the_slot_core(
    checkpoint, monkeypatch, decodes, family
):
    # Over a cache, FSMT's decoder masks no key, and LED's makes no mask for a single query: the slots hand
    # them theirs (`UNMASKED_DECODERS`). Both count positions from the cache's length (FSMT's table as
    # M2M100's, from padding_idx + 1), looked up per row. LED's encoder asks whether any token attends
    # globally, which the slots answer (`KNOWN_READS`). Weights wide enough that the rows' logits differ;
    # the second prompt is padded on the right.
    if family == "fsmt" and Version(transformers.__version__) < Version("5.24"):
        pytest.skip("FSMT's decoder before transformers 5.24 takes all its tokens at every step: Generator runs it")
    model = hfjax.load(checkpoint(family, task="text2text-generation", init_std=0.2))
    pad = model.config.pad_token_id
    ids = np.array([[5, 6, 7, 8, 9, 10, 2], [11, 12, 13, 2, pad, pad, pad]])
    mask = (ids != pad).astype(np.int64)
    _assert_generates_like_transformers(model, ids, mask, family, max_new_tokens=12, do_sample=False, num_beams=1)
    assert decodes, "the call did not run on the slot core"
    searches = _count_searches(monkeypatch)  # beam search, on the slots too
    settings = dict(max_new_tokens=8, num_beams=2, do_sample=False)
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, **settings)), _torch_generate(model, ids, mask, **settings)
    )
    assert searches


def test_an_encoder_decoder_with_sliding_window_layers_runs_on_the_slot_core_like_transformers(
    checkpoint, decodes, tmp_path
):
    # T5Gemma's decoder alternates sliding-window and full self-attention layers (Gemma 2's): the slots
    # give it a mask per kind. A window of 4 hides keys from prompts of 7 tokens and 10 new ones.
    path = checkpoint("t5gemma", task="text2text-generation")
    config = json.loads((path / "config.json").read_text())
    for part in ("encoder", "decoder"):
        config[part]["sliding_window"] = 4
    narrow = shutil.copytree(path, tmp_path / "t5gemma")
    (narrow / "config.json").write_text(json.dumps(config))
    model = hfjax.load(narrow)
    ids = np.random.default_rng(0).integers(4, 400, size=(2, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    ids[1, 4:] = model.config.pad_token_id
    settings = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    expected = _torch_generate(model, ids, mask, **settings)
    assert not np.array_equal(expected, _torch_generate(hfjax.load(path), ids, mask, **settings))  # the window counts
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), expected)
    assert decodes, "the call did not run on the slot core"


def test_the_decoder_gets_the_encoder_output_type_like_transformers(checkpoint, decodes):
    # Switch Transformers' forward reads encoder_outputs.router_logits, a field BaseModelOutput lacks
    # (`_encoder_slots.ROUTED_ENCODERS`); its decoder's relative bias is T5's, each row's own on the core.
    model = hfjax.load(checkpoint("switch_transformers", task="text2text-generation"))
    ids = np.random.default_rng(0).integers(4, model.config.vocab_size, size=(2, 6))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    expected = _torch_generate(model, ids, mask, **settings)
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), expected)
    assert decodes, "the call did not run on the slot core"


def test_num_return_sequences_gives_adjacent_draws_per_prompt(loaded):
    model = loaded("llama")
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=8, do_sample=True, top_k=0, temperature=2.0, seed=3)
    out = np.asarray(model.generate(ids, mask, num_return_sequences=2, **settings))
    repeated = np.asarray(model.generate(np.repeat(ids, 2, axis=0), np.repeat(mask, 2, axis=0), **settings))
    np.testing.assert_array_equal(out, repeated)  # transformers' order: each prompt's copies side by side
    assert out.shape[0] == 6 and not np.array_equal(out[0], out[1])  # the copies are separate draws
    texts = model.generate_text(PROMPTS[0], num_return_sequences=3, **settings)
    assert isinstance(texts, list) and len(texts) == 3
    with pytest.raises(ValueError, match="num_return_sequences=2.*greedy"):
        model.generate(ids, mask, num_return_sequences=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_return_sequences"):  # transformers refuses it too
        _torch_generate(model, ids, mask, num_return_sequences=2, max_new_tokens=4)


def test_checkpoint_settings_are_carried_out_or_named(checkpoint, tmp_path):

    path = shutil.copytree(checkpoint("llama"), tmp_path / "llama")
    config = json.loads((path / "generation_config.json").read_text())
    summarizer = {
        "num_beams": 4,
        "no_repeat_ngram_size": 2,
        "length_penalty": 2.0,
        "early_stopping": True,
        "min_length": 20,
    }
    (path / "generation_config.json").write_text(json.dumps({**config, **summarizer}))
    model = hfjax.load(path)
    ids, mask = _batch(model)
    expected = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)  # beam search, as the checkpoint asks
    assert not np.array_equal(expected, _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, num_beams=1))
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS)), expected)
    (path / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "typical_p": 0.5}))
    model = hfjax.load(path)
    with pytest.raises(
        ValueError, match=r"typical_p=0\.5 \(from .*generation_config.json\) asks for typical sampling.*typical_p=1\.0"
    ):
        model.generate(ids, mask, max_new_tokens=NEW_TOKENS)


# Beam search settings, each with an EOS that some beams produce, so that beams end early.
BEAMS = {
    "plain": dict(num_beams=3),
    "two_returned_early_stopping": dict(num_beams=4, num_return_sequences=2, length_penalty=2.0, early_stopping=True),
    "never_stop_early_repetition_penalty": dict(
        num_beams=3, early_stopping="never", length_penalty=0.5, repetition_penalty=2.0
    ),
    "short_favoured_min_new_tokens": dict(num_beams=2, length_penalty=-1.0, min_new_tokens=4, no_repeat_ngram_size=3),
}


# Every setting on llama, and the plain search on each other kind of past (a Conv1D model, a
# recurrence rerun without a cache, two encoder-decoders): settings and families are independent.
BEAM_CASES = [(name, "llama") for name in BEAMS] + [("plain", f) for f in ("gpt2", "recurrent_gemma", "t5", "bart")]


# Beam search runs on the slot core (hfjax serve's cache and prefill) for every past here: a static
# cache, encoder-decoders' (their slots' cross keys), and RecurrentGemma's tokens, rerun at each step.
BEAMS_ON_SLOTS = ("llama", "gpt2", "recurrent_gemma", "t5", "bart")


@pytest.mark.parametrize("name, family", BEAM_CASES)
def test_beam_search_matches_transformers(loaded, monkeypatch, family, name):
    searches = _count_searches(monkeypatch)
    model = loaded(family)
    ids, mask = _batch(model)
    start = _decoder_length(model, ids)
    beams = BEAMS[name]["num_beams"]
    plain = _torch_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, num_beams=beams, num_return_sequences=beams)
    # EOS tokens that beams produce as their third token, and that are not forced.
    forced = {model.generation_config.forced_bos_token_id, model.generation_config.forced_eos_token_id}
    eos = sorted({int(t) for t in plain[:, start + 2]} - forced)[:3]
    settings = dict(max_new_tokens=NEW_TOKENS, pad_token_id=7, **BEAMS[name])
    if family == "recurrent_gemma":
        # transformers' beam search does not reorder recurrent_gemma's recurrent state between
        # beams; without its cache it reruns each beam, as the slots do for this model.
        settings["use_cache"] = False
    expected = _torch_generate(model, ids, mask, eos_token_id=eos, **settings)
    assert not np.array_equal(expected, _torch_generate(model, ids, mask, **settings))  # the beams that ended count
    settings["eos_token_id"] = eos
    actual = np.asarray(model.generate(ids, mask, **settings))
    np.testing.assert_array_equal(actual, expected)
    assert bool(searches) == (family in BEAMS_ON_SLOTS)


def test_beam_search_refuses_what_it_cannot_do(loaded):
    model = loaded("llama")
    ids, mask = _batch(model)
    with pytest.raises(ValueError, match=r"num_beams=2 with a streamer"):
        model.generate(
            ids[:1], mask[:1], max_new_tokens=4, num_beams=2, streamer=transformers.TextStreamer(model.tokenizer)
        )
    with pytest.raises(ValueError, match=r"num_beams=2 asks for beam sampling"):
        model.generate(ids, mask, max_new_tokens=4, num_beams=2, do_sample=True)
    with pytest.raises(ValueError, match=r"num_return_sequences=3.*returns 2 sequences per prompt"):
        model.generate(ids, mask, max_new_tokens=4, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match=r"early_stopping='sometimes' must be True, False or 'never'"):
        model.generate(ids, mask, max_new_tokens=4, num_beams=2, early_stopping="sometimes")


def test_checkpoint_generation_config_gives_the_defaults(checkpoint, tmp_path):

    path = shutil.copytree(checkpoint("llama"), tmp_path / "llama")
    config = json.loads((path / "generation_config.json").read_text())
    config["max_new_tokens"] = 5
    (path / "generation_config.json").write_text(json.dumps(config))
    model = hfjax.load(path)
    ids, mask = _batch(model, PROMPTS[:1])
    assert np.asarray(model.generate(ids, mask)).shape == (1, ids.shape[1] + 5)
    config = transformers.GenerationConfig(max_new_tokens=3)
    assert np.asarray(model.generate(ids, mask, generation_config=config)).shape == (1, ids.shape[1] + 3)


# -- sampling ----------------------------------------------------------------------


def test_sampling_is_seeded(loaded):
    model = loaded("llama")
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.5, top_k=0, top_p=1.0)
    first = np.asarray(model.generate(ids, mask, seed=1, **settings))
    again = np.asarray(model.generate(ids, mask, seed=1, **settings))
    other = np.asarray(model.generate(ids, mask, seed=2, **settings))
    greedy = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert not np.array_equal(first, greedy)


def test_sampling_with_top_k_1_is_greedy(loaded):
    model = loaded("qwen3")
    ids, mask = _batch(model)
    sampled = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1, seed=3))
    greedy = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False))
    np.testing.assert_array_equal(sampled, greedy)


# -- one engine: generate runs on the server's slot core where it can ------------------

ON_SLOTS = {
    "greedy_across_windows": dict(max_new_tokens=LONG, min_new_tokens=0),
    "sampling": dict(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.7, top_k=20, seed=4),
    "top_p_and_repetition_penalty": dict(
        max_new_tokens=NEW_TOKENS, do_sample=True, top_p=0.8, repetition_penalty=1.3, seed=2
    ),
    "min_p_and_samples_per_prompt": dict(
        max_new_tokens=NEW_TOKENS, do_sample=True, min_p=0.05, num_return_sequences=2, seed=6
    ),
    "single_token_bias": dict(max_new_tokens=NEW_TOKENS, sequence_bias={(5,): 4.0, (9,): -2.0}),
    # The processors that read the tokens so far, sampled, with EOS held back and forced at the end.
    "ngram_bans_and_sequence_biases": dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        seed=5,
        no_repeat_ngram_size=2,
        encoder_no_repeat_ngram_size=2,
        sequence_bias={(5, 9): -3.0, (7,): 1.0},
        min_new_tokens=4,
        forced_eos_token_id=2,
    ),
}


@pytest.mark.parametrize("name", ON_SLOTS)
def test_generate_on_the_slot_core_gives_the_generators_tokens(loaded, decodes, monkeypatch, name):
    # The slot core (hfjax serve's programs) runs these calls; `Generator`'s own programs run what it
    # cannot (docs/architecture.md). Both give one answer.
    from hfjax.generation import _on_slots

    model = loaded("llama")
    ids, mask = _batch(model)
    on_slots = np.asarray(model.generate(ids, mask, **ON_SLOTS[name]))
    assert decodes, "the call did not run on the slot core"
    monkeypatch.setattr(_on_slots.SlotRuns, "takes", lambda self, *args: False)
    np.testing.assert_array_equal(on_slots, np.asarray(model.generate(ids, mask, **ON_SLOTS[name])))


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text"])
def test_sliding_window_models_run_on_the_slot_core_like_transformers(loaded, decodes, family):
    # Mistral slides in every layer (one mask); Gemma 2 and 3 alternate sliding and full layers (a mask
    # per kind). The answers pass the 64-token window, so a key outside it would change them.
    model = loaded(family)
    window = model.module.config.sliding_window
    ids, mask = _batch(model)
    new = dict(max_new_tokens=LONG, min_new_tokens=LONG, do_sample=False)
    assert ids.shape[1] + LONG > window + 8
    actual = np.asarray(model.generate(ids, mask, **new))
    assert decodes, "the call did not run on the slot core"
    np.testing.assert_array_equal(actual, _torch_generate(model, ids, mask, **new))


# -- long answers: the decode loop attends over growing windows of the cache ---------


def test_long_beam_search_crosses_cache_windows_like_transformers(loaded, monkeypatch):
    from hfjax.generation import _slot_beams

    windows = set()
    search = _slot_beams.SlotBeams.search
    monkeypatch.setattr(
        _slot_beams.SlotBeams,
        "search",
        lambda self, *a, window, **k: windows.add(window) or search(self, *a, window=window, **k),
    )
    model = loaded("llama")
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=LONG, min_new_tokens=LONG, num_beams=3, repetition_penalty=2.0)
    expected = _torch_generate(model, ids, mask, **settings)
    np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, **settings)), expected)
    assert len(windows) > 1, "the search did not cross the slot cache's windows"


def test_a_streamed_long_answer_is_the_windowed_one(loaded):
    model = loaded("llama")
    ids, mask = _batch(model, PROMPTS[:1])
    recorder = _Recorder()
    settings = dict(max_new_tokens=LONG, min_new_tokens=LONG)
    streamed = np.asarray(model.generate(ids, mask, streamer=recorder, **settings))
    np.testing.assert_array_equal(streamed, np.asarray(model.generate(ids, mask, **settings)))


# -- programs: one prefill per bucket, one decode loop -------------------------------


def test_prompt_lengths_in_one_bucket_share_programs(loaded):
    model = loaded("phi3")
    counts = []
    for prompt in ["a", "a longer prompt", "an even longer prompt than that"]:
        ids, mask = _batch(model, [prompt])
        assert ids.shape[1] <= 16
        model.generate(ids, mask, max_new_tokens=7)
        counts.append(model.generation_programs.counts)
    assert counts[-1] == counts[0], "a new prompt length in the same bucket recompiled"
    ids, mask = _batch(model, ["a prompt well past sixteen tokens, so it lands in the next bucket up"])
    model.generate(ids, mask, max_new_tokens=7)
    assert model.generation_programs.counts == {"prefill": counts[0]["prefill"] + 1, "decode": counts[0]["decode"] + 1}


def test_budgets_in_one_buffer_length_share_programs(loaded):
    model = loaded("qwen2")
    ids, mask = _batch(model, PROMPTS[:1])
    lengths = []
    for budget in (5, 9, 12):
        lengths.append(np.asarray(model.generate(ids, mask, max_new_tokens=budget, min_new_tokens=budget)).shape[1])
        if budget == 5:
            counts = model.generation_programs.counts
    assert lengths == [ids.shape[1] + 5, ids.shape[1] + 9, ids.shape[1] + 12]
    assert model.generation_programs.counts == counts, "a new max_new_tokens recompiled"


def _shapes(model, ids, max_new_tokens: int) -> tuple:
    """(batch, prompt bucket, buffer length, settings): what the engine keys its programs by."""
    size = _buckets.bucket(ids.shape[1])
    total = _buckets.round_up(size + max_new_tokens, _planning.CACHE_MULTIPLE)
    settings = _settings.resolve_settings(model, ids.shape[1], max_new_tokens=max_new_tokens)
    return ids.shape[0], size, total, dataclasses.replace(settings, max_new_tokens=total - size, min_new_tokens=0)


def _decode_programs(model, prompts, max_new_tokens=4):
    """(the decode programs generate called for `prompts`, one per cache window it attends in turn:
    each as (its jitted function, its arguments' shapes), and those windows)."""
    ids, mask = _batch(model, prompts)
    generator = _engine.Generator(model)
    generator.programs._fingerprint = None  # trace here, rather than read the programs an earlier test stored
    with _compile.recording() as programs:
        generator.generate(
            ids, mask, _settings.resolve_settings(model, ids.shape[1], max_new_tokens=max_new_tokens), seed=0
        )
    _, size, total, _ = _shapes(model, ids, max_new_tokens=max_new_tokens)
    return [(p.jitted, p.args) for p in programs if p.stage == "decode"], _planning.windows(size, total)


def _runs_the_model(loop) -> bool:
    """Whether a while loop's body multiplies by the weights: XLA's product, or the backend's own kernels."""
    body = str(loop.params["body_jaxpr"])
    return "dot_general" in body or any(target in body for target in _backend.active().custom_calls())


def _loops(decode, args) -> list:
    return [eqn for eqn in decode.trace(*args).jaxpr.eqns if eqn.primitive.name == "while"]


def test_decode_is_one_while_loop(loaded):
    (decode,), _ = _decode_programs(loaded("llama"), PROMPTS[:1])
    (loop,) = _loops(*decode)  # the whole decode is one loop, not one program call per token
    assert _runs_the_model(loop)  # and the model runs inside it


def test_a_long_answer_decodes_in_one_loop_per_cache_window(loaded):
    model = loaded("llama")
    decodes, windows = _decode_programs(model, PROMPTS[:2], max_new_tokens=LONG)
    assert windows == (64, 128)
    # One program call per window, each one loop that runs the model and carries the cache layers
    # ([B, H_kv, W, D]) of its window, or the whole cache where attention reads it in place.
    loops = [loop for decode in decodes for loop in _loops(*decode)]
    slots = [{var.aval.shape[2] for var in loop.invars if var.aval.ndim == 4} for loop in loops]
    in_place = _slots.SlotModel(model, 2, 128).decodes_in_place(jax.numpy.float32)
    assert slots == ([{128}, {128}] if in_place else [{64}, {128}])
    assert all(_runs_the_model(loop) for loop in loops)


@pytest.mark.cpu_hook  # the layout the CPU's hook carries the cache in, and XLA:CPU's program text
@pytest.mark.parametrize(
    "prompts, new_tokens",
    [(PROMPTS[:1], 4), (PROMPTS[:2], 4), (PROMPTS[:2], LONG)],
    ids=["batch_1", "batch_2", "batch_2_windows"],
)
def test_decode_updates_the_cache_without_copying_it(loaded, prompts, new_tokens):
    model = loaded("llama")
    decodes, windows = _decode_programs(model, prompts, max_new_tokens=new_tokens)  # the state donated
    for decode, args in decodes:
        text = decode.lower(*args).compile().as_text()
        full = [leaf.shape for leaf in jax.tree_util.tree_leaves(args[1][0])]  # [B, H_kv, L, D] key and value layers
        assert full, "the state holds no cache layers"
        # windows: cache lengths attended in turn, each carried through a loop
        cache_sizes = {int(np.prod(shape[:2] + (slots,) + shape[3:])) for shape in full for slots in windows}
        copied = [
            int(np.prod([int(d) for d in dims.split(",") if d]))
            for dims in re.findall(r"= f32\[([\d,]*)\]\S* copy\(", _loop_bodies(text))
        ]
        assert not cache_sizes & set(copied), f"cache layers are copied every token: {sorted(copied)}"


def _loop_bodies(text: str) -> str:
    """The computations of an HLO module's text that `while` instructions run as their bodies (and
    those they call): what runs at every token."""
    computations = dict(re.findall(r"^(?:ENTRY )?%?(\S+) [^\n]*\{\n(.*?)^\}", text, flags=re.M | re.S))
    names = re.findall(r"\bwhile\([^\n]*body=%?([\w.\-]+)", text)
    seen, bodies = set(), []
    while names:
        name = names.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        bodies.append(computations[name])
        names += re.findall(
            r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", computations[name]
        )
    assert bodies, "no while loop in the decode program"
    return "\n".join(bodies)


# -- streaming ---------------------------------------------------------------------


class _Recorder:
    """A transformers-style streamer that records what it receives and when decoding had got to."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.puts.append(np.asarray(value))

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_token_in_chunks(loaded):
    model = loaded("llama")
    ids, mask = _batch(model, PROMPTS[:1])
    recorder = _Recorder()
    unstreamed = np.asarray(model.generate(ids, mask, max_new_tokens=20))
    decode_programs = model.generation_programs.counts["decode"]
    # streamed: the whole cache, one window, the program the unstreamed call ran (a 64-token cache)
    runs_before = []  # per put: the decode programs run before it
    with _compile.recording() as recorded:
        put = recorder.put
        recorder.put = lambda value: runs_before.append(sum(p.stage == "decode" for p in recorded)) or put(value)
        streamed = np.asarray(model.generate(ids, mask, max_new_tokens=20, streamer=recorder))
    runs = sum(p.stage == "decode" for p in recorded)
    calls = [sum(before <= run for before in runs_before) for run in range(runs)]  # per run: the puts before it
    assert recorder.ended
    np.testing.assert_array_equal(recorder.puts[0], ids)
    tokens = np.concatenate([p.reshape(-1) for p in recorder.puts[1:]])
    np.testing.assert_array_equal(tokens, streamed[0, ids.shape[1] :])
    np.testing.assert_array_equal(streamed, unstreamed)
    assert len(recorder.puts) == 1 + 20  # the prompt, then each token
    # 19 tokens after the prefill's first, in chunks; each chunk's tokens arrive before the next runs.
    assert calls == [2, 2 + _planning.STREAM_CHUNK, 2 + 2 * _planning.STREAM_CHUNK]
    assert model.generation_programs.counts["decode"] == decode_programs  # chunks reuse the one decode program


def test_text_streamer_prints_the_generated_text(loaded, capsys):
    model = loaded("llama")
    ids, mask = _batch(model, PROMPTS[:1])
    streamer = transformers.TextStreamer(model.tokenizer, skip_prompt=True)
    out = np.asarray(model.generate(ids, mask, max_new_tokens=10, streamer=streamer))
    printed = capsys.readouterr().out
    assert printed.strip() == model.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_generate_text(loaded):
    model = loaded("llama")
    ids, mask = _batch(model)
    out = np.asarray(model.generate(ids, mask, max_new_tokens=6))
    expected = model.tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    assert model.generate_text(PROMPTS, max_new_tokens=6) == expected
    assert model.generate_text(PROMPTS[0], max_new_tokens=6) == expected[0]


def test_generate_text_puts_conversations_through_the_chat_template(loaded, checkpoint):
    model = loaded("llama")
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}],
    ]
    expected = []
    for conversation in conversations:  # each alone, through transformers in PyTorch
        text = model.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = model.tokenizer(text, add_special_tokens=False, return_tensors="np")["input_ids"]
        out = _torch_generate(model, ids, np.ones_like(ids), max_new_tokens=6)
        expected.append(model.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert model.generate_text(conversations, max_new_tokens=6) == expected
    assert model.generate_text(conversations[1], max_new_tokens=6) == expected[1]
    with pytest.raises(ValueError, match="mix texts and conversations"):
        model.generate_text([PROMPTS[0], conversations[0]], max_new_tokens=6)
    plain = hfjax.load(checkpoint("llama"))
    plain.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        plain.generate_text(conversations[0], max_new_tokens=6)


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=300), r"max_new_tokens=300.*context of 256"),
        (dict(top_p=1.5, do_sample=True), r"top_p=1\.5"),
        (dict(top_p=0.0, do_sample=True), r"top_p=0\.0"),
        (dict(temperature=-0.5, do_sample=True), r"temperature=-0\.5"),
        (dict(temperature=-0.5), r"temperature=-0\.5"),
        (dict(max_new_tokens=0), r"max_new_tokens=0"),
        (dict(num_beams=4, do_sample=True), r"num_beams=4 asks for beam sampling"),
        (dict(do_sample=True, typical_p=0.5), r"typical_p=0\.5 asks for typical sampling"),
        (dict(output_hidden_states=True), r"output_hidden_states=True asks for returning hidden states"),
        (dict(num_beams=2, return_dict_in_generate=True, output_scores=True), r"output_scores=True with num_beams=2"),
        (dict(max_length=3), r"max_length=3 counts the prompt's \d+ tokens"),
        (dict(no_repeat_ngram_size=-1), r"no_repeat_ngram_size=-1 must be an integer >= 0"),
        (dict(bad_words_ids=[[5, -1]]), r"bad_words_ids=\[\[5, -1\]\]: \[5, -1\] is not a non-empty list of token ids"),
        (dict(bad_words_ids=[[100000]]), r"token id 100000 is outside the vocabulary of"),
        (dict(sequence_bias={(5,): "high"}), r"the bias 'high' is not a number"),
        (dict(suppress_tokens="5"), r"suppress_tokens='5' must be a token id or a list"),
        (dict(logits_processor=[]), r"does not take logits_processor"),
    ],
)
def test_bad_settings_raise_one_clear_error(loaded, kwargs, match):
    model = loaded("llama")
    ids, mask = _batch(model, PROMPTS[:1])
    with pytest.raises(ValueError, match=match):
        model.generate(ids, mask, **kwargs)


def test_settings_from_a_generation_config_are_named_as_such(loaded):
    model = loaded("llama")
    ids, mask = _batch(model, PROMPTS[:1])
    with pytest.raises(
        ValueError, match=r"num_beams=4 \(from generation_config\) asks for beam sampling.*pass num_beams=1"
    ):
        model.generate(ids, mask, generation_config=transformers.GenerationConfig(num_beams=4, do_sample=True))


def test_an_unknown_setting_is_a_type_error_that_lists_the_known_ones(loaded):
    model = loaded("llama")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_tokens'.*max_new_tokens"):
        model.generate(np.ones((1, 3), np.int32), max_tokens=4)


def test_empty_prompts_raise(loaded):
    model = loaded("llama")
    with pytest.raises(ValueError, match="input_ids is empty"):
        model.generate(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        model.generate(np.ones((2, 3), np.int32), np.array([[1, 1, 1], [0, 0, 0]]))


def test_an_op_without_lowering_is_named_with_its_module(checkpoint, monkeypatch):
    model = hfjax.load(checkpoint("llama"))  # its own programs: none traced yet
    monkeypatch.setattr(_compilation_cache, "directory", lambda: None)  # nor read from an earlier test's store
    operators = _env.env()._ops
    for op in (torch.ops.aten.rsqrt.default, torch.ops.aten.rsqrt):
        if op in operators:
            monkeypatch.delitem(operators, op)
    with pytest.raises(hfjax.UnsupportedOpError, match=r"aten::rsqrt.*input_layernorm \(LlamaRMSNorm\)"):
        model.generate(np.array([[1, 5, 6]]), max_new_tokens=3)


# -- model code that reads its data (hfjax._specialize) -------------------------

SWITCH = 24  # the position from which `_SwitchesAtAPosition` changes its logits


class _SwitchesAtAPosition(transformers.LlamaForCausalLM):
    """Reads a value of its data at every token, as fsmt's and m2m_100's position embeddings do
    (`if max_pos > table_size:`): from position SWITCH on, its logits are rolled by one."""

    def forward(self, *args, position_ids=None, **kwargs):
        out = super().forward(*args, position_ids=position_ids, **kwargs)
        if bool(position_ids.max() >= SWITCH):
            out.logits = out.logits.roll(1, dims=-1)
        return out


def _switching_model(checkpoint):
    module = _SwitchesAtAPosition.from_pretrained(checkpoint("llama")).eval()
    return module, hfjax.Model.from_module(module, transformers.AutoTokenizer.from_pretrained(checkpoint("llama")))


def _decode_specializations(model) -> list:
    return model.generation_programs.specializations("decode")


def test_a_step_that_reads_its_data_stays_compiled_across_a_change_of_value(checkpoint):
    module, model = _switching_model(checkpoint)
    ids, mask = _batch(model)
    assert mask.sum(axis=1).max() < SWITCH < mask.sum(axis=1).max() + NEW_TOKENS  # the value changes mid-answer
    with torch.no_grad():
        expected = module.generate(
            torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=NEW_TOKENS
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*op by op")
        actual = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS))
        np.testing.assert_array_equal(actual, expected.numpy())
        # The loop stopped before the first token past SWITCH and went on with a second program.
        assert [len(programs) for programs in _decode_specializations(model)] == [2]
        counts = model.generation_programs.counts
        np.testing.assert_array_equal(np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS)), actual)
        assert model.generation_programs.counts == counts  # the same values again: nothing traced


def test_a_streamed_answer_of_a_model_that_reads_its_data_is_the_unstreamed_one(checkpoint):
    # The streamer re-enters the decode loop every few tokens; the value changes inside one chunk.
    _, model = _switching_model(checkpoint)
    ids, mask = _batch(model)
    whole = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS))
    recorder = _Recorder()
    streamed = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS, streamer=recorder))
    np.testing.assert_array_equal(streamed, whole)
    assert recorder.ended
    np.testing.assert_array_equal(
        np.stack([p.reshape(-1) for p in recorder.puts[1:]], axis=1), whole[:, ids.shape[1] :]
    )


def test_a_step_whose_values_keep_changing_runs_op_by_op(checkpoint, monkeypatch):
    monkeypatch.setattr(_specialize, "MAX_SPECIALIZATIONS", 1)
    module, model = _switching_model(checkpoint)
    ids, mask = _batch(model)
    with torch.no_grad():
        expected = module.generate(
            torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=NEW_TOKENS
        )
    with pytest.warns(UserWarning, match=r"decode step reads values of its data.*test_generate.py:\d+.*op by op"):
        actual = np.asarray(model.generate(ids, mask, max_new_tokens=NEW_TOKENS))
    np.testing.assert_array_equal(actual, expected.numpy())


@pytest.mark.parametrize(
    "family",
    [
        "dbrx",  # its experts loop over the experts its tokens chose (nonzero, torch.where)
        "jetmoe",  # its router counts each expert's tokens (.tolist()), in its MoE and its attention
        "longcat_flash",  # as DBRX's, over its routed experts and its zero-compute ones (2 of 6)
        "xmod",  # its layers pick each row's language adapter by a boolean mask of the rows
    ],
)
def test_a_mixture_of_experts_that_asks_which_experts_were_chosen_runs_on_the_slot_core(checkpoint, decodes, family):
    # hfjax runs every expert and weighs each token's chosen ones (`bridge._data_free`), reading no
    # values, so the slot core runs it. The modules' own forwards are back after each trace. X-MOD runs
    # every language's adapter and keeps each row's: the second of three (the first and third give other
    # tokens here).
    overrides = {
        "xmod": {"task": "text-generation", "languages": ["en_XX", "de_DE", "fr_XX"], "default_language": "de_DE"}
    }
    path = checkpoint(family, **overrides.get(family, {}))
    model = hfjax.load(path)
    ids, mask = _batch(model)
    with torch.no_grad():
        logits = _torch_model(model)(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids, attention_mask=mask).logits), logits, atol=tolerances.DEFAULT.atol)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, **settings)), _torch_generate(model, ids, mask, **settings)
    )
    assert decodes, "the call did not run on the slot core"
    assert not any({"forward", "lang_adapter"} & set(vars(m)) for m in model.module.modules())


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_over_the_keys_an_indexer_picks_runs_on_the_slot_core(checkpoint, decodes, family):
    # DeepSeek V3.2's DSA (and GLM-5's): each layer's indexer keeps keys of its own, a third array per
    # layer of the slot cache, and picks the index_topk keys each query attends to: 3 here, fewer than
    # the prompts' tokens, so which keys it picks changes the tokens.
    model = hfjax.load(checkpoint(family, index_topk=3))
    ids, mask = _batch(model)
    settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    np.testing.assert_array_equal(
        np.asarray(model.generate(ids, mask, **settings)), _torch_generate(model, ids, mask, **settings)
    )
    assert decodes, "the call did not run on the slot core"


def test_an_encoder_decoder_that_reads_its_data_generates_like_transformers(checkpoint):
    # led's encoder asks `mask.any().item()` in the prefill (the slots answer it: `KNOWN_READS`); its
    # decoder counts positions from its cache's length.
    path = checkpoint("led", task="text2text-generation")
    reference = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(4, reference.config.vocab_size, (2, 8)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=reference.config.pad_token_id)
    with torch.no_grad():
        expected = reference.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), **settings)
    actual = np.asarray(hfjax.load(path).generate(ids, mask, **settings))
    np.testing.assert_array_equal(actual, expected.numpy())


def test_generate_on_a_classifier_says_what_to_load(checkpoint):
    model = hfjax.load(checkpoint("llama", task="text-classification"))
    with pytest.raises(ValueError, match="task='text-classification'"):
        model.generate(np.ones((1, 3), np.int32))


# -- compilation cache across processes ---------------------------------------------

_COLD_WARM = """
import json, pathlib, sys, numpy as np
from jax._src import monitoring
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
import hfjax
from hfjax import testing
path = pathlib.Path(sys.argv[1]) / "llama"
if not path.exists():  # the cold run writes the checkpoint, before anything compiles
    testing.save_tiny_checkpoint("llama", path)
model = hfjax.load(path)
tokens = np.asarray(model.generate(np.array([[1, 5, 6, 7], [2, 8, 6, 7]]), max_new_tokens=4)).tolist()  # stored programs call the CPU kernels
programs = model.generation_programs
print(json.dumps(dict(hits=len(hits), traced=programs.traced, loaded=programs.loaded, tokens=tokens)))
"""


# Two new processes, one after the other, with one compilation cache: cold, then warm (this
# process only starts them: it imports neither torch nor JAX).
_TWO_PROCESSES = f"""
import os, subprocess, sys
out = sys.argv[1]
env = {{**os.environ, "HFJAX_CACHE_DIR": os.path.join(out, "xla")}}
for run in ("cold", "warm"):
    done = subprocess.run([sys.executable, "-c", {_COLD_WARM!r}, out], env=env, capture_output=True, text=True)
    print(run.upper(), done.returncode, done.stdout.splitlines()[-1] if done.returncode == 0 else done.stderr[-2000:])
"""


def start_in_background() -> None:
    background.start("cold-warm", background.python(_TWO_PROCESSES), seconds=20)


def test_a_second_process_reuses_programs_without_tracing():
    job = background.finished("cold-warm", start_in_background)
    assert job.returncode == 0, job.output[-4000:]
    lines = {
        line.split(" ", 1)[0]: line.split(" ", 2)[1:]
        for line in job.output.splitlines()
        if line.startswith(("COLD", "WARM"))
    }
    for run in ("COLD", "WARM"):
        assert lines[run][0] == "0", job.output[-4000:]
    cold, warm = (json.loads(lines[run][1]) for run in ("COLD", "WARM"))
    assert (
        cold["hits"] == 0
        and cold["traced"] == {"prefill": 1, "decode": 1}
        and cold["loaded"] == {"prefill": 0, "decode": 0}
    )
    # The second process reads both programs from disk (no tracing) and XLA's compiled code from JAX's cache.
    assert warm["traced"] == {"prefill": 0, "decode": 0} and warm["loaded"] == {"prefill": 1, "decode": 1}
    assert warm["hits"] >= 2
    assert warm["tokens"] == cold["tokens"]


def _private_store(checkpoint, directory, monkeypatch):
    """A new llama model that keeps its programs in `directory` alone: the session's store is shared
    with other processes, which may write the same programs at any moment."""
    monkeypatch.setattr(_compilation_cache, "directory", lambda: directory)
    return hfjax.load(checkpoint("llama"))


def test_a_stored_prefill_without_its_decode_loop_still_generates(checkpoint, tmp_path, monkeypatch):
    # The slot core's decode program is traced on its own (`Generator`'s own decode loop needs the
    # state's structure, which only tracing the prefill gives).
    model = _private_store(checkpoint, tmp_path, monkeypatch)
    ids, mask = _batch(model, PROMPTS[:1])
    expected = np.asarray(model.generate(ids, mask, max_new_tokens=6))
    decodes = model.generation_programs.keys("decode")
    assert decodes and all(model.generation_programs.path(key).is_file() for key in decodes)
    for key in decodes:  # as if only the prefill had been written by an earlier process
        model.generation_programs.path(key).unlink()
    fresh = hfjax.load(checkpoint("llama"))  # a new process's model: nothing in memory
    np.testing.assert_array_equal(np.asarray(fresh.generate(ids, mask, max_new_tokens=6)), expected)
    programs = fresh.generation_programs
    assert programs.loaded["prefill"] == 1 and programs.traced == {"prefill": 0, "decode": 1}


def test_an_unreadable_stored_program_is_traced_again(checkpoint, tmp_path, monkeypatch):
    model = _private_store(checkpoint, tmp_path, monkeypatch)
    ids, mask = _batch(model, PROMPTS[:1])
    expected = np.asarray(model.generate(ids, mask, max_new_tokens=6))
    for key in model.generation_programs.keys():
        model.generation_programs.path(key).write_bytes(b"\x05\x00")  # truncated by a writer that was killed
    fresh = hfjax.load(checkpoint("llama"))  # a new process's model: nothing in memory
    np.testing.assert_array_equal(np.asarray(fresh.generate(ids, mask, max_new_tokens=6)), expected)
    programs = fresh.generation_programs
    assert programs.loaded == {"prefill": 0, "decode": 0} and programs.traced == {"prefill": 1, "decode": 1}
