"""Every kind of program hfjax builds lowers for CUDA and TPU, checked on the CPU with `jax.export`.

A child process (in the background, beside the rest of the suite) runs the generic engine, as a GPU
or TPU machine does (HFJAX_CPU_KERNELS=0: no CPU hook), over 8 host devices. It runs forwards of six
kinds of family, generate's prefill and decode loop (greedy, sampling, beams), a serving chunk, train
steps (full, LoRA, and fully sharded on a (2, 4) mesh) and a whole diffusion loop, recording every
program called (`hfjax._compile.recording`), then exports each one for the platforms "cuda" and "tpu".
A program may hold no custom call that only the CPU runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

import background

# (scenario, what it runs): each must record at least one program, and every program must export
SCENARIOS = {
    "forward-dense": "llama's forward",
    "forward-moe": "mixtral's forward (mixture of experts)",
    "forward-state-space": "mamba's forward",
    "forward-hybrid": "jamba's forward (attention and mamba layers)",
    "forward-encoder-decoder": "t5's forward",
    "forward-vision": "vit's image classification",
    "forward-speech": "wav2vec2's CTC forward",
    "generate-greedy": "llama's greedy generate: prefill and decode loop",
    "generate-sampling": "llama's sampled generate (top-k, top-p, temperature)",
    "generate-beams": "llama's beam search",
    "serving": "the serving engine's prefill and decode chunks",
    "train-full": "a full fine-tuning step",
    "train-lora": "a LoRA step",
    "train-mesh": "a fully sharded step on a (2, 4) mesh",
    "diffusion-whole-loop": "a tiny Stable Diffusion's whole denoising loop",
}
PLATFORMS = ("cuda", "tpu")


def start_in_background() -> None:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "HFJAX_CPU_KERNELS": "0"}
    background.start("export", [sys.executable, __file__], env=env, seconds=100)


@pytest.fixture(scope="module")
def exported():
    child = background.finished("export", start_in_background)
    assert child.returncode == 0, child.output[-4000:]
    return json.loads((child.directory / "exported.json").read_text())


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_program_exports_for_cuda_and_tpu(exported, scenario):
    records = exported["scenarios"][scenario]
    assert records, f"{SCENARIOS[scenario]} called no program"
    for record in records:
        for platform in PLATFORMS:
            result = record[platform]
            assert result["error"] is None, f"{scenario} / {record['stage']} for {platform}: {result['error']}"
            cpu_only = [c for c in result["custom_calls"] if c in exported["cpu_only"] or "cpu" in c.lower()]
            assert not cpu_only, f"{scenario} / {record['stage']} for {platform} holds CPU-only custom calls {cpu_only}"


def test_the_child_ran_the_generic_engine(exported):
    assert exported["hook"] is None, f"the child ran the {exported['hook']!r} hook, not the generic engine"
    assert exported["devices"] == 8


# -- the child -------------------------------------------------------------------------------


def _child(directory: pathlib.Path) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import jax
    import numpy as np
    import peft
    import torch

    import hfjax
    from hfjax import _backend, serving, testing, training
    from hfjax.bridge import _compile
    from hfjax.cpu import _build

    def path(family, task=None):
        return testing.save_tiny_checkpoint(family, directory / f"{family}-{task}", task=task)

    ids = np.arange(3, 19, dtype=np.int32)[None]
    batch = {"input_ids": np.tile(ids, (8, 1)), "labels": np.tile(ids, (8, 1))}

    def forward(family, task=None, **inputs):
        model = hfjax.load(path(family, task))
        return lambda: model(**(inputs or {"input_ids": ids}))

    def generate(**settings):
        model = hfjax.load(path("llama"))
        return lambda: model.generate(np.tile(ids, (2, 1)), max_new_tokens=4, **settings)

    def serve():
        engine = serving.Engine(hfjax.load(path("llama")), max_batch=4, max_model_len=64).start()
        try:
            engine.generate([list(range(3, 19))] * 3, serving.SamplingParams(max_tokens=4, temperature=0.7, seed=0))
        finally:
            engine.stop()

    def train(**options):
        mesh = options.pop("mesh", None)
        model = hfjax.load(path("llama"), mesh=mesh)
        trainer = hfjax.Trainer(model, training.adamw(1e-3), **options)
        return lambda: trainer.step(batch)

    def diffuse():
        pipe = hfjax.load_pipeline(testing.save_tiny_pipeline("stable-diffusion", directory / "sd"), whole_loop=True)
        pipe.set_progress_bar_config(disable=True)
        pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert pipe.hfjax_path == "whole-loop"

    speech = np.random.default_rng(0).standard_normal((1, 4000)).astype(np.float32)
    image = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    runs = {
        "forward-dense": forward("llama"),
        "forward-moe": forward("mixtral"),
        "forward-state-space": forward("mamba"),
        "forward-hybrid": forward("jamba"),
        "forward-encoder-decoder": forward("t5", input_ids=ids, decoder_input_ids=ids[:, :4]),
        "forward-vision": forward("vit", "image-classification", pixel_values=image),
        "forward-speech": forward("wav2vec2", "automatic-speech-recognition", input_values=speech),
        "generate-greedy": generate(),
        "generate-sampling": generate(do_sample=True, temperature=0.8, top_k=8, top_p=0.9, seed=0),
        "generate-beams": generate(num_beams=3),
        "serving": serve,
        "train-full": train(),
        "train-lora": train(lora=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])),
        "train-mesh": train(mesh=hfjax.make_mesh(data=2, model=4), fully_sharded=True),
        "diffusion-whole-loop": diffuse,
    }
    assert set(runs) == set(SCENARIOS)
    report = {
        "hook": _backend.active().name,
        "devices": len(jax.devices()),
        "cpu_only": sorted(_build.TARGETS),
        "scenarios": {},
    }
    for scenario, run in runs.items():
        with _compile.recording() as programs:
            run()
        records, seen = [], set()
        for recorded in programs:
            shapes = repr(jax.tree_util.tree_map(lambda x: (getattr(x, "shape", x), str(getattr(x, "dtype", ""))),
                                                 recorded.args))  # fmt: skip
            if (id(recorded.jitted), shapes, repr(recorded.kwargs)) in seen:
                continue
            seen.add((id(recorded.jitted), shapes, repr(recorded.kwargs)))
            records.append({"stage": recorded.stage, **{p: _export(recorded, p) for p in PLATFORMS}})
        report["scenarios"][scenario] = records
        print(scenario, [(r["stage"], [r[p]["error"] is None for p in PLATFORMS]) for r in records], flush=True)
    (directory / "exported.json").write_text(json.dumps(report, indent=1))


def _export(recorded, platform: str) -> dict:
    import re

    import jax

    try:
        exported = jax.export.export(recorded.jitted, platforms=(platform,))(*recorded.args, **recorded.kwargs)
    except Exception as error:  # what stops the export is the finding: kept, and the test names it
        return {"error": f"{type(error).__name__}: {str(error)[:600]}", "custom_calls": []}
    text = exported.mlir_module()
    return {"error": None, "custom_calls": sorted(set(re.findall(r"custom_call @([\w$.]+)", text)))}


if __name__ == "__main__":
    _child(pathlib.Path(sys.argv[1]))
