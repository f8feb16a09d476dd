"""LoRA adapters served beside the base (`hfjax.lora`, `Model.load_adapter`) against peft in PyTorch:
logits within the tolerance table's bound, greedy tokens equal, in batches that mix adapters and the
base; on a quantized base; split over a mesh; loaded and dropped without compiling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import background
import hfjax
from hfjax import bridge, quantization, testing, tolerances, training

peft = pytest.importorskip("peft", reason="peft adapters need the `train` extra (peft)")

ADAPTERS = {  # name: save_tiny_adapter's settings
    "small": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
    "wide": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True, seed=2),
    "pattern": dict(r=2, lora_alpha=4, target_modules=["o_proj", "up_proj"], alpha_pattern={"up_proj": 32}, seed=3),
}
PROMPTS = ["Hello there, how are you?", "Hi", "The cat sat on", "Once upon a time there was"]
NEW = 6


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: testing.save_tiny_adapter(base, root / name, **settings) for name, settings in ADAPTERS.items()}


def _peft(base, adapter, *, merged: bool):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is None:
        return model
    wrapped = peft.PeftModel.from_pretrained(model, adapter).eval()
    return wrapped.merge_and_unload() if merged else wrapped


def _reference(module, tokenizer, prompt: str):
    """(new tokens [NEW], raw logits [NEW, V]) of transformers' greedy generate on one prompt."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = module.generate(
            ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id, min_new_tokens=NEW,
        )  # fmt: skip
    return out.sequences[0, ids.shape[1] :].numpy(), torch.stack(out.logits, 1)[0].numpy()


def test_each_adapters_logits_match_peft(base, adapters):
    model = hfjax.load(base)
    for name, path in adapters.items():
        model.load_adapter(path, adapter_name=name)
    ids = np.asarray([[1, 17, 40, 93, 5, 250, 61, 7]], np.int32)
    for name in [*adapters, None]:
        model.set_adapter(name)
        with torch.no_grad():
            want = _peft(base, adapters.get(name), merged=False)(torch.as_tensor(ids).long()).logits.numpy()
        np.testing.assert_allclose(np.asarray(model(ids).logits), want, atol=tolerances.LORA.atol, err_msg=name)
    model.set_adapter("small")
    base_alone = _peft(base, None, merged=False)
    with torch.no_grad():
        unchanged = base_alone(torch.as_tensor(ids).long()).logits.numpy()
    assert np.abs(np.asarray(model(ids).logits) - unchanged).max() > 100 * tolerances.LORA.atol  # it does change them


