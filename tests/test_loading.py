"""hfjax.load: checkpoints on disk into jax.Arrays, through the same path a hub model takes."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import hfjax
from hfjax import tolerances

ATOL = tolerances.DEFAULT.atol


def _torch_logits(path, ids, auto=transformers.AutoModelForCausalLM):
    model = auto.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def test_load_returns_model_with_params_module_config_tokenizer(checkpoint):
    path = checkpoint("llama")
    model = hfjax.load(path)
    assert model.task == "text-generation"
    assert model.config.model_type == "llama"
    assert all(p.device.type == "meta" for p in model.module.parameters()), "torch must not hold the weights"
    assert set(model.params) >= {n for n, _ in model.module.named_parameters()}
    assert model.tokenizer is not None
    ids = model.tokenizer(["hello world"], return_tensors="np")["input_ids"]
    out = model(ids)
    np.testing.assert_allclose(np.asarray(out.logits), _torch_logits(path, ids), atol=ATOL)


def test_sharded_checkpoint_with_index_loads_the_same(checkpoint):
    single = hfjax.load(checkpoint("qwen2"))
    sharded_path = checkpoint("qwen2", max_shard_size="20KB")
    assert (sharded_path / "model.safetensors.index.json").is_file()
    sharded = hfjax.load(sharded_path)
    assert set(single.params) == set(sharded.params)
    for name, value in single.params.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(sharded.params[name]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype(checkpoint, dtype):
    model = hfjax.load(checkpoint("llama"), dtype=dtype)
    floats = [a for a in model.params.values() if jnp.issubdtype(a.dtype, jnp.floating)]
    assert {str(a.dtype) for n, a in model.params.items() if n.endswith(".weight")} == {dtype}
    out = model(np.array([[4, 5, 6]]))
    assert str(out.logits.dtype) == dtype and floats


def test_moe_checkpoint_needs_key_conversion(checkpoint):
    from safetensors import safe_open

    path = checkpoint("mixtral")
    with safe_open(path / "model.safetensors", framework="np") as f:
        assert any(".experts.0." in key for key in f.keys()), "save_pretrained writes per-expert weights"
    model = hfjax.load(path)
    assert any(name.endswith("experts.gate_up_proj") for name in model.params), "fused as transformers 5 expects"
    ids = np.array([[4, 5, 6, 7]])
    np.testing.assert_allclose(np.asarray(model(ids).logits), _torch_logits(path, ids), atol=ATOL)


@pytest.mark.parametrize("task", ["text-classification", "feature-extraction"])
def test_tasks(checkpoint, task):
    path = checkpoint("bert", task=task)
    model = hfjax.load(path)
    assert model.task == task
    ids = np.array([[2, 7, 8, 9, 3]])
    reference = (
        transformers.AutoModelForSequenceClassification if task == "text-classification" else transformers.AutoModel
    )
    torch_model = reference.from_pretrained(path).eval()
    with torch.no_grad():
        want = torch_model(torch.from_numpy(ids))[0].numpy()
    np.testing.assert_allclose(np.asarray(model(ids)[0]), want, atol=ATOL)


def _torch_embed(path, texts, pooling):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = hidden[:, 0] if pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embed_follows_sentence_transformers_config(checkpoint, pooling):
    path = checkpoint("bert", task="feature-extraction", sentence_transformers=True, pooling=pooling)
    texts = ["a cat sat on the mat", "dogs", "the quick brown fox jumps over the lazy dog"]
    got = np.asarray(hfjax.load(path).embed(texts))
    assert got.shape == (3, hfjax.load(path).config.hidden_size)
    np.testing.assert_allclose(got, _torch_embed(path, texts, pooling), atol=ATOL)


def test_embed_defaults_to_mean_and_l2(checkpoint):
    path = checkpoint("bert", task="feature-extraction")
    texts = ["one sentence", "and another, longer sentence here"]
    got = np.asarray(hfjax.load(path).embed(texts))
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=tolerances.UNIT_NORM.atol)
    np.testing.assert_allclose(got, _torch_embed(path, texts, "mean"), atol=ATOL)


def test_errors_are_one_clear_line(tmp_path, checkpoint):
    with pytest.raises(hfjax.LoadError, match=r"no checkpoint directory at '/no/such/dir'"):
        hfjax.load("/no/such/dir")
    with pytest.raises(hfjax.LoadError, match=r"Hub could not be reached.*pass a local path"):
        hfjax.load("some-org/some-model")
    with pytest.raises(hfjax.LoadError, match=r"dtype='float8'.*float32"):
        hfjax.load(checkpoint("llama"), dtype="float8")
    with pytest.raises(hfjax.LoadError, match=r"task='translation'"):
        hfjax.load(checkpoint("llama"), task="translation")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "not-a-model", "architectures": ["NotAModel"]}))
    with pytest.raises(hfjax.LoadError, match=r"model_type 'not-a-model'"):
        hfjax.load(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(hfjax.LoadError, match=r"no config.json"):
        hfjax.load(empty)


def test_tensors_transformers_does_not_save_are_set_as_from_pretrained_sets_them(checkpoint):
    # MarianMTModel leaves its sinusoidal position tables out of its checkpoints
    # (`_keys_to_ignore_on_save`) and from_pretrained computes them again; so does hfjax.load.
    path = checkpoint("marian", task="text2text-generation")
    with safe_open(pathlib.Path(path) / "model.safetensors", framework="np") as saved:
        assert not any("embed_positions" in key for key in saved.keys())
    report = hfjax.check(path, batch=2, seq_len=8, repeats=1, eager=False)
    assert report.passed, report.table()


def _assert_params_equal(model, tensors: dict[str, torch.Tensor]) -> None:
    # hfjax's loaded arrays are the reference's tensors of the same names, exactly
    assert tensors
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(np.asarray(model.params[name]), tensor.numpy(), err_msg=name)


def test_a_complex_buffer_is_computed_as_from_pretrained_computes_it(checkpoint):
    # llama4's vision rotary table is a complex64 buffer that its own code sets (not in the checkpoint)
    path = checkpoint("llama4", task="image-feature-extraction")
    model = hfjax.load(path)
    reference = transformers.AutoModel.from_pretrained(path).eval()
    _assert_params_equal(model, {name: buffer for name, buffer in reference.named_buffers() if buffer.is_complex()})


def test_per_expert_weights_stack_in_the_experts_order(checkpoint):
    # ernie4_5_moe saves experts.0 ... experts.63 apart; transformers fuses them in numeric order
    # (experts.2 before experts.10), not in the file's string order.
    path = checkpoint("ernie4_5_moe")
    with safe_open(next(pathlib.Path(path).glob("*.safetensors")), "np") as f:
        assert "model.layers.1.mlp.experts.10.up_proj.weight" in f.keys()
    model = hfjax.load(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    _assert_params_equal(
        model, {name: tensor for name, tensor in reference.state_dict().items() if ".experts." in name}
    )


def test_a_key_the_module_has_is_not_renamed_away(checkpoint):
    # deepseek_v4's conversion mapping renames `\.norm\.` to `.kv_norm.` (its attention's norm), which
    # also matches the final `model.norm.weight`; transformers keeps a key the module already has.
    path = checkpoint("deepseek_v4")
    with safe_open(next(pathlib.Path(path).glob("*.safetensors")), "np") as f:
        saved = f.get_tensor("model.norm.weight")
    model = hfjax.load(path)
    np.testing.assert_array_equal(np.asarray(model.params["model.norm.weight"]), saved)
