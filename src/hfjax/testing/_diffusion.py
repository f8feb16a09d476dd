"""Tiny random diffusers pipelines, saved as `save_pretrained` lays them out.

Each kind is built from configs with random weights (seeded) and local tokenizers, so
tests and demos load it through `DiffusionPipeline.from_pretrained`, the path a hub
pipeline takes, with no network:

    path = save_tiny_pipeline("stable-diffusion", tmp_path / "sd")
    pipe = diffusers.DiffusionPipeline.from_pretrained(path)

Images are 32x32 pixels by default for every kind (the VAE downsamples by 2, or 1 for
Flux, whose transformer packs 2x2 latent patches itself).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any, Literal

import torch

from .. import _quiet
from ._weights import perturb_constant_parameters

PipelineKind = Literal["stable-diffusion", "sdxl", "sd-img2img", "pixart", "sd3", "flux"]
SchedulerName = Literal["pndm", "ddim", "euler", "euler-ancestral", "dpm-solver++", "flow-match-euler"]

# scheduler name -> (diffusers class name, config beyond the defaults)
SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-ancestral": ("EulerAncestralDiscreteScheduler", {}),
    "dpm-solver++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "flow-match-euler": ("FlowMatchEulerDiscreteScheduler", {}),
}
# The noise schedule Stable Diffusion 1.x/2.x ships with, for the DDPM-family schedulers.
_SD_SCHEDULE = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "steps_offset": 1,
}

_CLIP_MAX_LENGTH = 16  # tokens per prompt; CLIP checkpoints use 77, tiny ones need fewer
_T5_MAX_LENGTH = 16


def _scheduler(name: str):
    import diffusers

    if name not in SCHEDULERS:
        raise ValueError(f"save_tiny_pipeline(scheduler={name!r}): unknown scheduler; use one of {tuple(SCHEDULERS)}")
    class_name, config = SCHEDULERS[name]
    if name != "flow-match-euler":
        config = {**_SD_SCHEDULE, **config}
    return getattr(diffusers, class_name)(**config)


# ---- tokenizers and text encoders ----------------------------------------------


def clip_tokenizer():
    """A CLIP BPE tokenizer over single bytes (no merges): 3 special tokens + 512 byte tokens."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for symbol in alphabet:
        vocab.setdefault(symbol, len(vocab))
        vocab.setdefault(symbol + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=_CLIP_MAX_LENGTH)


def _clip_config(**overrides):
    from transformers import CLIPTextConfig

    sizes = dict(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        vocab_size=600,
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        projection_dim=32,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )
    return CLIPTextConfig(**{**sizes, **overrides})


def _clip_text_encoder(with_projection: bool = False, **overrides):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(_clip_config(**overrides)).eval()


def _t5_text_encoder_and_tokenizer():
    from transformers import T5EncoderModel

    from ._checkpoints import tiny_tokenizer
    from ._families import tiny_config

    config = tiny_config("t5", d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)
    tokenizer = tiny_tokenizer("t5")
    tokenizer.model_max_length = _T5_MAX_LENGTH
    return T5EncoderModel(config).eval(), tokenizer


# ---- VAEs ---------------------------------------------------------------------------


def _vae(**overrides):
    from diffusers import AutoencoderKL

    sizes = dict(
        block_out_channels=(8, 16),
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        sample_size=32,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    )
    return AutoencoderKL(**{**sizes, **overrides})


def _flow_vae(latent_channels: int):
    # SD3 and Flux VAEs: no quant convs, a shift as well as a scale.
    return _vae(
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=latent_channels,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )


# ---- pipelines --------------------------------------------------------------------


def _unet(**overrides):
    from diffusers import UNet2DConditionModel

    sizes = dict(
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=4,
    )
    return UNet2DConditionModel(**{**sizes, **overrides})


