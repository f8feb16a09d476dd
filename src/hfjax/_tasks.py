"""The tasks hfjax loads models for (transformers' pipeline names), and the one check of `task=`."""

from __future__ import annotations

from typing import Literal

from ._errors import LoadError

Task = Literal[
    "text-generation", "text2text-generation", "text-classification", "feature-extraction", "image-text-to-text"
]
TASKS: tuple[str, ...] = Task.__args__
GENERATIVE: tuple[str, ...] = ("text-generation", "text2text-generation", "image-text-to-text")

# task -> (transformers Auto class, the auto mapping of its architecture names); inference takes
# the first task whose table names an architecture, so vision-language models (whose classes some
# causal-LM tables also list) come first.
_AUTO = {
    "image-text-to-text": ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    "text-generation": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "text2text-generation": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "text-classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "feature-extraction": ("AutoModel", "MODEL_MAPPING_NAMES"),
}


def check(task: str | None, *, caller: str) -> str | None:
    """`task` if it is one hfjax knows (None: to be inferred); else a LoadError naming `caller`."""
    if task is not None and task not in TASKS:
        raise LoadError(
            f"{caller}: task={task!r} is not supported; use one of {TASKS}, or None to infer it from config.json"
        )
    return task


def auto_class(task: str):
    """transformers' Auto class that builds a model for `task` (e.g. AutoModelForCausalLM)."""
    import transformers

    return getattr(transformers, _AUTO[task][0])


def infer(config) -> str:
    """The task of a transformers config: from its `architectures`, else from its model_type."""
    from transformers.models.auto import modeling_auto

    tables = {task: getattr(modeling_auto, table) for task, (_, table) in _AUTO.items()}
    for architecture in config.architectures or ():
        for task, table in tables.items():
            if architecture in table.values():
                return task
    for task, table in tables.items():
        if config.model_type in table:
            return task
    raise LoadError(
        f"hfjax.load: cannot tell the task of architectures={config.architectures} (model_type {config.model_type!r}); "
        f"pass task= one of {TASKS}"
    )


def of_module(module) -> str:
    """The task a transformers model in memory does, from its class (AutoModelForCausalLM's table, ...)."""
    from transformers.models.auto import modeling_auto

    name = type(module).__name__
    for task, (_, table) in _AUTO.items():
        if name in getattr(modeling_auto, table).values():
            return task
    if getattr(module, "can_generate", lambda: False)():
        return "text2text-generation" if getattr(module.config, "is_encoder_decoder", False) else "text-generation"
    raise LoadError(f"hfjax.Model.from_module: cannot tell the task of a {name}; pass task= one of {TASKS}")
