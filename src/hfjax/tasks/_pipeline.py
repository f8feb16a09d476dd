"""`hfjax.pipeline`: transformers' task pipelines, with the model's compute on JAX.

transformers builds its own pipeline object, so that pre- and post-processing (tokenizer, image
processor, feature extractor, label mapping, CTC and Whisper decoding) is transformers' own code.
Its `model` is a `JaxBackedModel`: the transformers module's config, generation config and class,
whose forward is hfjax's compiled forward and whose `generate` is hfjax's compiled generate loop.
Torch tensors go in and come out; in between every array is a jax.Array.
"""

from __future__ import annotations

import inspect
import os

import jax.numpy as jnp
import numpy as np
import torch

from .. import _tasks, bridge
from .._buckets import bucket
from .._errors import PipelineError
from . import _audio


class JaxBackedModel:
    """Stands in for a transformers model inside transformers' pipeline: calls run on JAX.

    Attributes not defined here (config, generation_config, main_input_name, can_generate, ...) are
    the transformers module's; `type(...)` is this class, `.__class__` the module's, so transformers'
    checks by class name pass.
    """

    def __init__(self, model):
        self._model = model

        # The forward's signature is the module's (pipelines read it: `use_cache`, ...).
        def forward(*args, **inputs):
            return self._forward(*args, **inputs)

        forward.__signature__ = inspect.signature(model.module.forward)
        self.forward = forward

    @property
    def __class__(self):
        return type(self._model.module)

    def __getattr__(self, name: str):
        return getattr(self._model.module, name)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where the pipeline's tensors live; the compute is on JAX's devices

    @property
    def generation_config(self):
        return self._model.generation_config  # the checkpoint's generation_config.json, as transformers loads it

    @property
    def dtype(self) -> torch.dtype:
        return self._model.module.dtype

    def to(self, *args, **kwargs):
        return self

    def eval(self):
        return self

    def __call__(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def _forward(self, *args, **inputs):
        if args:
            raise PipelineError(
                f"{type(self._model.module).__name__} on JAX takes keyword inputs only; got {len(args)} positional"
            )
        arrays = {name: value for name, value in inputs.items() if value is not None}
        padding = self._token_padding(arrays)
        if padding is not None:
            tokens = arrays["input_ids"].shape[1]
            arrays = _pad_tokens(arrays, *padding)
        rows = _common_rows(arrays)
        padded = bucket(rows, smallest=1) if rows else None
        call = {name: _to_jax(value, padded) for name, value in arrays.items()}
        out = self._model(**call)
        if padding is not None and self._model.task == "feature-extraction":
            out = _cut_tokens(out, tokens, padding[1])
        return _to_torch(out, rows, padded)

    def _token_padding(self, arrays: dict) -> tuple[int, str, int] | None:
        """(length, side, pad token id): a text encoder's batch padded to a power of two of tokens (at
        least 16, at most the model's positions), so that texts of new lengths reuse few programs; None
        to keep the batch as it is.

        The padding is the tokenizer's own, which transformers' pipeline uses for batches of texts of
        different lengths: its side and pad token, 0 in the attention mask. A tokenizer without a pad
        token, or any other [B, S] input, keeps the length."""
        tokenizer = self._model.tokenizer
        if self._model.task not in _LENGTH_PADDED_TASKS or "attention_mask" not in arrays or tokenizer is None:
            return None
        ids = arrays.get("input_ids")
        if tokenizer.pad_token_id is None or not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            return None
        if any(isinstance(v, torch.Tensor) and v.ndim >= 2 and n not in _PADDED for n, v in arrays.items()):
            return None
        length = bucket(ids.shape[1], limit=getattr(self._model.config, "max_position_embeddings", None))
        return (length, tokenizer.padding_side, tokenizer.pad_token_id) if length > ids.shape[1] else None

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        """transformers' `generate` inputs and outputs, through hfjax's compiled generate loop (for Whisper,
        its short-form generate: `_whisper.generate`)."""
        if self._model.config.model_type == "whisper":
            from . import _whisper

            features = kwargs.pop("input_features", input_ids)
            return _whisper.generate(self._model, features, attention_mask, **kwargs)
        if input_ids is None:
            extra = sorted(name for name, value in kwargs.items() if isinstance(value, torch.Tensor))
            raise PipelineError(
                f"hfjax.pipeline: {type(self._model.module).__name__}.generate on JAX takes input_ids; got {extra}"
            )
        kwargs.pop("synced_gpus", None)
        out = self._model.generate(
            input_ids.numpy(), None if attention_mask is None else attention_mask.numpy(), **kwargs
        )
        if isinstance(out, (jnp.ndarray, np.ndarray)):
            return torch.from_numpy(np.asarray(out).astype(np.int64))
        return _to_torch(out, None, None)


# Text encoder tasks whose batches are padded to a bucket of token lengths, and their [B, S] inputs
# with each one's padding value (None: the pad token).
_LENGTH_PADDED_TASKS = ("text-classification", "zero-shot-classification", "feature-extraction")
_PADDED = {"input_ids": None, "attention_mask": 0, "token_type_ids": 0}


def _pad_tokens(arrays: dict, length: int, side: str, pad_token_id: int) -> dict:
    """[B, S] token inputs padded to [B, length] on `side`: the pad token, mask and type ids 0."""
    padded = dict(arrays)
    for name, fill in _PADDED.items():
        value = arrays.get(name)
        if isinstance(value, torch.Tensor):
            extra = value.new_full((value.shape[0], length - value.shape[1]), pad_token_id if fill is None else fill)
            padded[name] = torch.cat([extra, value] if side == "left" else [value, extra], dim=1)
    return padded


def _cut_tokens(out, tokens: int, side: str):
    # A feature extractor's per-token outputs back to the batch's own tokens.
    def cut(value):
        return value[:, -tokens:] if side == "left" else value[:, :tokens]

    for name in ("last_hidden_state", "hidden_states"):
        value = getattr(out, name, None)
        if value is not None:
            out[name] = tuple(cut(v) for v in value) if isinstance(value, tuple) else cut(value)
    return out


def _common_rows(arrays: dict) -> int | None:
    # The batch is padded only when every tensor input has the same number of rows (not, e.g., CLIP's
    # images and label texts).
    rows = {value.shape[0] for value in arrays.values() if isinstance(value, torch.Tensor) and value.ndim > 0}
    return rows.pop() if len(rows) == 1 else None


def _to_jax(value, padded: int | None):
    if not isinstance(value, torch.Tensor):
        return value
    array = value.numpy()
    if padded is not None and padded > array.shape[0]:
        # Padding rows repeat the first row, so no row is all padding (an all-masked row can give NaN).
        array = np.concatenate([array, np.repeat(array[:1], padded - array.shape[0], axis=0)])
    return jnp.asarray(array)


def _to_torch(tree, rows: int | None, padded: int | None):
    """A transformers output with jax.Array leaves -> the same with torch tensors, padding rows cut off.
    Caches and other non-array fields become None (pipelines read none of them)."""
    from transformers.utils import ModelOutput

    if isinstance(tree, ModelOutput):
        return type(tree)(**{name: _to_torch(value, rows, padded) for name, value in tree.items()})
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to_torch(value, rows, padded) for value in tree)
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        array = np.asarray(tree)
        if padded is not None and array.ndim > 0 and array.shape[0] == padded:
            array = array[:rows]
        return torch.from_numpy(np.array(array))  # a writable copy
    return None


