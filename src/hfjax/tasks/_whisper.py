"""Whisper's short-form generate (audio of one window, no timestamps) on hfjax's compiled loop.

transformers' `WhisperForConditionalGeneration.generate` builds a decoder prompt before it decodes:
[<|startoftranscript|>, <|lang|>, <|task|>, <|notimestamps|>], the language given or detected from the
audio; it then strips the prompt, the padding and the final <|endoftext|> from what it returns. This
module does the same around `Model.generate`, which runs the loop with the checkpoint's
suppress_tokens and begin_suppress_tokens from the first new token on.
"""

from __future__ import annotations

import numpy as np
import torch

from .._errors import PipelineError

# Whisper's generate options that hfjax does not carry out: name -> what it asks for.
_REFUSED = {
    "return_timestamps": "timestamp tokens (long-form decoding)",
    "return_token_timestamps": "word timestamps from cross-attention",
    "return_segments": "long-form segments",
    "prompt_ids": "a text prompt before the decoder prompt",
    "prompt_condition_type": "a text prompt before the decoder prompt",
    "condition_on_prev_tokens": "long-form conditioning on the previous window",
    "compression_ratio_threshold": "temperature fallback",
    "logprob_threshold": "temperature fallback",
    "no_speech_threshold": "no-speech detection",
    "is_multilingual": "overriding the checkpoint's is_multilingual",
}


def generate(model, input_features, attention_mask=None, *, language=None, task=None, **kwargs) -> torch.Tensor:
    """The token ids [B, T] int64 that transformers' Whisper generate returns for `input_features`
    [B, mels, frames]: the new tokens only, right-padded with pad_token_id."""
    config = model.generation_config
    kwargs.pop("synced_gpus", None)
    for name, what in _REFUSED.items():
        value = kwargs.pop(name, None)
        if name == "return_timestamps" and value is None:
            value, name = getattr(config, "return_timestamps", None), "generation_config.return_timestamps"
        if value is not None and value is not False:
            raise PipelineError(
                f"hfjax.pipeline: Whisper's {name}={value!r} asks for {what}, which hfjax does not do; "
                f"transcribe audio of at most {_window_seconds(model)} s without it"
            )
    temperature = kwargs.get("temperature")
    if isinstance(temperature, (list, tuple)):
        raise PipelineError(
            f"hfjax.pipeline: Whisper's temperature={temperature!r} asks for temperature fallback, which hfjax does "
            "not do; pass one temperature"
        )
    frames = 2 * model.config.max_source_positions
    if input_features.shape[-1] > frames:
        raise PipelineError(
            f"hfjax.pipeline: the audio gives {input_features.shape[-1]} feature frames, more than Whisper's window of "
            f"{frames} ({_window_seconds(model)} s): long-form transcription is not supported; cut the audio, or pass "
            "chunk_length_s= to the pipeline"
        )
    prompt = decoder_prompt(model, input_features, language=language, task=task)
    length = prompt.shape[1]
    limit = model.config.max_target_positions
    budget = kwargs.get("max_new_tokens")
    if budget is None and kwargs.get("max_length") is None:
        budget = config.max_new_tokens
    if budget is not None:
        if budget + length > limit:
            raise PipelineError(
                f"hfjax.pipeline: max_new_tokens={budget} and Whisper's {length}-token decoder prompt exceed "
                f"max_target_positions={limit}; pass max_new_tokens<={limit - length}"
            )
        kwargs["max_new_tokens"] = budget
    else:
        # As Whisper's generate: max_length counts new tokens beyond the prompt, within the decoder's positions.
        max_length = kwargs.pop("max_length", None) or config.max_length
        kwargs["max_new_tokens"] = min(max_length + length, limit) - length
    out = model.generate(input_features, attention_mask, decoder_input_ids=prompt, **kwargs)
    return _new_tokens(np.asarray(out)[:, length:], config)


