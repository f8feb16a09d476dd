"""Quantized weights (hfjax.quantization): the quantizers, the op on every path, quantize-on-load,
the checkpoint formats people publish, sharding, QLoRA, and the command line.

References: PyTorch running the same weights dequantized (transformers' model with the float
weights the quantized ones stand for); transformers loading the checkpoint itself where it can on
the CPU; compressed-tensors' own decompression; peft and torch.optim for QLoRA.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import background
import hfjax
import quantized_checkpoints as written
from hfjax import _backend, quantization, tolerances
from hfjax.quantization import Layout, Quantization

IDS = np.array([[1, 17, 40, 93, 5, 250, 61, 7, 33, 12]], np.int32)
LAYOUTS = {
    "int8 per channel": Layout("int8", 1, 256),
    "int8 groups with zero points": Layout("int8", 1, 64, zero=True),
    "fp8 per channel": Layout("fp8", 1, 256),
    "fp8 blocks": Layout("fp8", 32, 64),
    "int4 groups": Layout("int4", 1, 64, zero=True),
    "int4 groups of 128": Layout("int4", 1, 128, zero=True),  # the kernel's unrolled groups
    "int4 per channel": Layout("int4", 1, 256, zero=True),
}


def _random_tensors(layout: Layout, n: int = 96, k: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    weight[0, :16] = 2.0 ** -np.arange(10, 26)  # tiny values: e4m3's subnormals, and below them
    tensors = quantization.quantize(weight, layout)
    if layout.zero and layout.mode == "int8":
        tensors["weight_zero"] = rng.integers(-4, 5, tensors["weight_scale"].shape).astype(np.float32)
    return tensors


def _dequantized_reference(path, model: hfjax.Model) -> transformers.PreTrainedModel:
    """The checkpoint's transformers model with each quantized layer's weight replaced by the float
    weight the quantized tensors in `model.params` stand for."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if "lm_head" in model.quantization.layers:  # a quantized head no longer shares the embedding's weight
        reference.lm_head.weight = torch.nn.Parameter(reference.lm_head.weight.detach().clone())
    state = reference.state_dict()
    for name, layout in model.quantization.layers.items():
        leaves = ("weight", "weight_scale", "weight_zero")
        tensors = {k: np.asarray(model.params[f"{name}.{k}"]) for k in leaves if f"{name}.{k}" in model.params}
        conv1d = type(reference.get_submodule(name)).__name__ == "Conv1D"  # holds its weight [in, out]
        in_features = state[f"{name}.weight"].shape[0 if conv1d else 1]
        weight = quantization.dequantize(tensors, layout, in_features)
        state[f"{name}.weight"] = torch.from_numpy(weight.T.copy() if conv1d else weight)
    reference.load_state_dict(state)
    return reference


