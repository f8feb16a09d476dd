"""Diffusers pipelines on JAX: the same image as diffusers in PyTorch, from the same latents.

Tiny pipelines (hfjax.testing.save_tiny_pipeline) are saved to disk and loaded through
`DiffusionPipeline.from_pretrained`, once by diffusers for the reference and once by
`hfjax.load_pipeline`. Both get the same starting latents (or init image) and a
generator seeded alike, so Euler ancestral's per-step noise, drawn on the CPU from that
generator in both, matches too. Images are compared by PSNR against the one bound in
`hfjax.tolerances`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.utils import parametrize

pytest.importorskip("diffusers")

import diffusers  # noqa: E402

import hfjax  # noqa: E402
from hfjax import JittedModule, tolerances  # noqa: E402
from hfjax.testing import save_tiny_pipeline  # noqa: E402

STEPS = 3
SIZE = 32  # pixels


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(kind, scheduler) -> directory of a tiny pipeline (written once per module)."""
    made = {}

    def make(kind: str, scheduler: str | None = None):
        if (kind, scheduler) not in made:
            path = tmp_path_factory.mktemp(f"{kind}-{scheduler or 'default'}")
            made[kind, scheduler] = save_tiny_pipeline(kind, path, scheduler=scheduler)
        return made[kind, scheduler]

    return make


@pytest.fixture(scope="module")
def on_jax(saved):
    """on_jax(kind, scheduler) -> the pipeline loaded by hfjax (cached, so programs compile once)."""
    loaded = {}

    def make(kind: str, scheduler: str | None = None):
        if (kind, scheduler) not in loaded:
            pipe = hfjax.load_pipeline(saved(kind, scheduler))
            pipe.set_progress_bar_config(disable=True)
            loaded[kind, scheduler] = pipe
        return loaded[kind, scheduler]

    return make


