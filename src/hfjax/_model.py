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
      mesh: the device mesh the weights are split over (`hfjax.load(mesh=...)`), or None.
        `generate` splits the batch over its "data" axis.
    """

    def __init__(self, module, params, aliases, *, config, tokenizer, task: str, path: pathlib.Path, mesh=None):
        self.module = module
        self.mesh = mesh
        self.params = params
        self.config = config
        self.tokenizer = tokenizer
        self.task = task
        self.path = path
        self.aliases = aliases
        self.compiled = JittedModule(module, ("forward",), params=params, aliases=aliases)
        self._generator = None
        self._generation_config = None

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

    @property
    def generation_config(self):
        """The checkpoint's generation_config.json (transformers' GenerationConfig), else one made from config."""
        if self._generation_config is None:
            from transformers import GenerationConfig

            if (self.path / "generation_config.json").is_file():
                self._generation_config = GenerationConfig.from_pretrained(self.path)
            else:
                self._generation_config = GenerationConfig.from_model_config(self.config)
        return self._generation_config

    def generate(
        self,
        input_ids=None,
        attention_mask=None,
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generation_config=None,
        seed: int = 0,
        streamer=None,
        **settings,
    ):
        """Generates tokens, as transformers' `generate` does, with the whole decode loop compiled.

        Args mirror transformers' `generate`; unset ones come from `generation_config`, then from
        the checkpoint's generation_config.json. Prompts of different lengths are passed
        left-padded with an `attention_mask`; each row gets what that prompt alone would.
        `seed` seeds the in-program sampler: the same seed gives the same tokens.
        `streamer` follows transformers' streamer interface (`put`, `end`), e.g. `TextStreamer`.
        `settings`: other transformers generation settings, of which hfjax carries out
        `max_length`, `min_length`, `no_repeat_ngram_size`, `bad_words_ids`, `sequence_bias`,
        `suppress_tokens`, `begin_suppress_tokens`, `forced_bos_token_id`,
        `forced_eos_token_id`, `decoder_start_token_id`, `num_return_sequences` and beam
        search (`num_beams`, `length_penalty`, `early_stopping`), and
        `return_dict_in_generate` with `output_scores` / `output_logits`; one that would change
        the output and that it cannot carry out (beam sampling, `typical_p`,
        `output_attentions`, ...) raises a ValueError that names it.

        Returns:
          int32 jax.Array [B * num_return_sequences, S + T] (for encoder-decoders
          [.., 1 + T], starting with the decoder start token): the prompt as given, then the
          new tokens, padded with `pad_token_id` after a row has produced EOS.
          T <= max_new_tokens. A prompt's `num_return_sequences` rows are adjacent (with beam
          search, its best finished beams, best first). With return_dict_in_generate=True,
          transformers' Generate*Output of jax.Arrays: `sequences` as above, and `scores` /
          `logits` as tuples of T [rows, V] arrays where asked for.

        Example:
          >>> batch = model.tokenizer(["Hi", "Hello there"], padding=True, return_tensors="np")
          >>> model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=16)
        """
        from . import _generate, _settings

        if self.task not in ("text-generation", "text2text-generation"):
            raise ValueError(
                f"Model.generate: this model was loaded for task={self.task!r}; load a causal or sequence-to-sequence "
                "LM (hfjax.load(path, task='text-generation'))"
            )
        ids, mask = _prompt_arrays(input_ids, attention_mask)
        resolved = _settings.resolve(
            self,
            ids.shape[1],
            generation_config,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **settings,
        )
        self._check_context(mask, resolved.max_new_tokens)
        if self._generator is None:
            self._generator = _generate.Generator(self)
        return self._generator.generate(ids, mask, resolved, seed=seed, streamer=streamer)

    def generate_text(self, prompts, **kwargs) -> str | list[str]:
        """Text in, text out: tokenizes (left-padded), generates, and decodes the new tokens only.

        `prompts`: a text, a conversation (a list of {"role": ..., "content": ...} messages,
        put through the tokenizer's chat template with the assistant's turn opened, as
        transformers' text-generation pipeline does), or a list of either.
        Keyword arguments are those of `generate`. Returns one text per prompt, or, with
        `num_return_sequences=n`, a list of n texts per prompt, side by side in one list.

        Example:
          >>> model.generate_text("The capital of France is", max_new_tokens=8)
          >>> model.generate_text([{"role": "user", "content": "Hi!"}], max_new_tokens=32)
        """
        if self.tokenizer is None:
            raise LoadError(f"Model.generate_text: the checkpoint at {str(self.path)!r} has no tokenizer files; use generate(input_ids)")
        single = isinstance(prompts, str) or _is_conversation(prompts)
        batch = [prompts] if single else list(prompts)
        conversations = [_is_conversation(prompt) for prompt in batch]
        if any(conversations):
            if not all(conversations):
                raise ValueError(
                    "Model.generate_text: prompts mix texts and conversations; pass a list of texts or a list of "
                    "conversations (each a list of {'role': ..., 'content': ...} messages)"
                )
            if not self.tokenizer.chat_template:
                raise ValueError(
                    f"Model.generate_text: the tokenizer at {str(self.path)!r} has no chat template, so a conversation "
                    "cannot be put into text; pass the prompt as text"
                )
            batch = [chat_prompt(self.tokenizer, conversation) for conversation in batch]
        self.tokenizer.padding_side = "left"
        # A chat prompt holds its own BOS.
        encoded = self.tokenizer(batch, padding=True, return_tensors="np", add_special_tokens=not any(conversations))
        out = np.asarray(self.generate(encoded["input_ids"], encoded["attention_mask"], **kwargs))
        start = 1 if getattr(self.config, "is_encoder_decoder", False) else encoded["input_ids"].shape[1]
        texts = self.tokenizer.batch_decode(out[:, start:], skip_special_tokens=True)
        return texts[0] if single and len(texts) == 1 else texts

    def classify(
        self, texts: str | list[str], labels: list[str] | None = None, *, template: str | None = None
    ) -> list[dict[str, float]]:
        """Label probabilities per text: the classification head's softmax, or zero-shot with a causal LM.

        With a causal LM each label is scored as the continuation of `template` (a `{text}`
        field, optionally `{labels}`) and `labels` is required; see `hfjax._classify.classify`.

        Returns:
          one {label: probability} dict per text, keys in label order.

        Example:
          >>> model.classify(["I loved it", "Terrible."], labels=["positive", "negative"])
        """
        from ._classify import classify

        return classify(self, texts, labels, template=template)

    @property
    def last_generation_stats(self):
        """Timings of the last `generate` call: time_to_first_token, tokens_per_second, ..."""
        return None if self._generator is None else self._generator.last_stats

    def _check_context(self, mask: np.ndarray, max_new_tokens: int) -> None:
        context = _context_length(self.config)
        if context is None or getattr(self.config, "is_encoder_decoder", False):
            return
        longest = int(mask.sum(axis=1).max())
        if longest + max_new_tokens > context:
            raise ValueError(
                f"Model.generate: the prompt has {longest} tokens and max_new_tokens={max_new_tokens}, "
                f"{longest + max_new_tokens} in all, more than the model's context of {context} tokens "
                f"(config.max_position_embeddings); shorten the prompt or pass max_new_tokens<={context - longest}"
            )

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


def _context_length(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _prompt_arrays(input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    # Returns int32 [B, S] token ids and mask, from numpy, jax, torch or nested lists.
    if input_ids is None:
        raise ValueError("Model.generate: input_ids is required (int token ids of shape [batch, length])")
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"Model.generate: input_ids must be integer token ids of shape [batch, length], got {ids.dtype} {ids.shape}")
    if ids.shape[1] == 0:
        raise ValueError("Model.generate: input_ids is empty (length 0); every prompt needs at least one token, e.g. the BOS token")
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = np.asarray(attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask)
        mask = mask[None, :] if mask.ndim == 1 else mask
        if mask.shape != ids.shape:
            raise ValueError(f"Model.generate: attention_mask has shape {mask.shape}, input_ids {ids.shape}; they must match")
    empty = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty.size:
        raise ValueError(
            f"Model.generate: prompt {int(empty[0])} is empty (its attention_mask has no 1s); every prompt needs at least one token"
        )
    return ids.astype(np.int32), mask.astype(np.int32)


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
      mesh: a `jax.sharding.Mesh` with a "model" axis (see `hfjax.make_mesh`): each weight is
        split over it as `hfjax._sharding.plan` says, read slice by slice into the devices.
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
    shardings = None
    if mesh is not None:
        from . import _sharding

        shardings = _sharding.plan(module, mesh).shardings(mesh)
    params, aliases = _loading.load_weights(module, files, dtype, progress=progress, shardings=shardings)
    return Model(module, params, aliases, config=config, tokenizer=_tokenizer(path), task=task, path=path, mesh=mesh)


def _tokenizer(path: pathlib.Path):
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_prompt(tokenizer, conversation: list[dict]) -> str:
    """`conversation` (role/content messages) as prompt text: the tokenizer's chat template with
    the assistant's turn opened. Tokenize it without special tokens: the template writes its own BOS."""
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def _is_conversation(prompt) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(message, dict) and "role" in message for message in prompt)
    )
