"""Vision-language models (image-text-to-text): greedy tokens against transformers' generate in
PyTorch, `chat_with_images`, and `hfjax generate / chat --image`."""

from __future__ import annotations

import inspect
import io
import sys

import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import torch
import transformers

import hfjax
from hfjax import cli, testing, tolerances
from hfjax.generation import chat_with_images

QUESTIONS = ("Describe this", "What is the capital of France? Tell me")
NEW_TOKENS = 8


def _images():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, shape, dtype=np.uint8) for shape in ((40, 48, 3), (64, 32, 3))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    made = {}

    def make(family: str):
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            made[family] = testing.save_tiny_checkpoint(family, path, task="image-text-to-text")
        return made[family]

    return make


def _conversation(question: str, image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def _processor_outputs(path, family: str, images) -> dict:
    """Two left-padded prompts with one image each, as the family's processor makes them."""
    try:
        return _processed(path, family, images)
    except (ImportError, ValueError) as error:  # transformers 5.17: some image processors need torchvision
        if "torchvision" not in str(error).lower():
            raise
        pytest.skip(f"transformers {transformers.__version__} builds {family}'s image processor only with torchvision")


def _processed(path, family: str, images) -> dict:
    conversations = [_conversation(q, None) for q in QUESTIONS]
    if family != "qwen2_vl" or transformers.utils.is_torchvision_available():
        processor = transformers.AutoProcessor.from_pretrained(path)
        texts = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        processor.tokenizer.padding_side = "left"
        pil = [[PIL.Image.fromarray(image)] for image in images]
        encoded = dict(processor(text=texts, images=pil, padding=True, return_tensors="pt"))
        encoded.pop("labels", None)
        return encoded
    # Qwen2VLProcessor needs torchvision (for videos): its image steps, written out.
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    pixels = dict(transformers.AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt"))
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    merged = [int(grid.prod()) // 4 for grid in pixels["image_grid_thw"]]  # spatial_merge_size 2
    texts = [text.replace("<|image_pad|>", "<|image_pad|>" * n) for text, n in zip(texts, merged)]
    tokenizer.padding_side = "left"
    encoded = dict(tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False))
    encoded["mm_token_type_ids"] = (encoded["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
    return {**encoded, **pixels}


@pytest.mark.parametrize("family", testing.VISION_LANGUAGE_FAMILIES)
def test_batched_greedy_tokens_match_transformers_generate(saved, family, monkeypatch):
    from hfjax import generation

    decodes = []  # the call runs on the slot core (hfjax serve's programs)
    decode = generation.SlotPrograms.decode
    monkeypatch.setattr(
        generation.SlotPrograms, "decode", lambda self, *a, **k: decodes.append(1) or decode(self, *a, **k)
    )
    path = saved(family)
    inputs = _processor_outputs(path, family, _images())
    assert bool((inputs["attention_mask"] == 0).any())  # the two prompts differ in length: left padding
    reference = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    settings = dict(max_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = reference.generate(**inputs, do_sample=False, **settings)
    model = hfjax.load(path)
    assert model.task == "image-text-to-text"
    out = model.generate(**{name: value.numpy() for name, value in inputs.items()}, **settings)
    np.testing.assert_array_equal(np.asarray(out.sequences), expected.sequences.numpy())
    assert decodes, "the call did not run on the slot core"
    # Each step's logits: a decode position off by a multimodal rope's delta changes them, not the tokens.
    tolerance = tolerances.for_family(family)
    for step, (ours, theirs) in enumerate(zip(out.logits, expected.logits)):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=tolerance.atol, err_msg=f"step {step}")


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_beam_search_and_prompt_lookup_with_images_run_on_the_slot_core_like_transformers(saved, family, monkeypatch):
    # Beams and drafts decode at each row's multimodal rope position (Qwen2-VL's delta); each prompt's
    # beams take its images. transformers' own prompt lookup takes one prompt and drafts image
    # placeholders it cannot verify, so the drafted call is held to its greedy tokens, which
    # speculation at temperature 0 does not change.
    from hfjax import generation
    from hfjax.generation import _slot_beams

    calls = []  # the slot core's decode and beam search programs
    for owner, name in ((generation.SlotPrograms, "decode"), (_slot_beams.SlotBeams, "search")):
        run = getattr(owner, name)
        monkeypatch.setattr(
            owner, name, lambda self, *a, _run=run, _name=name, **k: calls.append(_name) or _run(self, *a, **k)
        )
    path = saved(family)
    inputs = _processor_outputs(path, family, _images())
    reference = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    model = hfjax.load(path)
    given = {name: value.numpy() for name, value in inputs.items()}
    for settings, program in ((dict(num_beams=2), "search"), (dict(prompt_lookup_num_tokens=3), "decode")):
        with torch.no_grad():
            expected = reference.generate(
                **inputs, do_sample=False, max_new_tokens=NEW_TOKENS, num_beams=settings.get("num_beams", 1)
            ).numpy()
        calls.clear()
        actual = np.asarray(model.generate(**given, do_sample=False, max_new_tokens=NEW_TOKENS, **settings))
        np.testing.assert_array_equal(actual, expected, err_msg=str(settings))
        assert program in calls, f"{settings} did not run on the slot core"


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_right_padded_prompts_with_images_run_on_the_slot_core_as_left_padded_ones(saved, family, monkeypatch):
    # Each row's tokens and their per-token inputs (token types, multimodal rope positions) move to
    # the right end; the answer follows the caller's right-padded prompts (see test_generate's text case).
    from hfjax import generation

    decodes = []
    decode = generation.SlotPrograms.decode
    monkeypatch.setattr(
        generation.SlotPrograms, "decode", lambda self, *a, **k: decodes.append(1) or decode(self, *a, **k)
    )
    path = saved(family)
    left = _processor_outputs(path, family, _images())
    mask = left["attention_mask"].numpy()
    # The same prompts right-padded: each row's columns rolled so that its pads come last.
    shifts = mask.shape[1] - mask.sum(axis=1)
    right = {
        name: np.stack([np.roll(row, -shift) for row, shift in zip(value.numpy(), shifts)])
        if value.shape == mask.shape
        else value.numpy()
        for name, value in left.items()
    }
    assert (right["attention_mask"][:, -1] == 0).any()
    reference = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    settings = dict(do_sample=False, max_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = reference.generate(**left, **settings)
    model = hfjax.load(path)
    with pytest.warns(UserWarning, match="right-padding was detected"):
        out = model.generate(**right, **settings)
    assert decodes, "the call did not run on the slot core"
    actual, width = np.asarray(out.sequences), mask.shape[1]
    np.testing.assert_array_equal(actual[:, :width], right["input_ids"])
    np.testing.assert_array_equal(actual[:, width:], expected.sequences.numpy()[:, width:])
    # A token at another rope position changes the logits, if not the tiny model's tokens.
    tolerance = tolerances.for_family(family)
    for step, (ours, theirs) in enumerate(zip(out.logits, expected.logits)):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=tolerance.atol, err_msg=f"step {step}")


def _tiny_gemma4(path, layer_types):
    """A tiny Gemma 4 whose sliding layers let each image's tokens see each other both ways
    (use_bidirectional_attention="vision"), saved by save_pretrained; and its image processor.
    (Gemma4Processor needs torchvision for its video processor: the prompts are laid out here.)"""
    from transformers.models.gemma4 import configuration_gemma4 as configs
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    text = configs.Gemma4TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
        layer_types=list(layer_types), use_bidirectional_attention="vision", vocab_size_per_layer_input=300,
        hidden_size_per_layer_input=8, pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.2,
    )  # fmt: skip
    vision = configs.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        head_dim=8, patch_size=2, pooling_kernel_size=3, position_embedding_size=128,
    )  # fmt: skip
    special = dict(image_token_id=290, boi_token_id=291, eoi_token_id=292, video_token_id=293, boa_token_id=294)
    config = configs.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, eoa_token_index=295, audio_token_id=296, **special
    )
    torch.manual_seed(0)
    transformers.Gemma4ForConditionalGeneration(config).eval().save_pretrained(path)
    return Gemma4ImageProcessorPil(patch_size=2, max_soft_tokens=70, pooling_kernel_size=3), special


def test_gemma4_images_see_each_other_in_sliding_layers_only_on_the_slot_core(tmp_path, monkeypatch):
    # Gemma 4 (use_bidirectional_attention="vision") ORs each image's block into its sliding layers'
    # causal mask and not into its full ones. Layers sliding, full, sliding: the first one's blocks
    # reach the logits (a causal-only mask was 2.2 off) and the middle one's would too (blocks in every
    # layer were 0.74 off). Its image encoder splits its features with .tolist(): it runs op by op
    # before the prefill, and the prefill's size check of the placeholders is known from the features.
    from hfjax import generation

    decodes = []
    decode = generation.SlotPrograms.decode
    monkeypatch.setattr(
        generation.SlotPrograms, "decode", lambda self, *a, **k: decodes.append(1) or decode(self, *a, **k)
    )
    processor, special = _tiny_gemma4(tmp_path, ("sliding_attention", "full_attention", "sliding_attention"))
    pixels = processor(images=[PIL.Image.fromarray(image) for image in _images()], return_tensors="pt")
    image, begin, end = special["image_token_id"], special["boi_token_id"], special["eoi_token_id"]
    tokens = [int(n) for n in pixels["num_soft_tokens_per_image"]]
    rows = [[2, 10, 11, begin, *[image] * tokens[0], end, 12, 13, 14], [2, 20, begin, *[image] * tokens[1], end, 21]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows]),
        "pixel_values": pixels["pixel_values"],
        "image_position_ids": pixels["image_position_ids"],
        "mm_token_type_ids": (ids == image).long(),
    }
    reference = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path).eval()
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = reference.generate(**inputs, **settings)
    model = hfjax.load(tmp_path)
    out = model.generate(**{name: value.numpy() for name, value in inputs.items()}, **settings)
    np.testing.assert_array_equal(np.asarray(out.sequences), expected.sequences.numpy())
    for step, (ours, theirs) in enumerate(zip(out.logits, expected.logits)):
        np.testing.assert_allclose(
            np.asarray(ours), theirs.numpy(), atol=tolerances.DEFAULT.atol, err_msg=f"step {step}"
        )
    # transformers before 5.24 takes no encoder output in Gemma 4's forward: the prefill traces the
    # encoder, reads its data, and `Generator` guards the call, as before.
    if "mm_encoder_outputs" in inspect.signature(reference.forward).parameters:
        assert decodes, "the call with images did not run on the slot core"
        # The placeholders are checked against the features on the host (the trace is told their size).
        short = {name: value.numpy().copy() for name, value in inputs.items()}
        short["input_ids"][0, short["input_ids"][0].tolist().index(image)] = 10
        with pytest.raises(
            hfjax.GenerationError, match=f"{sum(tokens)} image tokens.*{sum(tokens) - 1} image placeholders"
        ):
            model.generate(**short, max_new_tokens=2)
    # Either way a data read with images leaves text-only calls on the slot core.
    decodes.clear()
    text = {"input_ids": ids[:, :3].numpy(), "attention_mask": np.ones((2, 3), np.int64)}
    with torch.no_grad():
        expected = reference.generate(
            **{k: torch.as_tensor(v) for k, v in text.items()}, max_new_tokens=4, do_sample=False
        )
    np.testing.assert_array_equal(np.asarray(model.generate(**text, max_new_tokens=4)), expected.numpy())
    assert decodes, "a text-only call after the images did not run on the slot core"


