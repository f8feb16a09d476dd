"""Training data: records from JSONL, CSV, a `datasets.Dataset` or a list, tokenised for the task,
then served as padded batches whose lengths round up to power-of-two buckets, or packed: several
examples per row of `max_length` tokens, told apart by their position ids (causal LMs).

Records, by task:
    text-generation        {"text": ...}, or {"messages": [{"role", "content"}, ...]}: the chat
                           template's text, the loss on the assistant's tokens only (as TRL's SFT)
    text-classification    {"text": ..., "label": class id or label name}, optionally "text_pair"
    text2text-generation   {"source": ..., "target": ...}
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
from collections.abc import Iterator
from typing import Literal

import numpy as np

from .. import _buckets
from .._errors import TrainingError

IGNORE = -100  # labels where no loss is taken, as transformers' losses read them
Kind = Literal["causal", "classification", "seq2seq"]
_KINDS: dict[str, Kind] = {
    "text-generation": "causal",
    "text-classification": "classification",
    "text2text-generation": "seq2seq",
}


@dataclasses.dataclass(frozen=True)
class Examples:
    """Tokenised examples: rows of {"input_ids": [ints], "labels": [ints] or int}."""

    rows: tuple[dict, ...]
    kind: Kind
    pad_id: int

    def __len__(self) -> int:
        return len(self.rows)


def read_records(source) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a JSONL or CSV file, a `datasets.Dataset` or a list of
    dicts; `where` names the file and line ("data.jsonl:3") or the index."""
    if isinstance(source, (str, pathlib.Path)):
        path = pathlib.Path(source)
        if not path.is_file():
            raise TrainingError(f"hfjax training data: no file at {str(path)!r}; pass a .jsonl or .csv file")
        if path.suffix == ".jsonl" or path.suffix == ".json":
            yield from _jsonl(path)
        elif path.suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                for number, row in enumerate(csv.DictReader(f), start=2):  # line 1 is the header
                    yield f"{path}:{number}", row
        else:
            raise TrainingError(f"hfjax training data: {str(path)!r} is neither .jsonl nor .csv; pass one of those")
        return
    if hasattr(source, "column_names") and hasattr(source, "__getitem__"):  # a datasets.Dataset
        for i, record in enumerate(source):
            yield f"record {i}", record
        return
    if isinstance(source, (list, tuple)):
        for i, record in enumerate(source):
            if not isinstance(record, dict):
                raise TrainingError(
                    f"hfjax training data: record {i} is a {type(record).__name__}; each record is a dict"
                )
            yield f"record {i}", record
        return
    raise TrainingError(
        f"hfjax training data: got a {type(source).__name__}; pass a .jsonl or .csv path, a datasets.Dataset "
        "or a list of dicts"
    )


