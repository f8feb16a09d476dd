"""The tasks hfjax loads models for (transformers' pipeline names), and the one check of `task=`."""

from __future__ import annotations

from typing import Literal

from ._errors import LoadError

Task = Literal[
    "text-generation",
    "text2text-generation",
    "text-classification",
    "zero-shot-classification",
    "feature-extraction",
    "image-classification",
    "zero-shot-image-classification",
    "image-feature-extraction",
    "automatic-speech-recognition",
    "image-text-to-text",
]
TASKS: tuple[str, ...] = Task.__args__
GENERATIVE: tuple[str, ...] = ("text-generation", "text2text-generation", "image-text-to-text")

# task -> its (transformers Auto class, the auto mapping of its architecture names), first match wins.
# Inference tries the tasks in this order, so a specific head comes before the bare models.
# Vision-language models come first: some causal-LM tables also list their classes.
_AUTO: dict[str, tuple[tuple[str, str], ...]] = {
    "image-text-to-text": (("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),),
    "text-generation": (("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),),
    "text2text-generation": (("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),),
    "text-classification": (("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),),
    # -- vision and speech (hfjax.pipeline) --
    "image-classification": (("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),),
    "zero-shot-image-classification": (
        ("AutoModelForZeroShotImageClassification", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ),
    "automatic-speech-recognition": (
        ("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES"),
        ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ),
    "image-feature-extraction": (("AutoModel", "MODEL_FOR_IMAGE_MAPPING_NAMES"),),
    # -- the bare models --
    "feature-extraction": (("AutoModel", "MODEL_MAPPING_NAMES"),),
    # An NLI head; never inferred (text-classification comes first).
    "zero-shot-classification": (
        ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ),
}


def check(task: str | None, *, caller: str) -> str | None:
    """`task` if it is one hfjax knows (None: to be inferred); else a LoadError naming `caller`."""
    if task is not None and task not in TASKS:
        raise LoadError(
            f"{caller}: task={task!r} is not supported; use one of {TASKS}, or None to infer it from config.json"
        )
    return task


def _tables(task: str) -> list[tuple[str, dict]]:
    from transformers.models.auto import modeling_auto

    return [(auto, getattr(modeling_auto, table)) for auto, table in _AUTO[task]]


def auto_class(task: str, config=None):
    """transformers' Auto class that builds a model for `task` (e.g. AutoModelForCausalLM); where a task
    has several (speech recognition: CTC or sequence-to-sequence), the one whose table holds `config`."""
    import transformers

    tables = _tables(task)
    if config is not None:
        for auto, table in tables:
            if config.model_type in table:
                return getattr(transformers, auto)
    return getattr(transformers, tables[0][0])


def _holds(table: dict, name: str) -> bool:
    return any(name == value or (isinstance(value, tuple) and name in value) for value in table.values())


def infer(config) -> str:
    """The task of a transformers config: from its `architectures`, else from its model_type."""
    for architecture in config.architectures or ():
        for task in _AUTO:
            if any(_holds(table, architecture) for _, table in _tables(task)):
                return task
    for task in _AUTO:
        if any(config.model_type in table for _, table in _tables(task)):
            return task
    raise LoadError(
        f"hfjax.load: cannot tell the task of architectures={config.architectures} (model_type {config.model_type!r}); "
        f"pass task= one of {TASKS}"
    )


def tasks_of(config) -> list[str]:
    """Every task transformers has a model class for with this config's model_type, in inference order."""
    return [task for task in _AUTO if any(config.model_type in table for _, table in _tables(task))]


def of_module(module) -> str:
    """The task a transformers model in memory does, from its class (AutoModelForCausalLM's table, ...)."""
    name = type(module).__name__
    for task in _AUTO:
        if any(_holds(table, name) for _, table in _tables(task)):
            return task
    if getattr(module, "can_generate", lambda: False)():
        return "text2text-generation" if getattr(module.config, "is_encoder_decoder", False) else "text-generation"
    raise LoadError(f"hfjax.Model.from_module: cannot tell the task of a {name}; pass task= one of {TASKS}")