def pipeline(task: str, model, *, dtype=None, revision: str | None = None, token: str | bool | None = None, **kwargs):
    """transformers' `pipeline(task, model=...)` with the model's forward and generate on JAX.

    Inputs and outputs are those of transformers' pipeline for the task; pre- and post-processing
    are transformers' own, with the checkpoint's tokenizer, processor, image processor or feature
    extractor. Batches (`batch_size=`) are padded to power-of-two rows, and text encoders' token
    lengths to powers of two (the tokenizer's padding), so few programs are compiled.
    Speech recognition also takes audio files (WAV, FLAC, OGG, MP3: the `audio` extra) and arrays at
    any sampling rate (resampled to the feature extractor's).

    Args:
      task: "text-generation", "text2text-generation", "text-classification",
        "zero-shot-classification", "feature-extraction", "image-classification",
        "zero-shot-image-classification", "image-feature-extraction", "automatic-speech-recognition"
        or "image-text-to-text" (chats with images, generated by the compiled loop).
      model: a checkpoint directory or hub id, or an `hfjax.Model` loaded for the task.
      dtype: as for `hfjax.load`.
      revision, token: for a hub id, as for `hfjax.load` (the processors come from the same snapshot).
      kwargs: transformers' pipeline arguments (batch_size, generation settings, ...).

    Returns:
      transformers' pipeline object for the task; calling it gives transformers' output structure.

    Example:
      >>> classifier = hfjax.pipeline("image-classification", model="path/to/vit")
      >>> classifier(image)  # [{"label": ..., "score": ...}, ...]
    """
    import transformers

    from .._model import Model, load

    if task not in _tasks.TASKS:
        raise PipelineError(f"hfjax.pipeline: task={task!r} is not supported; use one of {_tasks.TASKS}")
    if isinstance(model, Model):
        loaded = model
        if loaded.task != task and not _compatible(loaded.task, task):
            raise PipelineError(
                f"hfjax.pipeline: the model was loaded for task={loaded.task!r}, not {task!r}; "
                f"load it with hfjax.load(path, task={task!r})"
            )
        if revision is not None or token is not None:
            raise PipelineError(
                "hfjax.pipeline: revision= and token= choose what a hub id downloads; the model is loaded already, "
                "so pass them to hfjax.load, or pass the hub id as model="
            )
    elif isinstance(model, (str, os.PathLike)):
        path = bridge.resolve_checkpoint(model, revision=revision, token=token, caller="hfjax.pipeline")
        config = bridge.read_config(path)
        able = _tasks.tasks_of(config)
        if task not in able:
            raise PipelineError(
                f"hfjax.pipeline: task={task!r} cannot run on {str(model)!r} (a {config.model_type} model); "
                f"it can do: {', '.join(able) or 'none of hfjax tasks'}"
            )
        loaded = load(path, task=task, dtype=dtype)
    else:
        raise PipelineError(
            f"hfjax.pipeline: model is a {type(model).__name__}; pass a checkpoint directory, a hub id or an hfjax.Model"
        )
    if loaded.path is None:
        raise PipelineError(
            "hfjax.pipeline: the model has no checkpoint directory to read its processors from; "
            "load it with hfjax.load(path)"
        )
    if (
        task == "automatic-speech-recognition"
        and getattr(loaded.config, "is_encoder_decoder", False)
        and loaded.config.model_type != "whisper"
    ):
        raise PipelineError(
            f"hfjax.pipeline: speech recognition with a sequence-to-sequence model ({loaded.config.model_type}) "
            "is not supported yet; use Whisper or a CTC checkpoint (wav2vec2, HuBERT, ...)"
        )
    if task == "text2text-generation":
        return Text2TextGenerationPipeline(loaded, **kwargs)
    if task == "automatic-speech-recognition":
        kwargs.setdefault("pipeline_class", _audio.speech_pipeline_class())
    # Given a model object, transformers' factory loads the processors it names by path: name the
    # checkpoint for each the pipeline class loads (its `_load_*` flag True, or None: if present).
    kind = kwargs.get("pipeline_class") or _pipeline_class(task)
    for component in ("tokenizer", "image_processor", "feature_extractor", "processor"):
        if getattr(kind, f"_load_{component}") is not False:
            kwargs.setdefault(component, str(loaded.path))
    return transformers.pipeline(task, model=JaxBackedModel(loaded), config=str(loaded.path), device="cpu", **kwargs)