def _jsonl(path: pathlib.Path) -> Iterator[tuple[str, dict]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TrainingError(
                    f"{path}:{number}: not valid JSON ({error.msg}); each line is one JSON object"
                ) from None
            if not isinstance(record, dict):
                raise TrainingError(
                    f"{path}:{number}: a JSON {type(record).__name__}, not an object; each line is one JSON object"
                )
            yield f"{path}:{number}", record


def tokenize(source, tokenizer, *, task: str, config, max_length: int) -> Examples:
    """Tokenises every record of `source` for `task`; a bad record is a TrainingError naming where it is."""
    if tokenizer is None:
        raise TrainingError(
            "hfjax training data: the model has no tokenizer; load a checkpoint with tokenizer files, or pass Examples"
        )
    kind = _KINDS.get(task)
    if kind is None:
        raise TrainingError(
            f"hfjax training data: task={task!r} has no data format; the trainer reads data for {sorted(_KINDS)}"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows = []
    for where, record in read_records(source):
        try:
            row = _TOKENIZERS[kind](record, tokenizer, config)
        except KeyError as missing:
            raise TrainingError(f"{where}: no field {missing}; {_FORMATS[kind]}") from None
        except (TypeError, ValueError) as error:
            raise TrainingError(f"{where}: {error}; {_FORMATS[kind]}") from None
        row["input_ids"] = row["input_ids"][:max_length]
        if kind != "classification":
            row["labels"] = row["labels"][:max_length]
        rows.append(row)
    if not rows:
        raise TrainingError(f"hfjax training data: {source!r} holds no records")
    return Examples(tuple(rows), kind, pad_id)


_FORMATS = {
    "causal": 'each record is {"text": ...} or {"messages": [{"role": ..., "content": ...}, ...]}',
    "classification": 'each record is {"text": ..., "label": class id or name}',
    "seq2seq": 'each record is {"source": ..., "target": ...}',
}


def _causal(record: dict, tokenizer, config) -> dict:
    if "messages" in record:
        return chat_example(tokenizer, record["messages"])
    text = record["text"]
    if not isinstance(text, str):
        raise TypeError(f"text is a {type(text).__name__}, not a string")
    ids = tokenizer(text)["input_ids"]
    return {"input_ids": ids, "labels": list(ids)}


def chat_example(tokenizer, messages: list[dict]) -> dict:
    """A conversation through the chat template, labels on the assistant's turns only.

    The template's text of the first i messages with the assistant's turn opened is a prefix of
    that of the first i + 1; the tokens between the two, where message i is the assistant's, are
    its turn (its end-of-turn marker included).
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise TypeError("messages is not a list of {'role': ..., 'content': ...}")
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template to put messages into text")

    def ids(conversation, opened):
        return list(
            tokenizer.apply_chat_template(conversation, add_generation_prompt=opened, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )

    full = ids(messages, False)
    labels = [IGNORE] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = len(ids(messages[:i], True)), len(ids(messages[: i + 1], False))
        if full[:end] != ids(messages[: i + 1], False):
            raise ValueError("the chat template's text of a conversation does not start with that of its first turns")
        labels[start:end] = full[start:end]
    return {"input_ids": full, "labels": labels}


def _classification(record: dict, tokenizer, config) -> dict:
    label = record["label"]
    if isinstance(label, str) and not label.lstrip("-").isdigit():
        if label not in (config.label2id or {}):
            raise ValueError(f"label {label!r} is not one of the model's labels {sorted(config.label2id or {})}")
        label = config.label2id[label]
    label = int(label)
    if not 0 <= label < config.num_labels:
        raise ValueError(f"label {label} is outside the model's {config.num_labels} classes")
    pair = record.get("text_pair")
    return {"input_ids": tokenizer(record["text"], pair)["input_ids"], "labels": label}


def _seq2seq(record: dict, tokenizer, config) -> dict:
    return {
        "input_ids": tokenizer(record["source"])["input_ids"],
        "labels": tokenizer(text_target=record["target"])["input_ids"],
    }


_TOKENIZERS = {"causal": _causal, "classification": _classification, "seq2seq": _seq2seq}


class BatchStream:
    """Batches of `batch_size` rows drawn from the examples in a shuffled order, epoch after epoch;
    batch k is the same for every run with this seed, so a resumed run sees the data it would have.

    packing: each row holds as many whole examples, in that order, as fit in `max_length` tokens
    (see `pack`), so every batch has one shape and no row is mostly padding."""

    def __init__(self, examples: Examples, batch_size: int, *, seed: int, max_length: int, packing: bool = False):
        if batch_size < 1:
            raise TrainingError(f"hfjax training: batch_size={batch_size}; pass an int >= 1")
        if packing and examples.kind != "causal":
            raise TrainingError(
                f"hfjax training: packing=True packs causal-LM examples; these are {examples.kind} examples. "
                "Pass packing=False"
            )
        self.examples, self.batch_size, self.seed, self.max_length = examples, batch_size, seed, max_length
        self.packing = packing
        self._packed: list[list[list[dict]]] = []  # packing: each epoch's rows, as groups of examples

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def _units(self, epoch: int):
        """What rows are drawn from in `epoch`, in order: the shuffled examples' indices, or packed
        groups of examples."""
        if not self.packing:
            return self._order(epoch)
        while len(self._packed) <= epoch:
            shuffled = [self.examples.rows[i] for i in self._order(len(self._packed))]
            self._packed.append(_groups(shuffled, self.max_length))
        return self._packed[epoch]

    def _drawn(self, k: int) -> list:
        """The units of batch k: places k * batch_size onwards of the epochs one after another."""
        epoch, start = 0, k * self.batch_size
        if not self.packing:  # every epoch has one unit per example
            epoch, start = divmod(start, len(self.examples))
        units = self._units(epoch)
        while start >= len(units):
            start, epoch = start - len(units), epoch + 1
            units = self._units(epoch)
        drawn = []
        while len(drawn) < self.batch_size:
            drawn.append(units[start])
            start += 1
            if start == len(units):
                epoch, start = epoch + 1, 0
                units = self._units(epoch)
        return drawn

    def batch(self, k: int) -> dict[str, np.ndarray]:
        """Batch number `k` (from 0)."""
        return self.batch_and_tokens(k)[0]

    def batch_and_tokens(self, k: int) -> tuple[dict[str, np.ndarray], int]:
        """(batch number `k`, how many of its tokens are examples' rather than padding)."""
        drawn = self._drawn(k)
        if self.packing:
            tokens = sum(len(r["input_ids"]) for group in drawn for r in group)
            return pack(drawn, self.examples.pad_id, self.max_length), tokens
        rows = [self.examples.rows[i] for i in drawn]
        return pad(rows, self.examples, self.max_length), sum(len(r["input_ids"]) for r in rows)

    def epoch(self) -> Iterator[dict[str, np.ndarray]]:
        """Every example once, in order (the last batch may be smaller); not packed."""
        rows = self.examples.rows
        for start in range(0, len(rows), self.batch_size):
            yield pad(rows[start : start + self.batch_size], self.examples, self.max_length)


def _groups(rows: list[dict], max_length: int) -> list[list[dict]]:
    """`rows` in order, cut into runs whose tokens fit in `max_length` (each example is at most that)."""
    groups, current, used = [], [], 0
    for row in rows:
        if current and used + len(row["input_ids"]) > max_length:
            groups.append(current)
            current, used = [], 0
        current.append(row)
        used += len(row["input_ids"])
    groups.append(current)
    return groups


def pack(groups: list[list[dict]], pad_id: int, length: int) -> dict[str, np.ndarray]:
    """Rows of `length` tokens, each the examples of one group one after another, then padding:
    input_ids, labels (-100 on each example's first token, which the one before it must not learn
    to predict, and on padding), position_ids (from 0 in each example and in the padding).

    With position_ids and no attention_mask, transformers' mask functions (masking_utils) keep each
    example's attention within itself, as if it were alone in its row."""
    ids = np.full((len(groups), length), pad_id, np.int32)
    labels = np.full((len(groups), length), IGNORE, np.int32)
    positions = np.zeros((len(groups), length), np.int32)
    for i, group in enumerate(groups):
        at = 0
        for row in group:
            n = len(row["input_ids"])
            ids[i, at : at + n] = row["input_ids"]
            labels[i, at + 1 : at + n] = row["labels"][1:n]
            positions[i, at : at + n] = np.arange(n)
            at += n
        positions[i, at:] = np.arange(length - at)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def pad(rows, examples: Examples, max_length: int) -> dict[str, np.ndarray]:
    """Right-padded int32 arrays: input_ids, attention_mask [B, S]; labels [B, S] (-100 on padding),
    [B] for classification, [B, T] for seq2seq. S and T round up to a bucket."""
    length = _buckets.bucket(max(len(r["input_ids"]) for r in rows), smallest=16, limit=max_length)
    ids = np.full((len(rows), length), examples.pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = row["input_ids"]
        mask[i, : len(row["input_ids"])] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if examples.kind == "classification":
        batch["labels"] = np.array([r["labels"] for r in rows], np.int32)
        return batch
    target = (
        length
        if examples.kind == "causal"
        else _buckets.bucket(max(len(r["labels"]) for r in rows), smallest=16, limit=max_length)
    )
    labels = np.full((len(rows), target), IGNORE, np.int32)
    for i, row in enumerate(rows):
        labels[i, : len(row["labels"])] = row["labels"]
    batch["labels"] = labels
    return batch
