"""What the structured-output benchmarks share: a JSON schema of 20 properties, the other constraint
kinds (any JSON object, a date regex, a choice of 5 strings), and a byte-level BPE tokenizer of 32000
tokens trained here on English-like text and JSON records (no hub)."""

from __future__ import annotations

import itertools
import json
import random

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 32000
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ("strongly agree", "agree", "neutral", "disagree", "strongly disagree")


def _string(pattern=None, **bounds):
    return {"type": "string", **({"pattern": f"^{pattern}$"} if pattern else {}), **bounds}


def _integer(low, high):
    return {"type": "integer", "minimum": low, "maximum": high}


def _object(properties, required):
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


ADDRESS = _object(
    {"street": _string(maxLength=40), "city": _string("[A-Z][a-z]{1,15}"), "number": _integer(1, 9999)},
    ["street", "city", "number"],
)
CONTACT = _object(
    {"phone": _string("[0-9]{3}-[0-9]{3}-[0-9]{4}"), "preferred": {"enum": ["email", "phone"]}}, ["phone", "preferred"]
)
PROPERTIES = {
    "id": _string("[A-Z]{3}-[0-9]{4}"),
    "name": _string(minLength=1, maxLength=40),
    "email": _string("[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)"),
    "age": _integer(0, 120),
    "score": _integer(-50, 50),
    "status": {"enum": ["active", "inactive", "pending"]},
    "role": {"type": "string", "enum": ["admin", "user", "guest", "owner"]},
    "verified": {"type": "boolean"},
    "rating": {"type": "number"},
    "created": _string(DATE),
    "country": _string("[A-Z]{2}"),
    "zip": _string("[0-9]{5}"),
    "tags": {"type": "array", "items": _string(maxLength=12), "minItems": 1, "maxItems": 4},
    "address": {"$ref": "#/$defs/address"},
    "contact": CONTACT,
    "level": _integer(1, 10),
    "notes": _string(maxLength=80),
    "priority": {"enum": [1, 2, 3]},
    "currency": {"enum": ["USD", "EUR", "JPY"]},
    "since": _integer(1900, 2100),
}
SCHEMA = {
    "type": "object",
    "$defs": {"address": ADDRESS},
    "properties": PROPERTIES,
    "additionalProperties": False,
    "required": [name for name in PROPERTIES if name not in ("rating", "notes")],
}
# case: (kind, grammar, a variant of the grammar that no cache has seen: n -> grammar)
CASES = {
    "schema": ("json", SCHEMA, lambda n: {**SCHEMA, "description": f"variant {n}"}),
    "any_object": ("json", {"type": "object"}, lambda n: {"type": "object", "description": f"variant {n}"}),
    "regex": ("regex", DATE, lambda n: f"{n}:{DATE}"),
    "choice": ("regex", "|".join(CHOICES), lambda n: "|".join(f"{c}{n}" for c in CHOICES)),
}
# Common English and JSON field words, so that like a real tokenizer's, this one spells them in one token.
ENGLISH = """
the of and to in is it you that was for on are with as they be at one have this from or had by word but what
some we can out other were all there when up use your how said an each which do their time if will way about
many then them write would like so these long make thing see two has look more day could go come did number
sound no most people my over know water than call first who may down side been now find any new work part
id email age score status role verified rating created zip tags address contact phone level notes priority
currency since street city country name active inactive pending admin user guest owner preferred true false
null type value data items positive negative neutral mixed unknown result error message description title
"""


def _corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    syllables = "ka lo mi ne ru ta ve so pa di gu fe ha jo ri sta tre bla con der ing ion ent pro ver".split()
    made_up = ["".join(rng.choices(syllables, k=rng.choice((1, 1, 2, 2, 3, 4)))) for _ in range(40000)]
    lexicon = ENGLISH.split() + made_up  # the common words first, as in a real corpus
    zipf = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(lexicon))))
    out = []
    for line in range(lines):
        words = rng.choices(lexicon, cum_weights=zipf, k=rng.randint(6, 20))
        if line % 3:
            out.append(" ".join(words).capitalize() + rng.choice(".?!,"))
            continue
        values = (rng.randint(-999, 99999), " ".join(words[:3]), True, None, [rng.randint(0, 9)], "2024-05-17")
        record = {key: rng.choice(values) for key in words[3:8]}
        out.append(json.dumps(record, indent=rng.choice((None, 2))))
    return out


def build_tokenizer(directory: str) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of VOCAB tokens (id 0 is EOS), saved to and loaded from `directory`."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(seed=0, lines=60000), trainer=trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)
