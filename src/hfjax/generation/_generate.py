"""`Model.generate`'s arguments, as transformers takes them, turned into one run of the engine:
prompts and masks checked into arrays, the settings resolved, the context checked."""

from __future__ import annotations

import numpy as np

from .. import bridge
from .._errors import GenerationError, LoadError
from . import _grammar, _multimodal, _planning, _settings
from ._engine import Generator
from ._limits import LimitNames, check_limits


def generate(generator: Generator, input_ids, attention_mask, *, generation_config, seed: int, streamer, **arguments):
    """`Model.generate(input_ids, attention_mask, **arguments)` on `generator`'s model (see its docstring)."""
    model = generator.model
    config = model.config
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    decoder_prompt = arguments.pop("decoder_input_ids", None)
    main_input = model.module.main_input_name
    if encoder_decoder and main_input != "input_ids":
        # The encoder reads features (e.g. Whisper's input_features), by name or first positional.
        features = arguments.pop(main_input, input_ids)
        ids, mask = _planning.feature_arrays(main_input, features, attention_mask)
    else:
        ids, mask = _planning.prompt_arrays(input_ids, attention_mask)
    if decoder_prompt is not None:
        if not encoder_decoder:
            raise GenerationError(
                "Model.generate: decoder_input_ids is for encoder-decoder models; "
                f"{type(model.module).__name__} is a decoder: pass the whole prompt as input_ids"
            )
        decoder_prompt = _planning.decoder_prompt_array(decoder_prompt, rows=ids.shape[0])
    constraint = _grammar.constraint_of(arguments)
    draft = arguments.pop("assistant_model", None)
    if draft is not None and not (hasattr(draft, "module") and hasattr(draft, "params")):
        raise GenerationError(
            f"Model.generate: assistant_model={type(draft).__name__} is not a model; pass an hfjax.Model or a "
            "checkpoint's path"
        )
    lora_rows = adapter_rows(model, arguments.pop("adapter", _DEFAULT), ids.shape[0])
    inputs, arguments = _multimodal.split_model_inputs(model.module, arguments)
    resolved = _settings.resolve_settings(
        model,
        ids.shape[1],
        generation_config,
        decoder_prompt_length=1 if decoder_prompt is None else decoder_prompt.shape[1],
        assistant=draft is not None,
        **arguments,
    )
    if not encoder_decoder:
        _planning.warn_if_right_padded(ids, None if attention_mask is None else mask, resolved)
    if attention_mask is None:
        inferred = _planning.infer_mask(ids, resolved)  # int32 [B, S], or None: all ones
        mask = mask if inferred is None else inferred
    context = None if encoder_decoder else bridge.context_length(config)
    context_name = f"the model's context of {context} tokens (config.max_position_embeddings)"
    check_limits(
        int(mask.sum(axis=1).max()), resolved.max_new_tokens, context=context,
        names=LimitNames(prompt="Model.generate: the prompt", context=context_name),
    )  # fmt: skip
    return generator.generate(
        ids,
        mask,
        resolved,
        seed=seed,
        streamer=streamer,
        decoder_prompt=decoder_prompt,
        inputs=inputs,
        constraint=constraint,
        lora=lora_rows,
        draft=draft,
    )


_DEFAULT = object()  # `adapter=` not given: the model's default adapter (`Model.set_adapter`)


def adapter_rows(model, adapter, prompts: int) -> np.ndarray | None:
    """int32 [prompts]: each prompt's LoRA adapter slot for `Model.generate(adapter=...)` (a name, None for
    the base, or one of either per prompt); None where the model holds no adapters."""
    slots = getattr(model, "adapter_slots", None)
    if slots is None:
        if adapter is not _DEFAULT and adapter is not None:
            raise GenerationError(
                f"Model.generate: adapter={adapter!r}, but no adapter is loaded; load one first "
                "(Model.load_adapter(path, adapter_name=...))"
            )
        return None
    if adapter is _DEFAULT:
        return np.full(prompts, slots.active(), np.int32)
    names = adapter if isinstance(adapter, (list, tuple)) else [adapter] * prompts
    if len(names) != prompts:
        raise GenerationError(
            f"Model.generate: adapter= holds {len(names)} names for {prompts} prompts; pass one name (or None) per "
            "prompt, or one for all"
        )
    try:
        return np.asarray([slots.index(name, caller="Model.generate(adapter=...)") for name in names], np.int32)
    except LoadError as error:
        raise GenerationError(str(error)) from None
