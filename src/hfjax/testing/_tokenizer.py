"""The tiny byte-level BPE tokenizer that every `hfjax.testing` checkpoint uses.

Trained once per process on a short embedded English text, so no network access is needed.
"""

from __future__ import annotations

import functools

import tokenizers
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
_PAD, _BOS, _EOS, _UNK, _MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Trained first, so their ids are 0..7: pad=0, bos=1, eos=2, unk=3, mask=4.
_SPECIAL_TOKENS = (_PAD, _BOS, _EOS, _UNK, _MASK, *_ROLE_TOKENS)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_POSITIONS = 256

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown chat role ' ~ message['role'] ~ '; use system, user or assistant.') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The river ran quietly past the old mill, and the children watched the water carry leaves
toward the sea. Every morning the baker opened her shop before the sun was up, and the
smell of fresh bread drifted along the narrow street. People stopped to talk about the
weather, the harvest, and the news from the city.

A small model learns the shape of language from many examples. It reads a sentence one
token at a time and tries to guess what comes next. When the guess is wrong, the weights
change a little, and the next guess is better. After a long time the model can write
simple stories, answer questions, and translate short phrases.

In the library there were books about mountains, oceans, stars and machines. The
librarian kept a list of every book that was borrowed and returned. Students came in the
afternoon to read, to write their reports, and to ask questions about history, science
and music. The clock on the wall struck four, then five, then six.

What is the capital of France? The capital of France is Paris. How many days are in a
week? There are seven days in a week. Which planet is the largest? Jupiter is the largest
planet in our solar system. Thank you for your help! You are welcome; I am happy to help.

She opened the window and listened to the birds. The garden was green after the rain,
and the roses were beginning to bloom. Her brother was reading a letter from their
grandmother, who lived far away in a house by the lake. They planned to visit her in the
summer, when the days are long and the evenings are warm.
"""


# transformers 5 loads a qwen2 checkpoint's tokenizer with Qwen2Tokenizer whatever
# tokenizer_config.json names, and that class rebuilds normalisation and pre-tokenisation
# itself (NFC, then this split pattern). Using the same steps for every family makes the
# saved tokenizer reload to the same ids under any model_type.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tokenizer.to_str()


def _post_processor(kind: str | None, family: str | None) -> processors.PostProcessor:
    special = [(_BOS, BOS_ID), (_EOS, EOS_ID)]
    if kind == "seq2seq" and family == "t5":
        single, pair = f"$A {_EOS}", f"$A {_EOS} $B:1 {_EOS}:1"
    elif kind == "seq2seq":
        single, pair = f"{_BOS} $A {_EOS}", f"{_BOS} $A {_EOS} {_EOS} $B:1 {_EOS}:1"
    elif kind == "encoder":
        single, pair = f"{_BOS} $A {_EOS}", f"{_BOS} $A {_EOS} $B:1 {_EOS}:1"
    else:
        single, pair = f"{_BOS} $A", f"{_BOS} $A {_BOS}:1 $B:1"
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


def build(
    kind: str | None, family: str | None, named_tokens: dict[str, str] | None = None
) -> transformers.PreTrainedTokenizerFast:
    """A fresh tokenizer over the trained BPE (see `hfjax.testing.tiny_tokenizer`).

    Special tokens are added as a model of `kind` ("causal", "encoder", "seq2seq" or None
    for causal) and `family` adds them. `named_tokens` ({attribute: token}, e.g. a
    vision-language model's {"image_token": "<image>"}) are added after the BPE's tokens.
    """
    backend = tokenizers.Tokenizer.from_str(_trained_tokenizer_json())
    backend.post_processor = _post_processor(kind, family)
    input_names = ["input_ids", "attention_mask"]
    if family == "bert":
        input_names.insert(1, "token_type_ids")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        unk_token=_UNK,
        mask_token=_MASK,
        cls_token=_BOS,
        sep_token=_EOS,
        chat_template=_CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        model_input_names=input_names,
        **({"extra_special_tokens": named_tokens} if named_tokens else {}),
    )


def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The trained BPE's vocabulary and merges, to build a model family's own tokenizer class on them."""
    import json

    model = json.loads(_trained_tokenizer_json())["model"]
    return dict(model["vocab"]), [tuple(merge) for merge in model["merges"]]


def space_id() -> int:
    """The id of the byte-level space token "Ġ"."""
    return tokenizers.Tokenizer.from_str(_trained_tokenizer_json()).token_to_id("Ġ")