@pytest.fixture(scope="module")
def family_adapters(checkpoint, tmp_path_factory):
    """family -> (its tiny checkpoint, {name: adapter}) (gemma2: sliding-window layers beside full ones)."""
    made = {}

    def make(family: str):
        if family not in made:
            path = checkpoint(family)
            root = tmp_path_factory.mktemp(f"adapters-{family}")
            made[family] = path, {n: testing.save_tiny_adapter(path, root / n, **c) for n, c in ADAPTERS.items()}
        return made[family]

    return make


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_batch_mixing_adapters_and_the_base_gives_each_row_pefts_tokens_and_logits(family_adapters, family):
    base, adapters = family_adapters(family)
    model = hfjax.load(base)
    for name, path in adapters.items():
        model.load_adapter(path, adapter_name=name)
    tokenizer = model.tokenizer
    names = ["small", "wide", None, "pattern"]
    batch = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="np")
    out = model.generate(
        batch["input_ids"], batch["attention_mask"], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
        adapter=names, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    tokens = np.asarray(out.sequences)[:, batch["input_ids"].shape[1] :]
    logits = np.stack([np.asarray(step) for step in out.logits], axis=1)  # [B, NEW, V]
    for row, (prompt, name) in enumerate(zip(PROMPTS, names)):
        want_tokens, want_logits = _reference(_peft(base, adapters.get(name), merged=True), tokenizer, prompt)
        np.testing.assert_array_equal(tokens[row], want_tokens, err_msg=f"row {row}, adapter {name}")
        np.testing.assert_allclose(logits[row], want_logits, atol=tolerances.LORA.atol, err_msg=f"adapter {name}")


def test_loading_and_dropping_adapters_in_reserved_slots_compiles_nothing(base, adapters):
    model = hfjax.load(base)
    model.reserve_adapters(max_loras=2, max_lora_rank=8)  # every linear layer but the LM head
    tokenizer = model.tokenizer
    ids = tokenizer(PROMPTS[:1], return_tensors="np").input_ids
    model.load_adapter(adapters["small"], adapter_name="small")
    model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, adapter="small")
    with bridge.Compiles() as compiles:
        model.delete_adapter("small")
        model.load_adapter(adapters["wide"], adapter_name="wide")
        model.load_adapter(adapters["pattern"], adapter_name="pattern")
        wide = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, adapter="wide")
        pattern = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, adapter="pattern")
    assert compiles.requested == 0
    assert [a.index for a in model.adapters.values()] == [0, 1]
    for name, got in (("wide", wide), ("pattern", pattern)):
        want, _ = _reference(_peft(base, adapters[name], merged=True), tokenizer, PROMPTS[0])
        np.testing.assert_array_equal(np.asarray(got)[0, ids.shape[1] :], want, err_msg=name)


def _dequantized(base, model: hfjax.Model):
    """The base in torch with each quantized layer's weight the float weight its quantized tensors stand for."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    state = reference.state_dict()
    for name, layout in model.quantization.layers.items():
        tensors = {k: np.asarray(model.params[f"{name}.{k}"]) for k in ("weight", "weight_scale", "weight_zero")
                   if f"{name}.{k}" in model.params}  # fmt: skip
        state[f"{name}.weight"] = torch.from_numpy(
            quantization.dequantize(tensors, layout, state[f"{name}.weight"].shape[1])
        )
    reference.load_state_dict(state)
    return reference


@pytest.mark.parametrize("mode", ["int8", "fp8", "int4"])
def test_adapters_on_a_quantized_base_match_peft_on_its_dequantized_weights(base, adapters, mode):
    model = hfjax.load(base, quantize=mode)
    for name in ("small", "wide"):
        model.load_adapter(adapters[name], adapter_name=name)
    tokenizer = model.tokenizer
    batch = tokenizer(PROMPTS[:2], padding=True, padding_side="left", return_tensors="np")
    out = model.generate(
        batch["input_ids"], batch["attention_mask"], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
        adapter=["small", "wide"], return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    tokens = np.asarray(out.sequences)[:, batch["input_ids"].shape[1] :]
    logits = np.stack([np.asarray(step) for step in out.logits], axis=1)
    for row, name in enumerate(["small", "wide"]):
        reference = peft.PeftModel.from_pretrained(_dequantized(base, model), adapters[name]).eval()
        want_tokens, want_logits = _reference(reference.merge_and_unload(), tokenizer, PROMPTS[row])
        np.testing.assert_array_equal(tokens[row], want_tokens, err_msg=name)
        np.testing.assert_allclose(logits[row], want_logits, atol=tolerances.QUANTIZED_PARITY.atol, err_msg=name)


_SHARDED = r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
import numpy as np, hfjax
from hfjax import testing
root = sys.argv[1]
base = testing.save_tiny_checkpoint("llama", root + "/llama", hidden_size=128, intermediate_size=256, head_dim=32)
adapter = testing.save_tiny_adapter(base, root + "/adapter", r=8, target_modules="all-linear", seed=4)
ids = np.array([[1, 17, 40, 93, 5, 250, 61, 7], [0, 0, 0, 3, 9, 27, 81, 2]], np.int32)
mask = (ids != 0).astype(np.int32)
outputs = {}
for label, mesh in (("alone", None), ("split", hfjax.make_mesh(model=2))):
    model = hfjax.load(base, mesh=mesh)
    model.load_adapter(adapter, adapter_name="mine")
    if mesh is not None:
        for layer in ("model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"):
            print("spec", layer, *(tuple(model.params[f"hfjax.lora.{layer}.{f}"].sharding.spec) for f in "ab"))
    model.set_adapter("mine")
    logits = np.asarray(model(ids[:1]).logits)
    model.set_adapter(None)
    tokens = np.asarray(model.generate(ids, mask, max_new_tokens=6, do_sample=False, adapter=["mine", None]))
    outputs[label] = logits, tokens
print("difference", float(np.abs(outputs["alone"][0] - outputs["split"][0]).max()))
print("tokens", bool((outputs["alone"][1] == outputs["split"][1]).all()))
"""