def _pipeline_class(task: str) -> type:
    """The pipeline class transformers' factory builds for `task`."""
    from transformers import pipelines

    impl = pipelines.check_task(task)[1]["impl"]
    # transformers 5.17 holds the class; later releases a name that `_resolve_impl` imports
    return impl if isinstance(impl, type) else pipelines._resolve_impl(impl)


def _compatible(loaded: str, task: str) -> bool:
    return {loaded, task} <= {"text-classification", "zero-shot-classification"}


class Text2TextGenerationPipeline:
    """transformers 4's "text2text-generation" pipeline, which transformers 5 removed: texts in, for each
    `[{"generated_text": ...}]` out (one dict per `num_return_sequences`), through `Model.generate_text`.

    Arguments given when it is made are generation settings for every call; a call's own override them.
    """

    task = "text2text-generation"

    def __init__(self, model, **generate_kwargs):
        self.model = model
        self.tokenizer = model.tokenizer
        self._generate_kwargs = generate_kwargs

    def __call__(self, inputs: str | list[str], **generate_kwargs) -> list:
        single = isinstance(inputs, str)
        texts = [inputs] if single else list(inputs)
        settings = {**self._generate_kwargs, **generate_kwargs}
        out = self.model.generate_text(texts, **settings)
        out = [out] if isinstance(out, str) else out
        per_text = settings.get("num_return_sequences") or 1
        results = [
            [{"generated_text": text} for text in out[i * per_text : (i + 1) * per_text]] for i in range(len(texts))
        ]
        return results[0] if single else results
