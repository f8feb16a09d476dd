"""`hfjax.load` and the `Model` it returns."""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from . import _loading
from ._compile import JittedModule
from ._errors import LoadError


class Model:
    """A Hugging Face model whose weights are jax.Arrays and whose forward runs compiled.

    Attributes:
      module: the transformers module (its parameters live on the meta device; the
        real weights are `params`).
      params: {parameter or buffer name: jax.Array}.
      config: the transformers config.
      tokenizer: the checkpoint's tokenizer, or None when it has no tokenizer files.
      task: the transformers pipeline task the model was loaded for.
      path: the local checkpoint directory.
    """

    def __init__(self, module, params, aliases, *, config, tokenizer, task: str, path: pathlib.Path):
        self.module = module
        self.params = params
        self.config = config
        self.tokenizer = tokenizer
        self.task = task
        self.path = path
        self.compiled = JittedModule(module, ("forward",), params=params, aliases=aliases)

    def __repr__(self):
        n = sum(int(np.prod(a.shape)) for a in self.params.values())
        dtypes = sorted({str(a.dtype) for a in self.params.values()})
        return f"hfjax.Model({type(self.module).__name__}, task={self.task!r}, params={n:,}, dtype={'/'.join(dtypes)})"

    def __call__(self, input_ids=None, attention_mask=None, **kwargs):
        """Runs the compiled forward; returns the transformers output type with jax.Array fields.

        Example:
          >>> out = model(jnp.array([[1, 2, 3]]))
          >>> out.logits.shape  # (1, 3, vocab)
        """
        if input_ids is not None:
            kwargs["input_ids"] = input_ids
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return self.compiled(**kwargs)

    def eager(self, input_ids=None, attention_mask=None, **kwargs):
        """The same forward run op by op through torchax, without jit (for debugging)."""
        if input_ids is not None:
            kwargs["input_ids"] = input_ids
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return self.compiled.eager("forward")(**kwargs)

    def embed(self, texts: str | list[str], *, batch_size: int = 32) -> jax.Array:
        """Sentence embeddings, pooled and normalised as the checkpoint's sentence-transformers config says.

        Without such a config: mean pooling over tokens, then L2 normalisation.

        Returns:
          float32 jax.Array of shape [len(texts), hidden_size].

        Example:
          >>> model = hfjax.load("path/to/encoder", task="feature-extraction")
          >>> model.embed(["a cat", "a dog"]).shape  # (2, hidden)
        """
        if self.tokenizer is None:
            raise LoadError(f"Model.embed: the checkpoint at {str(self.path)!r} has no tokenizer files; pass token ids to model(...) instead")
        if isinstance(texts, str):
            texts = [texts]
        pooling, normalize = _pooling_config(self.path)
        chunks = []
        for start in range(0, len(texts), batch_size):
            batch = texts[start : start + batch_size]
            encoded = self.tokenizer(batch, padding="max_length", truncation=True, max_length=self._bucket(batch), return_tensors="np")
            out = self(jnp.asarray(encoded["input_ids"]), attention_mask=jnp.asarray(encoded["attention_mask"]))
            hidden = out.last_hidden_state.astype(jnp.float32)  # [B, S, H]
            chunks.append(_pool(hidden, jnp.asarray(encoded["attention_mask"]), pooling))
        embeddings = jnp.concatenate(chunks)
        if normalize:
            embeddings = embeddings / jnp.maximum(jnp.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
        return embeddings

    def _bucket(self, texts: list[str]) -> int:
        # Padding to a power of two keeps the number of compiled shapes small.
        longest = max(len(ids) for ids in self.tokenizer(texts)["input_ids"])
        limit = getattr(self.config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        bucket = 16
        while bucket < longest:
            bucket *= 2
        return min(bucket, limit)


def _pooling_config(path: pathlib.Path) -> tuple[str, bool]:
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "mean", True
    modules = json.loads(modules_file.read_text())
    pooling, normalize = "mean", False
    for entry in modules:
        kind = entry.get("type", "")
        if kind.endswith("Pooling"):
            config = json.loads((path / entry["path"] / "config.json").read_text())
            for mode in ("cls_token", "max_tokens", "mean_tokens", "lasttoken"):
                if config.get(f"pooling_mode_{mode}"):
                    pooling = {"cls_token": "cls", "max_tokens": "max", "mean_tokens": "mean", "lasttoken": "last"}[mode]
                    break
        if kind.endswith("Normalize"):
            normalize = True
    return pooling, normalize


def _pool(hidden: jax.Array, mask: jax.Array, pooling: str) -> jax.Array:
    # hidden: [B, S, H], mask: [B, S] -> [B, H]
    mask = mask.astype(hidden.dtype)[..., None]
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "max":
        return jnp.max(jnp.where(mask > 0, hidden, -jnp.inf), axis=1)
    if pooling == "last":
        last = jnp.maximum(mask[..., 0].sum(axis=1).astype(jnp.int32) - 1, 0)
        return hidden[jnp.arange(hidden.shape[0]), last]
    return (hidden * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)


def load(
    path_or_hub_id: str | os.PathLike,
    *,
    task: str | None = None,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    progress: bool | None = None,
) -> Model:
    """Loads a Hugging Face checkpoint onto JAX.

    Args:
      path_or_hub_id: a local checkpoint directory (config.json + *.safetensors), or a
        hub id such as "org/name" where the Hugging Face Hub is reachable.
      task: "text-generation", "text-classification", "feature-extraction" or
        "text2text-generation"; default: inferred from config.architectures.
      dtype: "float32", "bfloat16" or "float16"; default: the checkpoint's.
      mesh: a `jax.sharding.Mesh` to place weights on; accepted now, used by sharding.
      progress: show a progress bar while reading weights (default: for large checkpoints).

    Returns:
      A `Model`: call it for the compiled forward; `.params`, `.module`, `.config`,
      `.tokenizer`, and `.embed(texts)` for feature extraction.

    Example:
      >>> model = hfjax.load("./tiny-llama")
      >>> model(jnp.array([[1, 2, 3]])).logits.shape
    """
    _loading.check_dtype(dtype)
    if task is not None and task not in _loading.TASKS:
        raise LoadError(f"hfjax.load: task={task!r} is not supported; use one of {_loading.TASKS} or None (inferred)")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise LoadError(f"hfjax.load: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    path = _loading.resolve(path_or_hub_id)
    config = _loading.read_config(path)
    task = task or _loading.infer_task(config)
    files = _loading.weight_files(path)
    dtype = dtype or _loading._checkpoint_dtype(files)
    module = _loading.build_skeleton(config, task, dtype)
    params, aliases = _loading.load_weights(module, files, dtype, progress=progress)
    return Model(module, params, aliases, config=config, tokenizer=_tokenizer(path), task=task, path=path)


def _tokenizer(path: pathlib.Path):
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