def _logits(module, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return module(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


def _assert_close(got, want, tolerance: tolerances.Tolerance):
    np.testing.assert_allclose(np.asarray(got), want, atol=tolerance.atol, rtol=tolerance.rtol, err_msg=tolerance.why)


# ---- the quantizers -------------------------------------------------------------------


@pytest.mark.parametrize("name", LAYOUTS)
def test_quantizers_round_each_weight_to_its_nearest_step(name):
    layout = LAYOUTS[name]
    weight = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    tensors = quantization.quantize(
        weight, Layout(layout.mode, layout.rows_per_scale, layout.columns_per_scale, layout.mode == "int4")
    )
    back = quantization.dequantize(
        tensors, Layout(layout.mode, layout.rows_per_scale, layout.columns_per_scale, layout.mode == "int4"), 256
    )
    scale = np.repeat(np.repeat(tensors["weight_scale"], layout.rows_per_scale, 0), layout.columns_per_scale, 1)[
        :64, :256
    ]
    if layout.mode == "fp8":
        # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value, or half the smallest step (2^-10) below 2^-6.
        bound = np.maximum(np.abs(weight) / 16, scale * 2.0**-10)
    else:
        bound = scale / 2  # symmetric or asymmetric rounding to the nearest of 255 or 15 steps
    assert np.all(np.abs(back - weight) <= bound * (1 + 1e-5) + 1e-7)


def test_4_bit_values_pack_two_per_byte_low_half_first():
    q = np.arange(16, dtype=np.uint8).reshape(2, 8)
    packed = quantization._schemes.pack_int4(q)
    assert packed.shape == (2, 4) and packed[0, 0] == 0x10 and packed[1, 3] == 0xFE
    np.testing.assert_array_equal(quantization._schemes.unpack_int4(packed), q)


# ---- the op: PyTorch, the generic lowering, the CPU kernel ------------------------------


@pytest.mark.parametrize("name", LAYOUTS)
def test_quantized_linear_matches_the_dequantized_product(name):
    layout = LAYOUTS[name]
    tensors = _random_tensors(layout)
    weight = quantization.dequantize(tensors, layout, 256).astype(np.float64)
    bias = np.random.default_rng(2).standard_normal(96).astype(np.float32)
    x = np.random.default_rng(3).standard_normal((2, 5, 256)).astype(np.float32)
    want = x.astype(np.float64) @ weight.T + bias
    layer = quantization.QuantizedLinear(256, 96, layout, bias=True, device="cpu")
    with torch.no_grad():
        for leaf, value in tensors.items():
            parameter = dict(layer.named_parameters())[leaf]  # `layer.weight` is the float weight
            parameter.copy_(torch.from_numpy(np.asarray(value).view(np.uint8)).view(parameter.dtype))
        layer.bias.copy_(torch.from_numpy(bias))
    tolerance = tolerances.for_dot_products(256)
    with torch.no_grad():
        _assert_close(layer(torch.from_numpy(x)).numpy(), want, tolerance)  # PyTorch
    _assert_close(hfjax.jit(layer)(x), want, tolerance)  # the active backend's lowering
    args = [jnp.asarray(tensors[k]) if k in tensors else None for k in ("weight", "weight_scale", "weight_zero")]
    generic = jax.jit(quantization.quantized_linear_jax, static_argnums=(5, 6, 7))
    _assert_close(
        generic(jnp.asarray(x), *args, jnp.asarray(bias), layout.mode, layout.rows_per_scale, layout.columns_per_scale),
        want,
        tolerance,
    )


def _cpu_kernels():
    _backend.active().prepare()
    from hfjax import cpu

    if not cpu.kernels_status().startswith("loaded"):
        pytest.skip(f"the CPU kernels are not loaded here: {cpu.kernels_status()}")
    from hfjax.cpu import _kernels

    return _kernels


@pytest.mark.cpu_hook
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("name", LAYOUTS)
def test_cpu_kernel_matches_the_dequantized_product(name, rows):
    kernels = _cpu_kernels()
    layout = LAYOUTS[name]
    tensors = _random_tensors(layout)
    x = np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)
    want = x.astype(np.float64) @ quantization.dequantize(tensors, layout, 256).astype(np.float64).T
    zero = tensors.get("weight_zero")
    assert kernels.quantized_usable(jnp.asarray(x), jnp.asarray(tensors["weight"]), layout.columns_per_scale)
    product = jax.jit(kernels.rows_times_quantized, static_argnums=(4, 5))
    got = product(
        jnp.asarray(x), jnp.asarray(tensors["weight"]), jnp.asarray(tensors["weight_scale"]),
        None if zero is None else jnp.asarray(zero), layout.rows_per_scale, layout.columns_per_scale,
    )  # fmt: skip
    _assert_close(got, want, tolerances.for_dot_products(256))
    # The rows' gradient (QLoRA's backward): d sum(out) / d x = the sum of the weight's rows.
    args = [
        jnp.asarray(tensors["weight"]),
        jnp.asarray(tensors["weight_scale"]),
        None if zero is None else jnp.asarray(zero),
    ]
    gradient = jax.grad(
        lambda r: kernels.rows_times_quantized(r, *args, layout.rows_per_scale, layout.columns_per_scale).sum()
    )
    want = np.broadcast_to(quantization.dequantize(tensors, layout, 256).astype(np.float64).sum(0), x.shape)
    bound = tolerances.for_dot_products(96)
    assert np.abs(np.asarray(gradient(jnp.asarray(x))) - want).max() <= bound.atol * np.abs(want).max(), bound.why


# ---- quantize on load -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("mode", quantization.MODES)
def test_quantize_on_load_matches_pytorch_on_the_dequantized_weights(checkpoint, family, mode):
    path = checkpoint(family)
    model = hfjax.load(path, quantize=mode)
    assert model.quantization.layers and not model.quantization.skipped
    stored = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}[mode]
    for name in model.quantization.layers:
        assert model.params[f"{name}.weight"].dtype == stored  # on the device at their quantized size
    assert not any(".lm_head." in n or n.startswith("lm_head.") for n in model.quantization.layers)
    reference = _dequantized_reference(path, model)
    _assert_close(model(IDS).logits, _logits(reference), tolerances.QUANTIZED_PARITY)
    got = np.asarray(model.generate(IDS, max_new_tokens=12, min_new_tokens=12, do_sample=False))
    with torch.no_grad():
        want = reference.generate(torch.as_tensor(IDS).long(), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    np.testing.assert_array_equal(got, want.numpy())


def test_model_code_that_reads_a_layers_weight_gets_the_float_weight(checkpoint):
    # Mamba multiplies by `dt_proj.weight` itself, and casts to `lm_head.weight.dtype`.
    path = checkpoint("mamba")
    model = hfjax.load(path, quantize="int8", quantize_lm_head=True)
    assert {"backbone.layers.0.mixer.dt_proj", "lm_head"} <= set(model.quantization.layers)
    _assert_close(model(IDS).logits, _logits(_dequantized_reference(path, model)), tolerances.QUANTIZED_PARITY)


@pytest.mark.parametrize("mode", quantization.MODES)
def test_logits_stay_near_the_unquantized_models(checkpoint, mode):
    path = checkpoint("llama")
    full = np.asarray(hfjax.load(path)(IDS).logits)
    quantized = np.asarray(hfjax.load(path, quantize=mode)(IDS).logits)
    bound = tolerances.QUANTIZED_LOGITS[mode]
    assert np.linalg.norm(quantized - full) / np.linalg.norm(full) < bound.rtol, bound.why


def test_beams_and_the_pipeline_run_on_a_quantized_model(checkpoint):
    path = checkpoint("llama")
    model = hfjax.load(path, quantize="int8")
    reference = _dequantized_reference(path, model)
    got = np.asarray(model.generate(IDS, max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False))
    with torch.no_grad():
        want = reference.generate(
            torch.as_tensor(IDS).long(), max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False
        )
    np.testing.assert_array_equal(got, want.numpy())
    text = "The river ran quietly past the old mill"
    ours = hfjax.pipeline("text-generation", model=model)(text, max_new_tokens=5, do_sample=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    theirs = transformers.pipeline("text-generation", model=reference, tokenizer=tokenizer, device="cpu")
    assert ours == theirs(text, max_new_tokens=5, do_sample=False)


def test_the_serving_engine_answers_as_generate_on_a_quantized_model(checkpoint):
    from hfjax.serving import Engine, SamplingParams

    model = hfjax.load(checkpoint("llama"), quantize="int4")
    engine = Engine(model, max_num_seqs=2, max_model_len=64, prefill_chunk=16, decode_steps=4)
    engine.start()
    try:
        prompts = [IDS[0].tolist(), IDS[0, :4].tolist()]
        got = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    finally:
        engine.stop()
    for prompt, event in zip(prompts, got):
        want = np.asarray(model.generate(np.array([prompt]), max_new_tokens=6, do_sample=False))[0, len(prompt) :]
        assert event.token_ids == want.tolist()[: len(event.token_ids)] and len(event.token_ids) >= 1


def test_quantize_lm_head_quantizes_the_tied_head_from_the_embedding(checkpoint):
    path = checkpoint("llama", tie_word_embeddings=True)
    model = hfjax.load(path, quantize="int8", quantize_lm_head=True)
    assert "lm_head" in model.quantization.layers and model.params["lm_head.weight"].dtype == jnp.int8
    assert model.params["model.embed_tokens.weight"].dtype == jnp.float32
    _assert_close(model(IDS).logits, _logits(_dequantized_reference(path, model)), tolerances.QUANTIZED_PARITY)


def test_from_module_quantizes_a_copy_and_leaves_the_module_alone(checkpoint):
    path = checkpoint("llama")
    module = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    before = _logits(module)
    model = hfjax.Model.from_module(module, quantize=Quantization("fp8", fp8_block=(32, 32)))
    np.testing.assert_array_equal(_logits(module), before)
    assert type(module.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert {layout.rows_per_scale for layout in model.quantization.layers.values()} == {32}
    loaded = hfjax.load(path, quantize=Quantization("fp8", fp8_block=(32, 32)))
    _assert_close(model(IDS).logits, np.asarray(loaded(IDS).logits), tolerances.QUANTIZED_PARITY)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda p: hfjax.load(p, quantize="int3"),
            "quantize='int3' is not a quantization; pass one of 'int8', 'fp8', 'int4'",
        ),
        (lambda p: hfjax.load(p, quantize_lm_head=True), "quantize_lm_head=True needs quantize="),
        (lambda p: Quantization("int4", group_size=7), "Quantization(group_size=7): pass an even int"),
    ],
)
def test_bad_quantize_arguments_are_refused_by_name(checkpoint, call, message):
    with pytest.raises(hfjax.LoadError, match=re.escape(message)):
        call(checkpoint("llama"))


