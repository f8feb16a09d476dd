"""Text classification: a sequence-classification head, or zero-shot label scoring with a causal LM.

With a causal LM each label is scored as a continuation of a prompt built from the text:
log P(" positive" | "Text: ...\\nAnswer:") summed over the label's tokens, then a softmax
over the labels. Every (text, label) pair runs in one right-padded compiled forward.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import bridge
from ._buckets import bucket
from .bridge import context_length

DEFAULT_TEMPLATE = "Text: {text}\nQuestion: which of {labels} describes the text?\nAnswer:"
_TEMPLATE_FIELDS = ("text", "labels")
_MULTI_LABEL = "multi_label_classification"


def classify(
    model,
    texts: str | Sequence[str],
    labels: Sequence[str] | None = None,
    *,
    template: str | None = None,
    batch_size: int = 16,
) -> list[dict[str, float]]:
    """Label probabilities for each text.

    A model loaded with task "text-classification" uses its head: a softmax over its logits
    (a sigmoid per label for multi-label heads), labels named by `config.id2label`. A causal
    LM ("text-generation") classifies zero-shot: each label is scored by the log-probability
    of " label" after `template` filled with the text, and the scores go through a softmax.

    Args:
      model: an `hfjax.Model` with a tokenizer.
      texts: one text or a list of texts.
      labels: with a classification head, new names for its labels (as many as it has);
        with a causal LM, the candidate labels (required).
      template: causal LM only; a prompt with a `{text}` field and optionally a `{labels}`
        field (the labels joined by ", "). Default: `DEFAULT_TEMPLATE`.
      batch_size: rows per compiled forward; a causal LM uses one row per (text, label) pair.

    Returns:
      One dict per text, {label: probability}, keys in label order.

    Example:
      >>> model = hfjax.load("path/to/causal-lm")
      >>> classify(model, ["I loved it"], ["positive", "negative"])
      [{'positive': 0.83, 'negative': 0.17}]
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        return []
    labels = None if labels is None else _check_labels(labels)
    if model.tokenizer is None:
        raise ValueError(f"classify: {model.source} has no tokenizer, so texts cannot be encoded")
    if batch_size < 1:
        raise ValueError(f"classify: batch_size should be >= 1. Got: {batch_size}")
    if model.task == "text-classification":
        if template is not None:
            raise ValueError(
                "classify: template= only applies to zero-shot classification with a causal LM; "
                f"this model has a classification head ({type(model.module).__name__}). Drop template=."
            )
        return _classify_with_head(model, texts, labels, batch_size)
    if model.task == "text-generation":
        if labels is None:
            raise ValueError(
                "classify: zero-shot classification with a causal LM needs candidate labels, "
                "e.g. classify(model, texts, labels=['positive', 'negative'])"
            )
        template = DEFAULT_TEMPLATE if template is None else _check_template(template)
        scores = label_log_likelihoods(model, texts, labels, template=template, batch_size=batch_size)
        probs = np.asarray(jax.nn.softmax(jnp.asarray(scores), axis=-1))
        return [dict(zip(labels, map(float, row))) for row in probs]
    raise ValueError(
        f"classify: needs a classification head (load with task='text-classification') or a causal LM "
        f"(task='text-generation'); this model was loaded with task={model.task!r} "
        f"({type(model.module).__name__})"
    )


def label_log_likelihoods(
    model, texts: list[str], labels: list[str], *, template: str = DEFAULT_TEMPLATE, batch_size: int = 16
) -> np.ndarray:
    """log P(label | prompt) summed over each label's tokens: float32 [len(texts), len(labels)]."""
    rows, spans = [], []  # one row per (text, label); spans[i]: where row i's label tokens start
    for text in texts:
        prompt = template.format(text=text, labels=", ".join(labels))
        for ids, start in _prompt_and_label_ids(model.tokenizer, prompt, labels):
            rows.append(ids)
            spans.append(start)
    _check_lengths(model, rows, texts, per_text=len(labels))
    pad_id = _pad_id(model)
    scores = []
    for first in range(0, len(rows), batch_size):
        chunk = rows[first : first + batch_size]
        ids, mask = _pad_rows(chunk, pad_id, batch_size, context_length(model.config))
        weights = np.zeros(ids.shape, np.float32)  # 1 where a label token is predicted
        for i, (row, start) in enumerate(zip(chunk, spans[first : first + batch_size])):
            weights[i, start : len(row)] = 1.0
        logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits  # [B, L, V]
        scores.append(np.asarray(_continuation_log_prob(logits, jnp.asarray(ids), jnp.asarray(weights)))[: len(chunk)])
    return np.concatenate(scores).reshape(len(texts), len(labels))


