"""hfjax.load: checkpoints on disk into jax.Arrays, through the same path a hub model takes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import hfjax
from hfjax import bridge, tolerances

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


# ---- the loader's contract: each tensor in its skeleton dtype, and the `convert` hook -----------

GATE = "model.layers.0.mlp.gate_proj"


def _copy_with(tmp_path, source, changes: dict[str, torch.Tensor]) -> pathlib.Path:
    """A copy of a checkpoint directory whose model.safetensors has `changes` applied (None deletes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = pathlib.Path(shutil.copytree(source, tmp_path / "checkpoint"))
    tensors = load_file(path / "model.safetensors")
    for key, value in changes.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _skeleton(path, dtype: str, replace: dict[str, torch.dtype]) -> torch.nn.Module:
    """The llama skeleton in `dtype`, with the named parameters replaced by meta parameters of other dtypes."""
    module = bridge.build_skeleton(bridge.read_config(path), "text-generation", dtype)
    for name, new_dtype in replace.items():
        owner, _, leaf = name.rpartition(".")
        old = module.get_parameter(name)
        setattr(
            module.get_submodule(owner),
            leaf,
            torch.nn.Parameter(torch.empty(old.shape, dtype=new_dtype, device="meta"), requires_grad=False),
        )
    return module


def _quantized_linear(module, name: str) -> None:
    # A quantized linear layer, as a quantization method builds one: int8 weight [N, K], float32 scale [N].
    linear = module.get_submodule(name)
    with torch.device("meta"):
        linear.weight = torch.nn.Parameter(torch.empty(linear.weight.shape, dtype=torch.int8), requires_grad=False)
        linear.weight_scale = torch.nn.Parameter(torch.empty(linear.weight.shape[0]), requires_grad=False)


def _stored(path, key: str) -> torch.Tensor:
    with safe_open(pathlib.Path(path) / "model.safetensors", framework="pt") as f:
        return f.get_tensor(key)


def test_each_tensor_lands_in_its_skeleton_dtype_and_float8_int8_keep_their_bytes(tmp_path, checkpoint):
    source = checkpoint("llama")
    fp8 = _stored(source, f"{GATE}.weight").to(torch.float8_e4m3fn)
    int8 = (_stored(source, "model.layers.0.mlp.up_proj.weight") * 1000).round().clamp(-128, 127).to(torch.int8)
    path = _copy_with(tmp_path, source, {f"{GATE}.weight": fp8, "model.layers.0.mlp.up_proj.weight": int8})
    module = _skeleton(
        path,
        "bfloat16",
        {
            f"{GATE}.weight": torch.float8_e4m3fn,
            "model.layers.0.mlp.up_proj.weight": torch.int8,
            "model.layers.0.mlp.down_proj.weight": torch.float32,  # kept in float32 by the model's code, say
        },
    )
    params, _ = bridge.load_weights(module, bridge.weight_files(path), "bfloat16")

    assert params[f"{GATE}.weight"].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(params[f"{GATE}.weight"]).view(np.uint8), fp8.view(torch.uint8).numpy())
    assert params["model.layers.0.mlp.up_proj.weight"].dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(params["model.layers.0.mlp.up_proj.weight"]), int8.numpy())
    down = "model.layers.0.mlp.down_proj.weight"
    assert params[down].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(params[down]), _stored(path, down).numpy())
    query = "model.layers.0.self_attn.q_proj.weight"
    assert params[query].dtype == jnp.bfloat16
    want = _stored(path, query).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(params[query]).view(np.int16), want)