def decoder_prompt(model, input_features, *, language=None, task=None) -> np.ndarray:
    """int32 [B, D]: Whisper's first decoder tokens, as transformers' `_retrieve_init_tokens` builds them."""
    config = model.generation_config
    batch = input_features.shape[0]
    start = [config.decoder_start_token_id]
    if task is None and language is None:
        # The legacy forced_decoder_ids ([[1, lang or None], [2, task], ...]) extend the prompt.
        for index, token in sorted(getattr(config, "forced_decoder_ids", None) or []):
            if index != len(start):
                break
            start.append(token)
    if language is not None or task is not None:
        if getattr(config, "is_multilingual", True) is False:
            raise PipelineError(
                f"hfjax.pipeline: language={language!r}, task={task!r}: the checkpoint is English-only "
                "(generation_config.is_multilingual is False); leave both out"
            )
    rows = [list(start) for _ in range(batch)]
    languages = language if isinstance(language, (list, tuple)) else [language] * batch
    if len(languages) != batch:
        raise PipelineError(
            f"hfjax.pipeline: language={language!r} gives {len(languages)} languages for {batch} inputs"
        )
    lang_to_id = getattr(config, "lang_to_id", None)
    if language is not None:
        ids = [_language_id(config, name) for name in languages]
    elif lang_to_id and (len(start) < 2 or start[1] is None):
        ids = detect_language(model, input_features)
    else:
        ids = None
    task_ids = list((getattr(config, "task_to_id", None) or {}).values())
    no_timestamps = getattr(config, "no_timestamps_token_id", None)
    for i, row in enumerate(rows):
        if ids is not None:
            if len(row) > 1:
                row[1] = ids[i]
            else:
                row.append(ids[i])
        if task is not None:
            if task not in (getattr(config, "task_to_id", None) or {}):
                raise PipelineError(
                    f"hfjax.pipeline: task={task!r} is not one of the checkpoint's Whisper tasks {sorted(config.task_to_id)}"
                )
            wanted = config.task_to_id[task]
            present = [j for j, token in enumerate(row) if token in task_ids]
            for j in present:
                row[j] = wanted
            if not present:
                row.append(wanted)
        elif language is not None and task_ids and not any(token in task_ids for token in row):
            row.append(config.task_to_id["transcribe"])
        if no_timestamps is not None and row[-1] != no_timestamps:
            row.append(no_timestamps)
        rows[i] = [token for token in row if token is not None]
    return np.asarray(rows, np.int32)


def detect_language(model, input_features) -> list[int]:
    """The most likely language token per row, from the decoder's first logits after the start token
    (transformers' `detect_language`), with the compiled forward."""
    import jax.numpy as jnp

    config = model.generation_config
    features = np.asarray(input_features.float() if hasattr(input_features, "float") else input_features, np.float32)
    start = np.full((features.shape[0], 1), config.decoder_start_token_id, np.int32)
    logits = np.asarray(
        model(input_features=jnp.asarray(features), decoder_input_ids=jnp.asarray(start), use_cache=False).logits
    )[:, -1]  # [B, V]
    languages = np.asarray(sorted(config.lang_to_id.values()))
    return [int(token) for token in languages[np.argmax(logits[:, languages], axis=-1)]]


def _language_id(config, language: str) -> int:
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    name = language.lower()
    if name in config.lang_to_id:
        token = name
    elif name in TO_LANGUAGE_CODE:
        token = f"<|{TO_LANGUAGE_CODE[name]}|>"
    else:
        token = f"<|{name}|>"
    if token not in config.lang_to_id:
        raise PipelineError(
            f"hfjax.pipeline: language={language!r} is not one of the checkpoint's languages "
            f"{sorted(config.lang_to_id)}; pass one of them, or leave language out to detect it"
        )
    return config.lang_to_id[token]


def _new_tokens(new: np.ndarray, config) -> torch.Tensor:
    """Each row's new tokens without trailing padding and the final EOS, right-padded to the longest,
    as Whisper's generate returns them."""
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    rows = []
    for row in new:
        if row.size and row[-1] == pad:
            pads = int((row == pad).sum()) - (1 if pad == eos else 0)
            row = row[: len(row) - pads] if pads else row
        if row.size and row[-1] == eos:
            row = row[:-1]
        rows.append(row)
    longest = max(len(row) for row in rows)
    out = np.full((len(rows), longest), pad, np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def _window_seconds(model) -> float:
    return 2 * model.config.max_source_positions / 100  # feature frames are 10 ms apart
