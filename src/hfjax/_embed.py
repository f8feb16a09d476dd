"""Sentence embeddings: pooled and normalised as a checkpoint's sentence-transformers config says.

Any text model embeds: an encoder (`feature-extraction`) through its own forward; a causal LM, a
classifier or a sequence-to-sequence model through its base model (its encoder for the latter),
compiled on first use with the model's own weights, so no logits are computed. Without a
sentence-transformers config, a decoder-only model pools its last token, as vLLM and
sentence-transformers do for decoder models; an encoder pools the mean of its tokens.
"""

from __future__ import annotations

import json
import pathlib
import weakref

import jax
import jax.numpy as jnp

from . import bridge
from ._buckets import bucket
from ._errors import LoadError

_TEXT_TASKS = ("feature-extraction", "text-generation", "text-classification", "text2text-generation")
# model -> the compiled module whose forward returns last_hidden_state (see `_hidden_module`)
_HIDDEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def embed(model, texts: str | list[str], *, batch_size: int = 32) -> jax.Array:
    """float32 [len(texts), hidden]: `model`'s last hidden states pooled per text (see `Model.embed`)."""
    if model.task not in _TEXT_TASKS:
        raise LoadError(
            f"Model.embed: {model.source} was loaded for task={model.task!r} ({type(model.module).__name__}), which "
            f"embeds no text; load a text model (tasks {', '.join(_TEXT_TASKS)}), or use "
            "hfjax.pipeline('image-feature-extraction', model=...) for images"
        )
    if model.tokenizer is None:
        raise LoadError(f"Model.embed: {model.source} has no tokenizer; pass token ids to model(...) instead")
    if isinstance(texts, str):
        texts = [texts]
    pooling, normalize = pooling_config(model.path, default=default_pooling(model.config))
    forward = _hidden_module(model)
    limit = bridge.context_length(model.config) or model.tokenizer.model_max_length
    chunks = []
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        # verbose=False: a text longer than the context is truncated below, without transformers' note.
        longest = max(len(ids) for ids in model.tokenizer(batch, verbose=False)["input_ids"])
        # Right padding: a causal model's real tokens then keep the positions they have alone.
        encoded = model.tokenizer(
            batch, padding="max_length", truncation=True, max_length=min(bucket(longest), limit),
            padding_side="right", return_tensors="np",
        )  # fmt: skip
        ids, mask = jnp.asarray(encoded["input_ids"]), jnp.asarray(encoded["attention_mask"])  # [B, S] each
        hidden = forward(input_ids=ids, attention_mask=mask).last_hidden_state.astype(jnp.float32)  # [B, S, H]
        chunks.append(pool(hidden, mask, pooling))
    embeddings = jnp.concatenate(chunks)
    if normalize:
        embeddings = embeddings / jnp.maximum(jnp.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
    return embeddings


def _hidden_module(model):
    """A callable whose output has `last_hidden_state`: the model itself for an encoder loaded for
    feature-extraction, else its base model (its encoder for a sequence-to-sequence model), compiled
    over the model's own weights."""
    if model.task == "feature-extraction":
        return model
    if model in _HIDDEN:
        return _HIDDEN[model]
    module = model.module
    if getattr(model.config, "is_encoder_decoder", False):
        inner = module.get_encoder()
    else:
        inner = module.base_model
    if inner is module:
        raise LoadError(
            f"Model.embed: {type(module).__name__} has no base model to read hidden states from; load the "
            "checkpoint with task='feature-extraction'"
        )
    prefix = next(name for name, sub in module.named_modules() if sub is inner) + "."
    names, aliases = bridge.tensor_names(inner)
    params = {name: model.params[_canonical(model, prefix + name)] for name in names}
    compiled = bridge.JittedModule(
        inner, ("forward",), params=params, aliases=aliases, matmul_precision=model.matmul_precision
    )
    _HIDDEN[model] = compiled
    return compiled


def _canonical(model, name: str) -> str:
    # A tied tensor is kept in `model.params` under its first name, which may lie outside the base model.
    return model.aliases.get(name, name)


def default_pooling(config) -> str:
    """The pooling of a checkpoint without a sentence-transformers config: the last token for a
    decoder-only model (its only token that has seen the whole text), else the mean over tokens."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    decoder_only = (
        not getattr(config, "is_encoder_decoder", False)
        and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES  # BERT-style encoders have a causal-LM head too
    )
    return "last" if decoder_only else "mean"


def pooling_config(path: pathlib.Path | None, *, default: str = "mean") -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' modules.json; `default` and L2 without one."""
    modules_file = None if path is None else path / "modules.json"
    if modules_file is None or not modules_file.is_file():
        return default, True
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
    if pooling == "last":  # the last real token, whichever side the padding is on
        length = hidden.shape[1]
        last = length - 1 - jnp.argmax(mask[:, ::-1, 0] > 0, axis=1)  # [B]
        return hidden[jnp.arange(hidden.shape[0]), last]
    return (hidden * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