def _stable_diffusion(scheduler, cls_name: str = "StableDiffusionPipeline"):
    import diffusers

    cls = getattr(diffusers, cls_name)
    return cls(
        vae=_vae(),
        text_encoder=_clip_text_encoder(),
        tokenizer=clip_tokenizer(),
        unet=_unet(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sdxl(scheduler):
    from diffusers import StableDiffusionXLPipeline

    # The UNet's added embedding takes the pooled text (32) and 6 time ids of 8 each.
    unet = _unet(
        cross_attention_dim=64,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=80,
        transformer_layers_per_block=(1, 1),
    )
    return StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=_clip_text_encoder(),
        text_encoder_2=_clip_text_encoder(with_projection=True),
        tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
    )


def _pixart(scheduler):
    from diffusers import PixArtAlphaPipeline, PixArtTransformer2DModel

    text_encoder, tokenizer = _t5_text_encoder_and_tokenizer()
    transformer = PixArtTransformer2DModel(
        sample_size=16,
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=16,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )
    return PixArtAlphaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=_vae(), transformer=transformer, scheduler=scheduler
    )


def _sd3(scheduler):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    text_encoder_3, tokenizer_3 = _t5_text_encoder_and_tokenizer()
    # joint_attention_dim is the T5 and the (padded) CLIP hidden size; pooled = 2 x CLIP projection.
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_projection_dim=16,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=_flow_vae(latent_channels=4),
        text_encoder=_clip_text_encoder(with_projection=True),
        tokenizer=clip_tokenizer(),
        text_encoder_2=_clip_text_encoder(with_projection=True),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def _flux(scheduler):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    text_encoder_2, tokenizer_2 = _t5_text_encoder_and_tokenizer()
    # 1 latent channel, packed 2x2 into 4 transformer input channels; rope axes sum to the head size.
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=_flow_vae(latent_channels=1),
        text_encoder=_clip_text_encoder(),
        tokenizer=clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


# kind -> (builder, default scheduler)
_KINDS: dict[str, tuple[Callable, str]] = {
    "stable-diffusion": (_stable_diffusion, "pndm"),
    "sdxl": (_sdxl, "euler"),
    "sd-img2img": (lambda s: _stable_diffusion(s, "StableDiffusionImg2ImgPipeline"), "pndm"),
    "pixart": (_pixart, "ddim"),
    "sd3": (_sd3, "flow-match-euler"),
    "flux": (_flux, "flow-match-euler"),
}
PIPELINE_KINDS: tuple[str, ...] = tuple(_KINDS)


def save_tiny_pipeline(
    kind: PipelineKind,
    path: str | pathlib.Path,
    *,
    scheduler: SchedulerName | None = None,
    seed: int = 0,
) -> pathlib.Path:
    """Writes a tiny random diffusers pipeline of `kind` to `path`, as `save_pretrained` does.

    Args:
      kind: "stable-diffusion", "sdxl", "sd-img2img", "pixart", "sd3" or "flux".
      path: directory to write (created if missing).
      scheduler: one of `SCHEDULERS` ("pndm", "ddim", "euler", "euler-ancestral",
        "dpm-solver++", "flow-match-euler"); default: the kind's usual one.
      seed: torch seed for the random weights; equal calls write equal pipelines.

    Returns:
      `path` as a `pathlib.Path`.

    Example:
      >>> path = save_tiny_pipeline("stable-diffusion", "/tmp/tiny-sd", scheduler="ddim")
      >>> pipe = diffusers.DiffusionPipeline.from_pretrained(path)
    """
    if kind not in _KINDS:
        raise ValueError(f"save_tiny_pipeline: unknown kind {kind!r}; use one of {PIPELINE_KINDS}")
    build, default_scheduler = _KINDS[kind]
    with torch.random.fork_rng(devices=[]), _quiet.no_torchvision_note():
        torch.manual_seed(seed)
        pipe = build(_scheduler(scheduler or default_scheduler))
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                # diffusers zero-initialises output layers (conv_out, final projections):
                # without noise every denoiser would predict 0 and every image match.
                perturb_constant_parameters(component.eval(), std=0.02)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path)
    return path