@functools.partial(bridge.jit_program, stage="label scores")
def _continuation_log_prob(logits: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
    # logits: [B, L, V] predict ids[:, 1:]; weights: [B, L] -> [B]
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, ids[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    return (picked * weights[:, 1:]).sum(axis=-1)


def _prompt_and_label_ids(tokenizer, prompt: str, labels: list[str]) -> list[tuple[list[int], int]]:
    # A label's tokens are what encoding prompt + label adds to encoding the prompt alone,
    # with the prompt's trailing whitespace moved onto the label (as lm-evaluation-harness does),
    # so a tokenizer that merges across the boundary still gives the label its own tokens.
    context = prompt.rstrip()
    gap = prompt[len(context) :] or " "
    bare = tokenizer(context, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(context)["input_ids"]  # with the tokenizer's special tokens (BOS)
    rows = []
    wholes = tokenizer([context + gap + label for label in labels], add_special_tokens=False)["input_ids"]
    for label, whole in zip(labels, wholes):
        label_ids = whole[len(bare) :]
        if not label_ids:
            raise ValueError(f"classify: label {label!r} encodes to no tokens after the prompt; use a non-empty label")
        rows.append((prompt_ids + label_ids, len(prompt_ids)))
    return rows


def _classify_with_head(model, texts: list[str], labels: list[str] | None, batch_size: int) -> list[dict[str, float]]:
    config = model.config
    names = [config.id2label[i] for i in range(config.num_labels)]
    if labels is not None:
        if len(labels) != len(names):
            raise ValueError(
                f"classify: the model's head has {len(names)} labels {names}; labels= should name as many. "
                f"Got {len(labels)}: {labels}"
            )
        names = labels
    rows = model.tokenizer(texts)["input_ids"]
    _check_lengths(model, rows, texts, per_text=1)
    pad_id = config.get_text_config().pad_token_id
    # Without a pad id the head pools the last position, so rows must not be padded.
    per_call = batch_size if pad_id is not None else 1
    logits = []
    for first in range(0, len(rows), per_call):
        chunk = rows[first : first + per_call]
        if pad_id is None:
            ids, mask = np.asarray(chunk, np.int32), np.ones((1, len(chunk[0])), np.int32)
        else:
            ids, mask = _pad_rows(chunk, pad_id, batch_size, context_length(model.config))
        out = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits  # [B, num_labels]
        logits.append(np.asarray(out, np.float32)[: len(chunk)])
    logits = jnp.asarray(np.concatenate(logits))
    multi = config.problem_type == _MULTI_LABEL or config.num_labels == 1
    probs = np.asarray(jax.nn.sigmoid(logits) if multi else jax.nn.softmax(logits, axis=-1))
    return [dict(zip(names, map(float, row))) for row in probs]


def _pad_rows(rows: list[list[int]], pad_id: int, max_rows: int, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    # Right-pads to power-of-two lengths and row counts, so few shapes are compiled; extra
    # rows repeat the first one. Returns int32 ids and attention mask, both [B, L].
    length = bucket(max(len(row) for row in rows), smallest=16, limit=limit)
    count = bucket(len(rows), smallest=1, limit=max_rows)
    ids = np.full((count, length), pad_id, np.int32)
    mask = np.zeros((count, length), np.int32)
    for i in range(count):
        row = rows[i] if i < len(rows) else rows[0]
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def _check_lengths(model, rows: list[list[int]], texts: list[str], *, per_text: int) -> None:
    limit = context_length(model.config)
    for i, row in enumerate(rows):
        if limit and len(row) > limit:
            text = texts[i // per_text]
            raise ValueError(
                f"classify: text {i // per_text} ({text[:40]!r}...) needs {len(row)} tokens, more than the model's "
                f"context of {limit}; shorten the text"
            )


def _pad_id(model) -> int:
    for candidate in (
        model.config.get_text_config().pad_token_id,
        model.tokenizer.pad_token_id,
        model.tokenizer.eos_token_id,
    ):
        if candidate is not None:
            return int(candidate)
    return 0


def _check_labels(labels: Sequence[str]) -> list[str]:
    if isinstance(labels, str):
        raise ValueError(
            f"classify: labels should be a list of strings. Got the string {labels!r}; pass {labels.split(',')!r}"
        )
    labels = list(labels)
    if not labels:
        raise ValueError("classify: labels is empty; pass at least one label, e.g. labels=['positive', 'negative']")
    bad = [label for label in labels if not isinstance(label, str) or not label.strip()]
    if bad:
        raise ValueError(f"classify: every label should be a non-empty string. Got: {bad}")
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"classify: labels should be distinct. Got {repeated} more than once in {labels}")
    return labels


def _check_template(template: str) -> str:
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    unknown = fields - set(_TEMPLATE_FIELDS)
    if "text" not in fields or unknown:
        raise ValueError(
            f"classify: template should contain {{text}} and may contain {{labels}}, no other fields. "
            f"Got: {template!r}" + (f" (unknown: {sorted(unknown)})" if unknown else "")
        )
    return template