def _inputs(pipe, kind: str) -> dict:
    options = dict(
        prompt="a red cat on a mat",
        negative_prompt="blurry",
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )
    if kind == "sd-img2img":
        options["image"] = torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
        return options
    options.update(height=SIZE, width=SIZE)
    if kind == "pixart":
        options["use_resolution_binning"] = False  # tiny transformers have no binned aspect ratios
    if kind == "flux":
        options.pop("negative_prompt")  # Flux's negative prompt switches on "true CFG", a second pass
        # Flux packs 2x2 latent patches: [batch, (h/2)(w/2), 4 * latent channels]; its tiny VAE keeps the size.
        shape = (1, (SIZE // 2) ** 2, pipe.transformer.config.in_channels)
    else:
        channels = (pipe.unet if hasattr(pipe, "unet") else pipe.transformer).config.in_channels
        factor = pipe.vae_scale_factor
        shape = (1, channels, SIZE // factor, SIZE // factor)
    options["latents"] = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    return options


def _reference(saved, kind: str, scheduler: str | None) -> np.ndarray:
    pipe = diffusers.DiffusionPipeline.from_pretrained(saved(kind, scheduler))
    pipe.set_progress_bar_config(disable=True)
    return pipe(**_inputs(pipe, kind)).images


def _psnr(reference: np.ndarray, actual: np.ndarray) -> float:
    assert reference.shape == actual.shape
    mse = float(np.mean((reference.astype(np.float64) - actual.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def _image(on_jax, kind: str, scheduler: str | None, whole_loop) -> tuple[np.ndarray, str]:
    pipe = on_jax(kind, scheduler)
    pipe.hfjax_whole_loop = whole_loop
    images = pipe(**_inputs(pipe, kind)).images
    return images, pipe.hfjax_path


CASES = [
    ("stable-diffusion", "pndm"),
    ("stable-diffusion", "ddim"),
    ("stable-diffusion", "euler"),
    ("stable-diffusion", "euler-ancestral"),
    ("stable-diffusion", "dpm-solver++"),
    ("sd3", "flow-match-euler"),
    ("sdxl", None),
    ("sd-img2img", None),
    ("pixart", None),
    ("flux", None),
]


@pytest.mark.parametrize("kind, scheduler", CASES, ids=[f"{k}-{s or 'default'}" for k, s in CASES])
def test_image_matches_pytorch_per_step_and_whole_loop(saved, on_jax, kind, scheduler):
    reference = _reference(saved, kind, scheduler)
    assert reference.std() > 0.01, "the tiny pipeline draws a flat image; the comparison would prove nothing"
    per_step, path = _image(on_jax, kind, scheduler, whole_loop=False)
    assert path == "per-step"
    assert _psnr(reference, per_step) >= tolerances.IMAGE_PSNR_DB.atol
    whole, path = _image(on_jax, kind, scheduler, whole_loop=True)
    assert path == "whole-loop"
    assert _psnr(reference, whole) >= tolerances.IMAGE_PSNR_DB.atol


def test_calls_after_the_first_do_not_recompile(on_jax):
    pipe = on_jax("stable-diffusion", "pndm")
    pipe.hfjax_whole_loop = False
    pipe(**_inputs(pipe, "stable-diffusion"))
    counts = {name: getattr(pipe, name).compile_count for name in ("unet", "text_encoder", "vae")}
    pipe(**{**_inputs(pipe, "stable-diffusion"), "prompt": "another prompt", "guidance_scale": 3.0})
    assert {name: getattr(pipe, name).compile_count for name in counts} == counts


@pytest.mark.cpu_hook
def test_convolution_weights_are_held_channels_last_on_cpu(on_jax):
    # So the compiled UNet and VAE copy no weights per call (hfjax.cpu's store_convolutions_channels_last).
    pipe = on_jax("stable-diffusion", "pndm")
    for name in ("unet", "vae"):
        convs = [m for m in pipe.components[name].module.modules() if isinstance(m, torch.nn.Conv2d)]
        assert convs and all(parametrize.is_parametrized(conv, "weight") for conv in convs), name
        held = convs[0].parametrizations.weight.original
        assert held.shape == (*convs[0].kernel_size, convs[0].in_channels // convs[0].groups, convs[0].out_channels)


def test_whole_loop_falls_back_per_step_and_says_why(on_jax, caplog):
    pipe = on_jax("stable-diffusion", "pndm")
    pipe.hfjax_whole_loop = "auto"
    with caplog.at_level("INFO", logger="hfjax"):
        pipe(**{**_inputs(pipe, "stable-diffusion"), "num_inference_steps": 1})
    assert pipe.hfjax_path == "per-step"
    assert any("runs per step" in r.message and "2 or more" in r.getMessage() for r in caplog.records)


def test_to_jax_rejects_what_is_not_a_pipeline():
    unet = torch.nn.Linear(2, 2)
    with pytest.raises(
        hfjax.PipelineError, match=r"hfjax.to_jax expects a diffusers pipeline .* got Linear; .*hfjax.jit"
    ):
        hfjax.to_jax(unet)


def test_a_size_the_vae_cannot_take_is_one_clear_line(on_jax):
    pipe = on_jax("stable-diffusion", "pndm")
    with pytest.raises(hfjax.PipelineError) as error:
        pipe("a cat", height=33, width=32, num_inference_steps=2)
    message = str(error.value)
    assert "\n" not in message
    assert "height=33" in message and "multiples of 2" in message and "height=32" in message


def test_load_pipeline_names_a_directory_without_model_index(tmp_path):
    with pytest.raises(hfjax.LoadError, match="no model_index.json"):
        hfjax.load_pipeline(tmp_path)


def test_cli_writes_a_png_of_the_asked_size(saved, tmp_path, capsys):
    from PIL import Image

    from hfjax.cli import image

    parser = __import__("argparse").ArgumentParser()
    image.add_parser(parser.add_subparsers())
    out = tmp_path / "cat.png"
    args = parser.parse_args(
        [
            "image",
            "--model",
            str(saved("stable-diffusion", "pndm")),
            "a red cat",
            "--steps",
            "2",
            "--height",
            "48",
            "--width",
            "32",
            "--out",
            str(out),
            "--stats",
        ]
    )
    assert image.run(args) == 0
    printed = capsys.readouterr().out
    assert "time per image" in printed
    with Image.open(out) as png:
        assert png.format == "PNG" and png.size == (32, 48)


@pytest.mark.parametrize("kind", ["stable-diffusion", "sdxl", "sd3", "pixart", "flux"])
def test_save_pretrained_after_to_jax_writes_the_same_pipeline(saved, on_jax, tmp_path, kind):
    path = saved(kind)
    pipe = on_jax(kind)
    pipe.save_pretrained(tmp_path / "saved")
    original = diffusers.DiffusionPipeline.from_pretrained(path)
    reloaded = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "saved")
    for name, module in original.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        expected, written = module.state_dict(), getattr(reloaded, name).state_dict()
        assert expected.keys() == written.keys(), name
        for key, tensor in expected.items():
            torch.testing.assert_close(written[key], tensor, rtol=0, atol=0, msg=f"{name}.{key}")
    # The pipeline still runs on JAX after saving.
    assert all(
        not isinstance(pipe.components[name], torch.nn.Module) or isinstance(getattr(pipe, name), JittedModule)
        for name in pipe.components
    )
    assert pipe(**_inputs(pipe, kind)).images.shape[1:3] == (SIZE, SIZE)
