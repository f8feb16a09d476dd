"""Diffusers pipelines on JAX: `to_jax(pipe)` and `load_pipeline(path)`.

A diffusers pipeline is not an nn.Module: its components are. `to_jax` moves every
module's weights into jax.Arrays (torchax tensors), moves the tensors that schedulers
and other plain components hold, and swaps the heavy modules for `hfjax.jit` wrappers:
the denoiser (UNet or transformer) and text encoders by `forward`, the VAE by `decode`
and `encode`. The pipeline's own `__call__` then runs unchanged inside the torchax
environment, so its arguments, progress bar and output types stay diffusers'.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import jax
import torch
from torchax.tensor import Tensor as JaxTensor

from .. import _backend, _dtypes, _quiet, bridge, parallel
from .._errors import PipelineError
from ..bridge import JittedModule
from . import _whole_loop

logger = logging.getLogger("hfjax")

WholeLoop = Literal[False, True, "auto"]
_WHOLE_LOOP_VALUES = (False, True, "auto")


# ---- components ------------------------------------------------------------------


def _move_module(module: torch.nn.Module) -> None:
    environment = bridge.env()
    module._apply(lambda t: t if isinstance(t, JaxTensor) else JaxTensor(bridge.to_jax(t), environment))


class _JittedVae(JittedModule):
    """A VAE whose `decode` and `encode` are compiled; `decode` ignores the unused generator."""

    def decode(self, z, return_dict: bool = True, generator=None):
        # Pipelines pass their torch.Generator to decode, which samples nothing with it; a
        # generator is no array, so it would be a compile-time constant: one program each.
        return self._call("decode", (z,), {"return_dict": return_dict}, compiled=True)


def _register_vae_outputs() -> None:
    from diffusers.models.autoencoders import vae

    from ..bridge import register_stateful

    register_stateful(vae.DiagonalGaussianDistribution)  # AutoencoderKLOutput.latent_dist


class _OnMesh:
    """A compiled component on a device mesh: weights replicated on every device, and each
    array argument's leading (batch) axis split over "data" where it divides."""

    def _program(self, method: str, args: tuple, kwargs: dict, precision: str | None = None):
        program, dynamic = super()._program(method, args, kwargs, precision)
        return program, [jax.device_put(x, parallel.batch_sharding(self._mesh, x.shape)) for x in dynamic]


class _JittedOnMesh(_OnMesh, JittedModule):
    pass


class _JittedVaeOnMesh(_OnMesh, _JittedVae):
    pass


def _torch_copy(component: JittedModule) -> torch.nn.Module:
    """A torch module on the CPU like the one `component` compiles, holding its current weights
    in torch's own layout (parametrized weights evaluated), for `save_pretrained`."""
    module = component.module
    state = bridge.env().j2t_copy(bridge.with_aliases(component.params, component._aliases))
    held = ".parametrizations.weight.original"
    for name in [n for n in state if n.endswith(held)]:
        owner = name.removesuffix(held)
        value = state.pop(name)
        for parametrization in module.get_submodule(owner).parametrizations.weight:
            value = parametrization(value)
        state[owner + ".weight"] = value
    cls = type(module)
    with torch.device("meta"):  # no random init: every weight is assigned below
        fresh = cls.from_config(module.config) if hasattr(cls, "from_config") else cls(module.config)
    missing, _ = fresh.load_state_dict(state, strict=False, assign=True)
    if missing:
        raise PipelineError(f"save_pretrained: hfjax holds no weights for {type(module).__name__}'s {missing[:5]}")
    return fresh.eval()


def _compiled_component(name: str, module: torch.nn.Module, mesh=None, matmul_precision=None) -> JittedModule:
    cls = type(module)
    if callable(getattr(cls, "decode", None)) and not name.startswith(_whole_loop.DENOISERS):
        methods = [m for m in ("decode", "encode") if callable(getattr(cls, m, None))]
        kind = _JittedVae if mesh is None else _JittedVaeOnMesh
    else:
        methods = ("forward",)
        kind = JittedModule if mesh is None else _JittedOnMesh
    component = kind(module, methods, matmul_precision=matmul_precision)
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        object.__setattr__(component, "params", jax.device_put(component.params, replicated))
        object.__setattr__(component, "_mesh", mesh)
    return component