def start_in_background() -> None:
    background.start("lora-sharded", background.python(_SHARDED), seconds=40)


def test_adapters_split_over_a_mesh_as_their_base_layers_and_run_as_on_one_device():
    job = background.finished("lora-sharded", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    lines = [line.split(" ", 2) for line in job.output.strip().splitlines()]
    specs = {line[1]: line[2] for line in lines if line[0] == "spec"}
    # up_proj is column-parallel: B split by output; down_proj row-parallel: A split by input.
    assert specs["model.layers.0.mlp.up_proj"] == "(None, None, None) (None, None, 'model')"
    assert specs["model.layers.0.mlp.down_proj"] == "('model', None, None) (None, None, None)"
    results = {line[0]: line[1] for line in lines if line[0] in ("difference", "tokens")}
    assert float(results["difference"]) <= tolerances.LORA.atol and results["tokens"] == "True", job.output[-2000:]


def test_adapters_that_cannot_be_served_are_refused_by_name(base, adapters, tmp_path):
    model = hfjax.load(base)
    dora = testing.save_tiny_adapter(base, tmp_path / "dora", use_dora=True)
    with pytest.raises(hfjax.LoadError, match=r"Model.load_adapter: .*DoRA \(use_dora=True\).*merge_and_unload"):
        model.load_adapter(dora)
    with pytest.raises(hfjax.LoadError, match=r"no adapter_config.json; pass the directory of an adapter"):
        model.load_adapter(tmp_path)
    model.reserve_adapters(max_loras=1, max_lora_rank=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(hfjax.LoadError, match=r"rank 8, above max_lora_rank=4"):
        model.load_adapter(adapters["wide"], adapter_name="wide")
    with pytest.raises(hfjax.LoadError, match=r"adapts 'model.layers.0.mlp.up_proj', which is not among"):
        model.load_adapter(adapters["pattern"], adapter_name="pattern")
    model.load_adapter(adapters["small"], adapter_name="small")
    with pytest.raises(hfjax.LoadError, match=r"adapter_name='small' is already loaded"):
        model.load_adapter(adapters["small"], adapter_name="small")
    with pytest.raises(hfjax.LoadError, match=r"all 1 adapter slots are in use"):
        model.load_adapter(adapters["small"], adapter_name="again")
    with pytest.raises(hfjax.GenerationError, match=r"no adapter named 'other' is loaded \(loaded: 'small'\)"):
        model.generate(np.asarray([[1, 2, 3]]), max_new_tokens=2, adapter="other")
    with pytest.raises(hfjax.GenerationError, match=r"adapter= holds 2 names for 1 prompts"):
        model.generate(np.asarray([[1, 2, 3]]), max_new_tokens=2, adapter=["small", None])
    with pytest.raises(hfjax.TrainingError, match=r"holds LoRA adapters beside its weights \(small loaded"):
        hfjax.Trainer(model, training.sgd(0.1))
    with pytest.raises(hfjax.LoadError, match=r"target_modules=\['nope'\] names none of the model's linear layers"):
        model.reserve_adapters(target_modules=["nope"])