def _quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 [N, K] and float32 scale [N]: symmetric, per output row."""
    scale = np.abs(weight).max(axis=1) / 127
    return np.round(weight / scale[:, None]).astype(np.int8), scale.astype(np.float32)


def test_convert_splits_a_weight_into_two_names(checkpoint):
    path = checkpoint("llama")
    module = _skeleton(path, "bfloat16", {})
    _quantized_linear(module, GATE)
    seen = {}

    def convert(name, array):
        seen[name] = (array.dtype, array.shape)
        if name != f"{GATE}.weight":
            return None
        weight, scale = _quantize(array)
        return {f"{GATE}.weight": weight, f"{GATE}.weight_scale": scale}

    params, _ = bridge.load_weights(module, bridge.weight_files(path), "bfloat16", convert=convert)

    stored = _stored(path, f"{GATE}.weight").numpy()
    assert seen[f"{GATE}.weight"] == (np.dtype("float32"), stored.shape), "convert sees the tensor as stored"
    weight, scale = _quantize(stored)
    assert params[f"{GATE}.weight"].dtype == jnp.int8 and params[f"{GATE}.weight_scale"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(params[f"{GATE}.weight"]), weight)
    np.testing.assert_array_equal(np.asarray(params[f"{GATE}.weight_scale"]), scale)
    # what convert left to the loader is loaded as usual
    other = "model.layers.1.mlp.gate_proj.weight"
    want = _stored(path, other).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(params[other]).astype(np.float32), want)


def test_convert_claims_a_name_the_module_lacks_and_sees_it_first(tmp_path, checkpoint):
    source = checkpoint("llama")
    rows = _stored(source, f"{GATE}.weight").shape[0]
    scale_inv = torch.rand(rows) + 0.5
    path = _copy_with(tmp_path, source, {f"{GATE}.weight_scale_inv": scale_inv})
    module = _skeleton(path, "float32", {})
    _quantized_linear(module, GATE)
    order = []

    def convert(name, array):
        order.append(name)
        if name.endswith(".weight_scale_inv"):  # the module stores its inverse under another name
            return {name.removesuffix("_inv"): 1 / array}
        if name == f"{GATE}.weight":
            return {name: _quantize(array)[0]}
        return None

    convert.claims = lambda name: name.endswith(".weight_scale_inv")
    params, _ = bridge.load_weights(module, bridge.weight_files(path), "float32", convert=convert)

    assert order[0] == f"{GATE}.weight_scale_inv" and order.count(f"{GATE}.weight_scale_inv") == 1
    np.testing.assert_allclose(np.asarray(params[f"{GATE}.weight_scale"]), 1 / scale_inv.numpy(), rtol=1e-6)
    # without the claim, the extra tensor is not read and the module's scale is missing
    del convert.claims
    order.clear()
    with pytest.raises(hfjax.LoadError, match=r"no weights for 1 parameters.*gate_proj.weight_scale"):
        bridge.load_weights(module, bridge.weight_files(path), "float32", convert=convert)
    assert f"{GATE}.weight_scale_inv" not in order


def test_convert_returning_a_name_the_module_lacks_is_one_clear_line(checkpoint):
    path = checkpoint("llama")
    module = _skeleton(path, "float32", {})
    with pytest.raises(hfjax.LoadError, match=r"convert returned 'nope' for the checkpoint tensor .*return only"):
        bridge.load_weights(module, bridge.weight_files(path), "float32", convert=lambda name, array: {"nope": array})


def test_a_truncated_file_is_one_clear_line(tmp_path, checkpoint):
    import shutil

    path = pathlib.Path(shutil.copytree(checkpoint("llama"), tmp_path / "checkpoint"))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(hfjax.LoadError, match=r"model.safetensors' ends inside the tensor .*truncated"):
        hfjax.load(path)


# hfjax's optional parts and their libraries: each is imported where its feature is first used, never by
# a load. `torchax` is the control: every load imports it, so a check that saw nothing would fail there.
_OPTIONAL_PARTS = ("hfjax.training", "optax", "hfjax.diffusion", "diffusers", "hfjax.tasks", "hfjax.serving", "fastapi")
_IMPORTED_BY_A_LOAD = """
import json, sys
import hfjax
hfjax.load(sys.argv[1])
print(json.dumps({name: name in sys.modules for name in sys.argv[2:]}))
"""


def test_a_load_imports_none_of_hfjaxs_optional_parts(checkpoint):
    # A fresh process: in this one other tests have imported them.
    argv = [sys.executable, "-c", _IMPORTED_BY_A_LOAD, str(checkpoint("llama")), "torchax", *_OPTIONAL_PARTS]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert imported == {"torchax": True, **dict.fromkeys(_OPTIONAL_PARTS, False)}