# ---- the pipeline class running on JAX --------------------------------------------


@functools.cache
def _on_jax_class(cls: type) -> type:
    # A subclass with the same name, so isinstance, save_pretrained's `_class_name` and
    # the signature of __call__ stay those of the diffusers class.
    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        _check_size(self, kwargs)
        precision = bridge.resolve_precision(self.hfjax_matmul_precision)  # of the steps run op by op too
        with bridge.env(), bridge.products(precision), _whole_loop.session(self, kwargs) as session:
            out = cls.__call__(self, *args, **kwargs)
        self.hfjax_path = session.path
        logger.info("hfjax: %s ran on JAX, %s", cls.__name__, session.describe())
        return out

    @functools.wraps(cls.save_pretrained)
    def save_pretrained(self, save_directory, *args, **kwargs):
        # diffusers saves only the component classes it knows, so the compiled ones are
        # swapped for torch copies of their weights while it writes.
        compiled = {name: value for name, value in vars(self).items() if isinstance(value, JittedModule)}
        try:
            for name, component in compiled.items():
                object.__setattr__(self, name, _torch_copy(component))
            return cls.save_pretrained(self, save_directory, *args, **kwargs)
        finally:
            for name, component in compiled.items():
                object.__setattr__(self, name, component)

    namespace = {
        "__call__": __call__,
        "save_pretrained": save_pretrained,
        "__module__": cls.__module__,
        "_hfjax_on_jax": True,
    }
    return type(cls.__name__, (cls,), namespace)


def _size_multiple(pipe) -> int:
    multiple = int(getattr(pipe, "vae_scale_factor", 1) or 1)
    denoiser = next((getattr(pipe, n) for n in _whole_loop.DENOISERS if getattr(pipe, n, None) is not None), None)
    patch = getattr(getattr(denoiser, "config", None), "patch_size", None) or 1
    if hasattr(pipe, "_pack_latents"):  # Flux-style pipelines pack 2x2 latent patches
        patch = 2
    return multiple * int(patch)


