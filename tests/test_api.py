"""The public API's promises: one error hierarchy whose messages name only public API, the same
mistake giving the same error everywhere, every form of `dtype`, a model already in memory
getting the whole Model API, and one version."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import hfjax
from hfjax import tolerances

ROOT = pathlib.Path(hfjax.__file__).parent
PROMPTS = ["Hello there, how are you?", "Hi"]


def test_the_version_is_single_sourced():
    assert hfjax.__version__ == importlib.metadata.version("hfjax")


def test_every_error_is_an_hfjax_error_and_the_builtin_a_caller_expects():
    for error, builtin in ((hfjax.LoadError, ValueError), (hfjax.ShardingError, ValueError),
                           (hfjax.GenerationError, ValueError), (hfjax.PipelineError, ValueError),
                           (hfjax.UnsupportedOpError, NotImplementedError)):  # fmt: skip
        assert issubclass(error, hfjax.HfjaxError) and issubclass(error, builtin)


def _raised_texts(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for part in ast.walk(node.exc):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    yield node.lineno, part.value


def test_error_messages_name_only_public_api():
    private = []
    for path in ROOT.rglob("*.py"):
        for line, text in _raised_texts(ast.parse(path.read_text())):
            if "hfjax._" in text or "._sharding" in text or "hfjax.check_" in text:
                private.append(f"{path.relative_to(ROOT)}:{line}: {text[:80]}")
    assert private == [], private


def test_a_mesh_that_is_not_a_mesh_is_the_same_error_everywhere(checkpoint, tmp_path):
    path = checkpoint("llama")
    calls = {
        "hfjax.load": lambda: hfjax.load(path, mesh="data=2"),
        "hfjax.Model.from_module": lambda: hfjax.Model.from_module(
            transformers.AutoModelForCausalLM.from_pretrained(path), mesh=(2, 4)
        ),
        "hfjax.load_pipeline": lambda: hfjax.load_pipeline(tmp_path, mesh=[1, 8]),
    }
    for caller, call in calls.items():
        with pytest.raises(
            hfjax.ShardingError, match=rf"{caller}: mesh=.* not a jax.sharding.Mesh; build one with hfjax.make_mesh"
        ):
            call()


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16, jnp.bfloat16, np.dtype(jnp.bfloat16)], ids=str)
def test_dtype_takes_names_torch_and_jax_dtypes(checkpoint, dtype):
    model = hfjax.load(checkpoint("llama"), dtype=dtype)
    assert {str(a.dtype) for name, a in model.params.items() if "inv_freq" not in name} == {"bfloat16"}


def test_dtype_auto_is_the_checkpoints(checkpoint):
    path = checkpoint("llama", dtype="bfloat16")
    assert {str(a.dtype) for a in hfjax.load(path, dtype="auto").params.values()} >= {"bfloat16"}
    assert hfjax.load(path, dtype="auto").params.keys() == hfjax.load(path).params.keys()


def test_a_dtype_that_is_not_one_names_the_allowed_ones(checkpoint):
    for bad in ("float8", torch.int8, jnp.int32):
        with pytest.raises(
            hfjax.LoadError,
            match=r"hfjax.load: dtype=.* is not supported; use one of \('float32', 'bfloat16', 'float16'\)",
        ):
            hfjax.load(checkpoint("llama"), dtype=bad)


@pytest.fixture(scope="module")
def in_memory(checkpoint):
    """(a transformers causal LM loaded by transformers, its tokenizer, the hfjax Model made from it)."""
    path = checkpoint("llama")
    module = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return module, tokenizer, hfjax.Model.from_module(module, tokenizer)


def test_a_model_in_memory_generates_what_transformers_generates(in_memory):
    module, tokenizer, model = in_memory
    assert model.task == "text-generation" and model.path is None
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = module.generate(**batch, max_new_tokens=8, do_sample=False).numpy()
    got = np.asarray(
        model.generate(batch["input_ids"].numpy(), batch["attention_mask"].numpy(), max_new_tokens=8, do_sample=False)
    )
    np.testing.assert_array_equal(got, want)
    assert model.generate_text(PROMPTS[0], max_new_tokens=4) == tokenizer.decode(
        want[0, batch["input_ids"].shape[1] :][:4], skip_special_tokens=True
    )


def test_a_model_in_memory_keeps_its_own_weights_and_gives_its_logits(in_memory):
    module, _, model = in_memory
    ids = np.array([[5, 6, 7, 8]])
    with torch.no_grad():
        want = module(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids).logits), want, atol=tolerances.DEFAULT.atol, rtol=0)
    assert all(p.device.type == "cpu" for p in module.parameters())  # the module given is left as it was


def test_load_of_a_module_is_from_module(in_memory):
    module, _, _ = in_memory
    model = hfjax.load(module, dtype="float32")
    assert isinstance(model, hfjax.Model) and model.tokenizer is None
    with pytest.raises(
        hfjax.LoadError, match=r"generate_text: the LlamaForCausalLM given has no tokenizer.*from_module"
    ):
        model.generate_text("Hi", max_new_tokens=2)


def test_a_classifier_and_an_encoder_in_memory_classify_and_embed(checkpoint):
    path = checkpoint("bert", task="text-classification")
    module = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = hfjax.Model.from_module(module, tokenizer)
    assert model.task == "text-classification"
    with torch.no_grad():
        want = torch.softmax(module(**tokenizer(["I loved it"], return_tensors="pt")).logits, -1)[0].numpy()
    np.testing.assert_allclose(list(model.classify(["I loved it"])[0].values()), want, atol=tolerances.DEFAULT.atol)
    encoder = hfjax.Model.from_module(transformers.AutoModel.from_pretrained(checkpoint("bert")).eval(), tokenizer)
    assert encoder.task == "feature-extraction"
    assert encoder.embed(["a cat", "a dog"]).shape == (2, module.config.hidden_size)


def _first_input(family: str, config, rng: np.random.Generator) -> np.ndarray:
    if family == "bert":
        return rng.integers(4, config.vocab_size, (2, 5))  # input_ids [B, L]
    if family == "vit":
        size = config.image_size
        return rng.standard_normal((2, config.num_channels, size, size)).astype(np.float32)  # pixel_values
    return (rng.standard_normal((2, 1600)) * 0.1).astype(np.float32)  # input_values [B, samples]: 0.1 s at 16 kHz


# (family, task, transformers' class, the name of the forward's first input): text, image and speech.
FIRST_INPUTS = [
    ("bert", "text-classification", "AutoModelForSequenceClassification", "input_ids"),
    ("vit", "image-classification", "AutoModelForImageClassification", "pixel_values"),
    ("hubert", "automatic-speech-recognition", "AutoModelForCTC", "input_values"),
]


@pytest.mark.parametrize("family, task, auto_class, first", FIRST_INPUTS, ids=[c[0] for c in FIRST_INPUTS])
def test_a_model_takes_its_inputs_as_the_forward_does(checkpoint, family, task, auto_class, first):
    """`model(x)` passes x as the forward's first input, keyword arguments by the forward's names;
    compiled and eager, each equal to the module run by PyTorch."""
    path = checkpoint(family, task=task)
    module = getattr(transformers, auto_class).from_pretrained(path).eval()
    assert next(iter(inspect.signature(module.forward).parameters)) == first
    inputs = _first_input(family, module.config, np.random.default_rng(0))
    with torch.no_grad():
        want = module(torch.from_numpy(inputs)).logits.numpy()
    model = hfjax.load(path)
    for got in (model(inputs), model.eager(inputs), model(**{first: inputs})):
        np.testing.assert_allclose(np.asarray(got.logits), want, atol=tolerances.DEFAULT.atol, rtol=0)
    if family != "vit":  # a positional second input: the attention mask (a ViT's is its head_mask)
        mask = np.ones(inputs.shape[:2], np.int32)
        mask[1, -inputs.shape[1] // 4 :] = 0
        with torch.no_grad():
            want = module(torch.from_numpy(inputs), torch.from_numpy(mask)).logits.numpy()
        np.testing.assert_allclose(np.asarray(model(inputs, mask).logits), want, atol=tolerances.DEFAULT.atol, rtol=0)


def test_from_module_refuses_what_is_not_a_transformers_model():
    with pytest.raises(hfjax.LoadError, match=r"from_module: module is a Linear; pass a transformers model"):
        hfjax.Model.from_module(torch.nn.Linear(2, 2))


def test_distributed_initialize_names_a_missing_process_count(monkeypatch):
    monkeypatch.setenv("HFJAX_COORDINATOR", "127.0.0.1:1")
    monkeypatch.delenv("HFJAX_NUM_PROCESSES", raising=False)
    with pytest.raises(
        hfjax.ShardingError, match=r"num_processes is needed too; pass num_processes= or set \$HFJAX_NUM_PROCESSES"
    ):
        hfjax.distributed.initialize()
    assert not hfjax.distributed.is_initialized()
    assert jax.process_count() == 1
