"""Sentence embeddings: pooled and normalised as a checkpoint's sentence-transformers config says."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp

from ._buckets import bucket
from ._errors import LoadError
from ._loading import context_length


def embed(model, texts: str | list[str], *, batch_size: int = 32) -> jax.Array:
    """float32 [len(texts), hidden]: `model`'s last hidden states pooled per text (see `Model.embed`)."""
    if model.tokenizer is None:
        raise LoadError(f"Model.embed: {model.source} has no tokenizer; pass token ids to model(...) instead")
    if isinstance(texts, str):
        texts = [texts]
    pooling, normalize = pooling_config(model.path)
    limit = context_length(model.config) or model.tokenizer.model_max_length
    chunks = []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        longest = max(len(ids) for ids in model.tokenizer(batch)["input_ids"])
        encoded = model.tokenizer(
            batch, padding="max_length", truncation=True, max_length=min(bucket(longest), limit), return_tensors="np"
        )
        out = model(jnp.asarray(encoded["input_ids"]), attention_mask=jnp.asarray(encoded["attention_mask"]))
        hidden = out.last_hidden_state.astype(jnp.float32)  # [B, S, H]
        chunks.append(pool(hidden, jnp.asarray(encoded["attention_mask"]), pooling))
    embeddings = jnp.concatenate(chunks)
    if normalize:
        embeddings = embeddings / jnp.maximum(jnp.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
    return embeddings


def pooling_config(path: pathlib.Path | None) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' modules.json; mean pooling and L2 without one."""
    modules_file = None if path is None else path / "modules.json"
    if modules_file is None or not modules_file.is_file():
        return "mean", True
    modules = json.loads(modules_file.read_text())
    pooling, normalize = "mean", False
    for entry in modules:
        kind = entry.get("type", "")
        if kind.endswith("Pooling"):
            config = json.loads((path / entry["path"] / "config.json").read_text())
            for mode in ("cls_token", "max_tokens", "mean_tokens", "lasttoken"):
                if config.get(f"pooling_mode_{mode}"):
                    pooling = {"cls_token": "cls", "max_tokens": "max", "mean_tokens": "mean", "lasttoken": "last"}[
                        mode
                    ]
                    break
        if kind.endswith("Normalize"):
            normalize = True
    return pooling, normalize


def pool(hidden: jax.Array, mask: jax.Array, pooling: str) -> jax.Array:
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