@pytest.fixture(scope="module")
def llava(saved):
    path = saved("llava")
    return path, hfjax.load(path)


def _reference_reply(path, image, question: str) -> str:
    processor = transformers.AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(_conversation(question, None), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[PIL.Image.fromarray(image)]], return_tensors="pt")
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_chat_with_images_and_the_cli_give_pytorchs_reply(llava, tmp_path, capsys, monkeypatch):
    path, model = llava
    image = _images()[0]
    picture = tmp_path / "pic.png"
    PIL.Image.fromarray(image).save(picture)
    expected = _reference_reply(path, image, QUESTIONS[0])
    assert expected.strip()
    for given in (image, PIL.Image.fromarray(image), str(picture), f"file://{picture}"):
        reply = chat_with_images(model, _conversation(QUESTIONS[0], given), max_new_tokens=NEW_TOKENS)
        assert reply == expected, type(given)

    flags = ["--model", str(path), "--image", str(picture), "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0"]
    assert cli.main(["generate", *flags, QUESTIONS[0]]) == 0
    assert capsys.readouterr().out == expected + "\n"

    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTIONS[0]}\n"))
    assert cli.main(["chat", *flags]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_the_image_text_to_text_pipeline_equals_transformers(llava, tmp_path):
    """hfjax.pipeline("image-text-to-text") against transformers.pipeline on the same checkpoint: the
    same conversations out, an image given as a PIL image and as a path, two chats in one call."""
    path, model = llava
    picture = tmp_path / "pic.png"
    PIL.Image.fromarray(_images()[1]).save(picture)
    chats = [_conversation(QUESTIONS[0], PIL.Image.fromarray(_images()[0])), _conversation(QUESTIONS[1], str(picture))]
    settings = {"generate_kwargs": {"max_new_tokens": NEW_TOKENS, "do_sample": False}}
    reference = transformers.pipeline("image-text-to-text", model=str(path), device="cpu")
    ours = hfjax.pipeline("image-text-to-text", model=model)
    assert ours(text=chats, **settings) == reference(text=chats, **settings)


def test_bad_images_and_text_only_models_are_one_line_errors(llava, checkpoint, tmp_path, capsys):
    path, model = llava
    broken = tmp_path / "broken.png"
    broken.write_text("not an image")
    for image, message in ((broken, "is not an image"), (tmp_path / "absent.png", "does not exist")):
        assert cli.main(["generate", "--model", str(path), "--image", str(image), "Describe this"]) == 1
        err = capsys.readouterr().err
        assert message in err and str(image) in err and len(err.strip().splitlines()) == 1
    text_only = checkpoint("llama")
    assert cli.main(["generate", "--model", str(text_only), "--image", str(broken), "Describe this"]) == 1
    assert "takes no images" in capsys.readouterr().err
    with pytest.raises(hfjax.GenerationError, match="pixel_values.*takes no images"):
        hfjax.load(text_only).generate(np.ones((1, 3), np.int32), pixel_values=np.zeros((1, 3, 32, 32), np.float32))
    with pytest.raises(hfjax.GenerationError, match="uint8"):
        chat_with_images(model, _conversation("Hi", np.zeros((4, 4, 3), np.float32)))


def test_torch_vmap_casts_python_numbers_in_hfjaxs_environment():
    # transformers builds Gemma 3's image-block masks with torch.vmap, which casts Python numbers
    # with .to(dtype): hfjax's environment takes them (torchax's alone raises AttributeError).
    from hfjax.bridge import _env

    def window(q, kv):
        return (kv > q - 3) & (kv <= q)

    q, kv = torch.arange(6)[:, None], torch.arange(6)[None, :]
    expected = torch.vmap(torch.vmap(window, in_dims=(None, 0)), in_dims=(0, None))(q[:, 0], kv[0])
    with _env.env():
        got = torch.vmap(torch.vmap(window, in_dims=(None, 0)), in_dims=(0, None))(
            _env.to_torch(jnp.arange(6)), _env.to_torch(jnp.arange(6))
        )
    np.testing.assert_array_equal(np.asarray(_env.to_jax(got)), expected.numpy())