def _check_size(pipe, kwargs: dict) -> None:
    multiple = _size_multiple(pipe)
    for name in ("height", "width"):
        value = kwargs.get(name)
        if value is not None and (not isinstance(value, int) or value <= 0 or value % multiple):
            lower = max(multiple, (int(value) // multiple) * multiple) if isinstance(value, int) else multiple
            raise PipelineError(
                f"{type(pipe).__name__}(..., {name}={value!r}): the VAE and denoiser take sizes that are "
                f"multiples of {multiple} pixels; pass {name}={lower} or {lower + multiple}"
            )


# ---- public API ------------------------------------------------------------------


def to_jax(pipe, *, whole_loop: WholeLoop = False, mesh=None, matmul_precision: bridge.Precision | None = None):
    """Makes a diffusers pipeline run on JAX, its heavy parts compiled by XLA.

    Moves every nn.Module component's weights and every tensor held by other
    components (schedulers) to JAX, and compiles the denoiser (UNet or transformer),
    the text encoder(s) and the VAE's `decode` and `encode` with `hfjax.jit`. The
    pipeline's `__call__` keeps diffusers' arguments (prompt, negative_prompt,
    num_inference_steps, guidance_scale, generator or latents, output_type, ...).

    Args:
      pipe: a built `diffusers.DiffusionPipeline`; changed in place.
      whole_loop: False (default) runs each step as a compiled denoiser call plus the
        scheduler's arithmetic op by op. True or "auto" compile all steps (denoiser,
        guidance, scheduler) as one XLA program where the pipeline and scheduler allow
        it, and fall back to per-step otherwise (True logs a warning, "auto" an info
        line). `pipe.hfjax_whole_loop` may be changed between calls.
      mesh: a `jax.sharding.Mesh` with a "data" axis (see `hfjax.make_mesh`): the weights are
        replicated on its devices and each compiled call's batch (images, and their
        classifier-free-guidance copies) is split over "data" where it divides.
      matmul_precision: the precision of float32 products and convolutions, as
        `torch.set_float32_matmul_precision` names it ("highest", "high", "medium"); None follows
        torch's setting when each program is built ("highest" unless changed: as PyTorch on the CPU).

    Returns:
      `pipe`, now running on JAX (`save_pretrained` still writes a diffusers pipeline,
      with the weights it holds); after each call `pipe.hfjax_path` is "per-step" or
      "whole-loop", the path that call took (also logged to the "hfjax" logger).

    Example:
      >>> pipe = hfjax.to_jax(diffusers.DiffusionPipeline.from_pretrained(path))
      >>> image = pipe("a cat", num_inference_steps=20).images[0]
    """
    DiffusionPipeline = _diffusers().DiffusionPipeline
    if not isinstance(pipe, DiffusionPipeline):
        hint = "; for a single torch module use hfjax.jit(module)" if isinstance(pipe, torch.nn.Module) else ""
        raise PipelineError(
            f"hfjax.to_jax expects a diffusers pipeline (a DiffusionPipeline), got {type(pipe).__name__}{hint}"
        )
    if whole_loop not in _WHOLE_LOOP_VALUES:
        raise PipelineError(f"hfjax.to_jax(whole_loop={whole_loop!r}): use one of {_WHOLE_LOOP_VALUES}")
    parallel.check_mesh(mesh, caller="hfjax.to_jax")
    bridge.check_precision(matmul_precision, caller="hfjax.to_jax", error=PipelineError)
    if getattr(type(pipe), "_hfjax_on_jax", False):
        return pipe
    _register_vae_outputs()
    backend = _backend.active()
    backend.prepare()
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            backend.prepare_module(component)
            _move_module(component)
            # Past DiffusionPipeline.__setattr__, which would record JittedModule in model_index.json.
            object.__setattr__(pipe, name, _compiled_component(name, component, mesh, matmul_precision))
        elif component is not None and hasattr(component, "__dict__"):
            bridge.move_tensors(component)
    pipe.__class__ = _on_jax_class(type(pipe))
    pipe.hfjax_path = "per-step"
    pipe.hfjax_whole_loop = whole_loop  # may be changed between calls
    pipe.hfjax_matmul_precision = matmul_precision
    _whole_loop.install(pipe)
    return pipe


def load_pipeline(
    path_or_hub_id: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh=None,
    whole_loop: WholeLoop = False,
    matmul_precision: bridge.Precision | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
):
    """Loads a diffusers pipeline (a local directory or a hub id) and runs it on JAX.

    `diffusers.DiffusionPipeline.from_pretrained` followed by `to_jax`.

    Args:
      path_or_hub_id: a directory holding model_index.json, or a Hugging Face Hub id "org/name"
        (downloaded into huggingface_hub's cache: each component's config and safetensors).
      dtype: "float32", "bfloat16" or "float16" (or a torch / jnp dtype); "auto" or None: the checkpoint's.
      mesh: a `jax.sharding.Mesh`: as for `to_jax`.
      whole_loop: as for `to_jax`.
      matmul_precision: as for `to_jax`.
      revision, token: for a hub id, as for `hfjax.load`.

    Returns:
      The pipeline, running on JAX.

    Example:
      >>> pipe = hfjax.load_pipeline("./tiny-sd")
      >>> pipe("a cat", num_inference_steps=2, height=32, width=32).images[0].size
      (32, 32)
    """
    dtype = _dtypes.resolve(dtype, caller="hfjax.load_pipeline")
    parallel.check_mesh(mesh, caller="hfjax.load_pipeline")
    path = bridge.resolve_checkpoint(
        path_or_hub_id, revision=revision, token=token, kind="pipeline", caller="hfjax.load_pipeline"
    )
    DiffusionPipeline = _diffusers().DiffusionPipeline
    options = {"torch_dtype": _dtypes.torch_dtype(dtype)} if dtype else {}
    with _quiet.no_torchvision_note():
        pipe = DiffusionPipeline.from_pretrained(path, **options)
    return to_jax(pipe, whole_loop=whole_loop, mesh=mesh, matmul_precision=matmul_precision)


def _diffusers():
    try:
        import diffusers
    except ImportError:
        raise ImportError(
            'hfjax\'s diffusion pipelines need diffusers; install it with `pip install "hfjax[diffusers]"`'
        ) from None
    return diffusers
