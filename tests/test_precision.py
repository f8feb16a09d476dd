"""Float32 products as PyTorch computes them: every program hfjax builds (forward, generate's prefill
and decode loop, beams, a serving chunk, a train step, a whole diffusion loop) carries the precision
that torch's `set_float32_matmul_precision` names, or the model's own `matmul_precision`; a changed
setting builds new programs, and JAX's process-wide config is never touched."""

from __future__ import annotations

import contextlib
import re

import jax
import numpy as np
import pytest
import torch

import hfjax
from hfjax import tolerances
from hfjax.bridge import _compile

# torch's setting -> the precision StableHLO's products carry (hfjax._precision's table)
EXPECTED = {"highest": "HIGHEST", "high": "HIGH", "medium": "DEFAULT"}
_PRODUCT = re.compile(r"stablehlo\.(dot_general|convolution|dot)\b[^\n]*")
_PRECISION = re.compile(r"precision(?:_config)? = \[([^\]]*)\]")


@contextlib.contextmanager
def torch_precision(name: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(name)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def product_precisions(recorded: _compile.Recorded) -> list[tuple[str, ...]]:
    """Per float32 product (dot or convolution) of a recorded program, the precision of its operands."""
    text = recorded.jitted.lower(*recorded.args, **recorded.kwargs).as_text()
    found = []
    for line in (m.group(0) for m in _PRODUCT.finditer(text)):
        if "f32>" not in line:
            continue  # integer or half-precision products: no setting applies
        precision = _PRECISION.search(line)
        found.append(tuple(re.findall(r"[A-Z]+", precision.group(1))) if precision else ("none",))
    return found


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    pytest.importorskip("diffusers")
    path = hfjax.testing.save_tiny_pipeline("stable-diffusion", tmp_path_factory.mktemp("sd"))
    pipe = hfjax.load_pipeline(path, whole_loop=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run_every_kind(llama_path, pipe) -> list[_compile.Recorded]:
    """Runs a forward, generate (greedy, sampled, beams), a serving chunk, a train step and a whole
    diffusion loop; returns the programs they called."""
    from hfjax import serving, training

    model = hfjax.load(llama_path)
    rows = np.tile(np.arange(3, 19, dtype=np.int32), (16, 1))  # 16 rows: XLA's products, not the CPU's kernels
    with _compile.recording() as programs:
        model(rows)
        model.generate(rows, max_new_tokens=3)
        model.generate(rows, max_new_tokens=3, do_sample=True, top_k=5, seed=1)
        model.generate(rows[:4], max_new_tokens=3, num_beams=4)
        engine = serving.Engine(model, max_batch=16, max_model_len=64).start()
        engine.generate([list(range(3, 19))] * 16, serving.SamplingParams(max_tokens=3, temperature=0))
        engine.stop()
        trainer = hfjax.Trainer(model, training.sgd(0.1))
        trainer.step({"input_ids": rows, "labels": rows})
        pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert pipe.hfjax_path == "whole-loop"
    return programs


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
def test_every_program_carries_torchs_precision(llama, pipeline, setting):
    config_before = jax.config.jax_default_matmul_precision
    with torch_precision(setting):
        programs = _run_every_kind(llama, pipeline)
    assert jax.config.jax_default_matmul_precision == config_before, "JAX's process-wide config changed"
    products = {}
    for recorded in programs:
        products.setdefault(recorded.stage, []).extend(product_precisions(recorded))
    for stage in ("forward", "prefill", "decode", "train step", "whole loop"):
        assert products.get(stage), f"no {stage} program with a float32 product: the test would prove nothing"
    for stage, found in products.items():
        wrong = {p for p in found if set(p) != {EXPECTED[setting]}}
        assert not wrong, f"{stage}: products with precision {wrong}, not {EXPECTED[setting]} for torch's {setting!r}"


def test_a_changed_setting_builds_new_programs_and_the_models_own_wins(llama):
    model = hfjax.load(llama)
    ids = np.arange(3, 19, dtype=np.int32)[None]
    with torch_precision("highest"):
        first = np.asarray(model(ids).logits)
        model.generate(ids, max_new_tokens=3)
    counts = (model.compiled.compile_count, model.generation_programs.counts)
    with torch_precision("high"):
        again = np.asarray(model(ids).logits)
        model.generate(ids, max_new_tokens=3)
    assert model.compiled.compile_count == counts[0] + 1
    assert model.generation_programs.counts == {stage: n + 1 for stage, n in counts[1].items()}
    np.testing.assert_allclose(again, first, atol=tolerances.DEFAULT.atol)  # XLA:CPU: float32 either way
    with torch_precision("highest"):
        model(ids)
    assert model.compiled.compile_count == counts[0] + 1, "back to the first setting: its program is kept"

    pinned = hfjax.load(llama, matmul_precision="high")
    with torch_precision("highest"), _compile.recording() as programs:
        pinned(ids)
    assert {p for r in programs for p in product_precisions(r)} == {("HIGH", "HIGH")}


def test_a_bad_precision_is_one_error_naming_it(llama):
    with pytest.raises(hfjax.LoadError, match=r"matmul_precision='fp8' is not one of \('highest', 'high', 'medium'\)"):
        hfjax.load(llama, matmul_precision="fp8")
