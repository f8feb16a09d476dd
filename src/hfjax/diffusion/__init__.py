"""Diffusers pipelines on JAX.

- `to_jax(pipe)`: moves a built diffusers pipeline's weights and schedulers to JAX and compiles
  its denoiser, text encoders and VAE (`_to_jax.py`);
- `load_pipeline(path)`: `DiffusionPipeline.from_pretrained` then `to_jax`;
- `whole_loop=True`: every denoising step as one XLA program (`_whole_loop.py`).

diffusers is imported when a pipeline is first used (`pip install "hfjax[diffusers]"`).

Public names: `to_jax`, `load_pipeline`.
"""

from ._to_jax import load_pipeline, to_jax

__all__ = ["load_pipeline", "to_jax"]