_PEAK_MEMORY = r"""
import json, math, os, sys, threading, time
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
import hfjax, jax
from hfjax import testing
from safetensors import safe_open
path = testing.save_tiny_checkpoint("llama", sys.argv[1] + "/big", hidden_size=1024, intermediate_size=4096,
                                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=128)
# The loader reads at most an eighth of the checkpoint (or its largest tensor) ahead of the tensor it places.
def anonymous():  # the process's own memory, without the file's pages the loader maps (the OS's page cache)
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) * 1024
import gc; gc.collect()
before, peak, loading = anonymous(), [0], [True]
def watch():
    while loading[0]:
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.001)
watcher = threading.Thread(target=watch)
watcher.start()
model = hfjax.load(path, quantize="int8")
jax.block_until_ready(model.params)
loading[0] = False
watcher.join()
with safe_open(path / "model.safetensors", "np") as f:
    largest = max(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 4
print(json.dumps({"grew": peak[0] - before, "checkpoint": (path / "model.safetensors").stat().st_size, "largest": largest}))
"""


def start_in_background() -> None:
    background.start("quantized-load-peak-memory", background.python(_PEAK_MEMORY), seconds=40)
    background.start("quantized-sharded", background.python(_SHARDED), seconds=40)


def test_peak_host_memory_while_quantizing_stays_below_the_checkpoint_plus_one_tensor():
    job = background.finished("quantized-load-peak-memory", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    figures = json.loads(job.output.strip().splitlines()[-1])
    # Everything the load held at its highest: the quantized model (a quarter of the float32
    # checkpoint), the tensors in flight and the quantizer's temporaries.
    assert figures["grew"] < figures["checkpoint"] + figures["largest"], figures


# ---- sharding -------------------------------------------------------------------------------

_SHARDED = r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
import numpy as np, jax, hfjax
from hfjax import testing
path = testing.save_tiny_checkpoint("llama", sys.argv[1] + "/llama", hidden_size=128, intermediate_size=256, head_dim=32)
ids = np.array([[1, 17, 40, 93, 5, 250, 61, 7]], np.int32)
for mode in ("int8", "fp8", "int4"):
    alone = hfjax.load(path, quantize=mode)
    split = hfjax.load(path, quantize=mode, mesh=hfjax.make_mesh(model=2))
    for name in ("model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"):
        weight, scale = (split.params[f"{name}.{leaf}"].sharding.spec for leaf in ("weight", "weight_scale"))
        print(mode, name, tuple(weight), tuple(scale))
    difference = np.abs(np.asarray(split(ids).logits) - np.asarray(alone(ids).logits)).max()
    tokens = (np.asarray(split.generate(ids, max_new_tokens=6, do_sample=False)) == np.asarray(alone.generate(ids, max_new_tokens=6, do_sample=False))).all()
    print(mode, "difference", difference, "tokens", bool(tokens))
"""


def test_quantized_weights_and_scales_split_as_the_weights_do_over_a_mesh():
    job = background.finished("quantized-sharded", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    lines = [line.split() for line in job.output.strip().splitlines() if line.split()[0] in quantization.MODES]
    for mode in quantization.MODES:
        up, down, result = [line[1:] for line in lines if line[0] == mode]
        # up_proj: column-parallel, weight and scales split by output; down_proj: row-parallel, the
        # weight by input, per-channel scales (one per output) replicated, int4's group scales split by input.
        assert up == ["model.layers.0.mlp.up_proj", "('model',", "None)", "('model',", "None)"]
        assert down[1:3] == ["(None,", "'model')"]
        assert down[3:] == (["(None,", "'model')"] if mode == "int4" else ["(None,", "None)"])
        assert float(result[1]) <= tolerances.QUANTIZED_PARITY.atol and result[3] == "True", result


def test_shard_plan_shows_the_quantized_bytes(checkpoint):
    from hfjax import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            cli.main(["shard-plan", "--model", str(checkpoint("llama")), "--model-parallel", "2", "--quantize", "int4"])
            == 0
        )
    rows = {
        line.split()[0]: line.split()
        for line in out.getvalue().splitlines()
        if line.startswith("model.layers.0.mlp.up_proj")
    }
    assert rows["model.layers.0.mlp.up_proj.weight"][4] == "uint8"
    assert rows["model.layers.0.mlp.up_proj.weight_scale"][1:3] == ["P('model',", "None)"]


# ---- checkpoints published quantized -----------------------------------------------------------

# (preset, forced format): FP8_DYNAMIC and FP8_BLOCK are float-quantized; W8A8 int-quantized
# (int8 per channel; hfjax keeps activations in float); W8A16 and W4A16 pack-quantized (groups of
# 128); W4A16_ASYM with zero points; W8A16 written naive-quantized.
PRESETS = [("FP8_DYNAMIC", None), ("FP8_BLOCK", None), ("W8A8", None), ("W8A16", None), ("W4A16", None),
           ("W4A16_ASYM", None), ("W8A16", "naive-quantized")]  # fmt: skip
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32)  # llmcompressor's groups and blocks are 128 wide


@pytest.mark.parametrize("preset, fmt", PRESETS)
def test_compressed_tensors_checkpoints_match_their_own_decompression(checkpoint, tmp_path, preset, fmt):
    base = checkpoint("llama", **WIDE)
    path = written.compressed_tensors_checkpoint(base, tmp_path / preset, preset, fmt=fmt)
    model = hfjax.load(path)
    assert len(model.quantization.layers) == 14 and "compressed-tensors" in model.quantization.source
    reference = written.plain_model(path, written.compressed_tensors_reference(path))
    _assert_close(model(IDS).logits, _logits(reference), tolerances.QUANTIZED_PARITY)
    got = np.asarray(model.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False))
    with torch.no_grad():
        want = reference.generate(torch.as_tensor(IDS).long(), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("preset", ["W8A16", "W4A16"])
def test_compressed_tensors_checkpoints_match_transformers_loading_them(checkpoint, tmp_path, preset):
    # transformers decompresses pack-quantized weights on the CPU as it loads them; its float8
    # layers run with activations quantized too, and its loading of W4A16_ASYM's zero points fails
    # (transformers 5.24), so those are compared with compressed-tensors' decompression above.
    path = written.compressed_tensors_checkpoint(checkpoint("llama", **WIDE), tmp_path / preset, preset)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _assert_close(hfjax.load(path)(IDS).logits, _logits(reference), tolerances.QUANTIZED_PARITY)


def test_fine_grained_fp8_checkpoints_match_transformers_loading_them(checkpoint, tmp_path):
    base = checkpoint("llama", **WIDE)
    path = written.fine_grained_fp8_checkpoint(base, tmp_path / "fp8", block=(128, 128))
    model = hfjax.load(path)
    with safe_open(path / "model.safetensors", "np") as f:  # transformers' op leaves k_proj and v_proj [64, 128]
        scaled = {key.removesuffix(".weight_scale_inv") for key in f.keys() if key.endswith(".weight_scale_inv")}
    assert (
        model.quantization.source.startswith("fp8") and set(model.quantization.layers) == scaled and len(scaled) == 10
    )
    assert model.params["model.layers.0.mlp.down_proj.weight_scale"].shape == (1, 2)
    # Without a GPU transformers loads fp8 checkpoints dequantized (its Fp8Dequantize).
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _assert_close(model(IDS).logits, _logits(reference), tolerances.QUANTIZED_PARITY)
    got = np.asarray(model.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False))
    with torch.no_grad():
        want = reference.generate(torch.as_tensor(IDS).long(), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("fmt, act_order", [("gptq", False), ("gptq", True), ("gptq_v2", True)])
def test_gptq_checkpoints_match_pytorch_on_the_weights_they_stand_for(checkpoint, tmp_path, fmt, act_order):
    base = checkpoint("llama")
    path, weights = written.gptq_checkpoint(base, tmp_path / fmt, group_size=32, act_order=act_order, fmt=fmt)
    model = hfjax.load(path)
    assert len(model.quantization.layers) == 14
    assert ("model.layers.0.mlp.up_proj.input_order" in model.params) == act_order
    _compare_with_weights(model, base, path, weights)


def test_awq_checkpoints_match_compressed_tensors_reading_them(checkpoint, tmp_path):
    # compressed-tensors converts AutoAWQ GEMM checkpoints (AutoAWQConverter) and decompresses the
    # result: its reading of the layout is the reference, beside the weights the test packed.
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    base = checkpoint("llama")
    path, weights = written.awq_checkpoint(base, tmp_path / "awq", group_size=32)
    converted = AutoAWQConverter(group_size=32).process(load_file(path / "model.safetensors"))
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
    )
    compressor = BaseCompressor.load_from_registry("pack-quantized")
    for prefix, weight in weights.items():
        local = {k.rpartition(".")[2]: v for k, v in converted.items() if k.rpartition(".")[0] == prefix}
        theirs = compressor.decompress(local, scheme)["weight"].float().numpy()
        _assert_close(theirs, weight, tolerances.FLOAT16_PRODUCT)  # the layout the test wrote is AWQ's
    _compare_with_weights(hfjax.load(path), base, path, weights)


def _compare_with_weights(model, base, path, weights):
    from safetensors.torch import load_file

    state = load_file(base / "model.safetensors")
    state.update({f"{prefix}.weight": torch.from_numpy(weight) for prefix, weight in weights.items()})
    reference = written.plain_model(path, state)
    _assert_close(model(IDS).logits, _logits(reference), tolerances.QUANTIZED_PARITY)
    got = np.asarray(model.generate(IDS, max_new_tokens=10, min_new_tokens=10, do_sample=False))
    with torch.no_grad():
        want = reference.generate(torch.as_tensor(IDS).long(), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize(
    "config, named",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
        ({"quant_method": "hqq", "nbits": 4}, "hqq"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ],
)
def test_formats_hfjax_cannot_read_fail_in_one_line_that_names_them(checkpoint, tmp_path, config, named):
    import shutil

    path = tmp_path / "refused"
    shutil.copytree(checkpoint("llama"), path)
    settings = json.loads((path / "config.json").read_text())
    settings["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(settings))
    with pytest.raises(hfjax.LoadError) as raised:
        hfjax.load(path)
    message = str(raised.value)
    assert "\n" not in message and named in message and "quantize='int8'" in message


def test_quantized_experts_of_a_mixture_are_refused_in_one_line(checkpoint, tmp_path):
    """llmcompressor on transformers 4 wrote each expert's linear layers quantized (experts.0.w1.weight
    and its weight_scale); transformers 5 fuses the experts into one tensor, which hfjax does not read
    quantized. Such a checkpoint is refused by name, not loaded with wrong weights."""
    from safetensors.numpy import load_file, save_file

    path = written.compressed_tensors_checkpoint(checkpoint("mixtral", **WIDE), tmp_path / "moe", "W8A16",
                                                 fmt="naive-quantized")  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    expert = "model.layers.0.mlp.experts.0.w1"
    tensors[expert + ".weight"] = np.ones((WIDE["intermediate_size"], WIDE["hidden_size"]), np.int8)
    tensors[expert + ".weight_scale"] = np.ones((WIDE["intermediate_size"], 1), np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hfjax.LoadError) as raised:
        hfjax.load(path)
    message = str(raised.value)
    assert "\n" not in message and repr(expert) in message and "mixture-of-experts" in message


def test_quantize_on_a_quantized_checkpoint_is_refused(checkpoint, tmp_path):
    path, _ = written.gptq_checkpoint(checkpoint("llama"), tmp_path / "gptq", group_size=32, act_order=False)
    with pytest.raises(hfjax.LoadError, match="the checkpoint is quantized already \\(GPTQ\\); drop quantize='int8'"):
        hfjax.load(path, quantize="int8")


# ---- QLoRA ------------------------------------------------------------------------------


def test_lora_on_a_quantized_model_trains_as_pytorch_on_its_dequantized_base(checkpoint, tmp_path):
    import peft

    path = checkpoint("llama")
    model = hfjax.load(path, quantize="int4")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    trainer = hfjax.Trainer(model, optimizer=hfjax.training.sgd(0.5), lora=config, dropout=False, seed=3)
    batch = {"input_ids": np.concatenate([IDS, IDS[:, ::-1]]), "labels": np.concatenate([IDS, IDS[:, ::-1]])}
    initial = {n: torch.from_numpy(np.array(a)) for n, a in trainer.trainable.items()}
    ours = [trainer.step(batch)["loss"] for _ in range(4)]

    reference = peft.get_peft_model(_dequantized_reference(path, model), config)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(initial[name.removeprefix("base_model.model.")])
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    theirs = []
    for _ in range(4):
        loss = reference(
            input_ids=torch.as_tensor(batch["input_ids"]).long(), labels=torch.as_tensor(batch["labels"]).long()
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, atol=tolerances.TRAINING_SGD.atol, rtol=tolerances.TRAINING_SGD.rtol)

    # The adapter is a plain peft adapter, for the unquantized model.
    trainer.save_pretrained(tmp_path / "adapter")
    plain = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    adapted = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter")
    for name, parameter in adapted.named_parameters():
        if "lora_" in name:
            trained = np.asarray(trainer.trainable[name.removeprefix("base_model.model.")])
            np.testing.assert_array_equal(parameter.detach().numpy(), trained)


def test_full_fine_tuning_of_a_quantized_model_is_refused(checkpoint):
    model = hfjax.load(checkpoint("llama"), quantize="int8")
    with pytest.raises(hfjax.TrainingError, match="the model is quantized .*; train LoRA adapters over it"):
        hfjax.Trainer(model)


# ---- the command line -----------------------------------------------------------------------


def test_generate_quantize_prints_what_the_quantized_model_generates(checkpoint):
    from hfjax import cli

    path = checkpoint("llama")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(
            [
                "generate",
                "--model",
                str(path),
                "--quantize",
                "int4",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
                "Hello there",
            ]
        )
    assert code == 0
    model = hfjax.load(path, quantize="int4")
    assert out.getvalue().strip() == model.generate_text("Hello there", max_new_tokens=6, do_sample=False).strip()


def test_the_e4m3_values_the_kernel_decodes_are_ml_dtypes_values():
    # The CPU kernel reads an e4m3 byte as a half-precision number 2^8 smaller (see _kernels.cc):
    # that holds for every byte but NaN.
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    words = codes.astype(np.int8).astype(np.int16)
    halves = ((words << 7) & np.int16(-16512)).view(np.float16).astype(np.float32)  # -16512 == 0xBF80
    finite = np.isfinite(values)
    np.testing.assert_array_equal(halves[finite] * 256, values[finite])
