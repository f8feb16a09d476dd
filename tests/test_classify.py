"""`Model.classify` (hfjax._classify) and `hfjax classify` against the same computation in PyTorch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

import hfjax
from hfjax import cli, tolerances
from hfjax._classify import DEFAULT_TEMPLATE, classify, label_log_likelihoods

TEXTS = ["I loved this film, it was wonderful.", "Terrible.", "The river ran quietly past the old mill."]
LABELS = ["positive", "negative", "neutral"]


def _torch_label_log_likelihoods(path, texts, labels, template):
    # Each (text, label) alone, unpadded: sum of log P(label token | everything before it).
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    scores = np.zeros((len(texts), len(labels)))
    for i, text in enumerate(texts):
        prompt_ids = tokenizer(template.format(text=text, labels=", ".join(labels)))["input_ids"]
        for j, label in enumerate(labels):
            label_ids = tokenizer(" " + label, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + label_ids])).logits[0]
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            scores[i, j] = sum(log_probs[len(prompt_ids) + k - 1, t].item() for k, t in enumerate(label_ids))
    return scores


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_zero_shot_scores_match_pytorch(checkpoint, family):
    path = checkpoint(family)
    model = hfjax.load(path)
    expected = _torch_label_log_likelihoods(path, TEXTS, LABELS, DEFAULT_TEMPLATE)
    # 9 rows in chunks of 4: padded rows, padded lengths, and a last chunk of one row.
    got = label_log_likelihoods(model, TEXTS, LABELS, template=DEFAULT_TEMPLATE, batch_size=4)
    assert got.shape == (3, 3)
    np.testing.assert_allclose(got, expected, atol=tolerances.DEFAULT.atol, rtol=0)

    probs = classify(model, TEXTS, LABELS, batch_size=4)
    expected_probs = torch.softmax(torch.tensor(expected), dim=-1).numpy()
    assert [list(p) for p in probs] == [LABELS] * 3
    np.testing.assert_allclose([list(p.values()) for p in probs], expected_probs, atol=tolerances.DEFAULT.atol, rtol=0)


@pytest.mark.parametrize(
    "family, overrides",
    [("qwen3", {}), ("bert", {}), ("qwen3", {"pad_token_id": None}), ("bart", {}), ("t5", {})],
    # bart and t5 pool each row's last EOS (a boolean-mask index, sized by the data: hfjax._specialize)
    ids=["qwen3", "bert", "qwen3-no-pad-id", "bart", "t5"],
)
def test_head_probabilities_match_pytorch(checkpoint, family, overrides):
    path = checkpoint(family, task="text-classification", **overrides)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    expected = []
    for text in TEXTS:
        with torch.no_grad():
            logits = reference(**tokenizer(text, return_tensors="pt")).logits[0]
        expected.append(torch.softmax(logits, dim=-1).numpy())

    probs = classify(hfjax.load(path), TEXTS, batch_size=2)
    assert [list(p) for p in probs] == [["negative", "positive"]] * 3
    np.testing.assert_allclose([list(p.values()) for p in probs], expected, atol=tolerances.DEFAULT.atol, rtol=0)


def test_head_labels_rename_and_count_check(checkpoint):
    model = hfjax.load(checkpoint("qwen3", task="text-classification"))
    default, renamed = classify(model, "fine"), classify(model, "fine", ["bad", "good"])
    assert list(renamed[0].items()) == list(zip(["bad", "good"], default[0].values()))
    with pytest.raises(ValueError, match=r"has 2 labels \['negative', 'positive'\].*Got 3"):
        classify(model, "fine", LABELS)
    with pytest.raises(ValueError, match="template= only applies"):
        classify(model, "fine", template="{text}")


def test_bad_arguments_give_clear_errors(checkpoint):
    model = hfjax.load(checkpoint("llama"))
    with pytest.raises(ValueError, match="needs candidate labels"):
        classify(model, "fine")
    with pytest.raises(ValueError, match="labels is empty"):
        classify(model, "fine", [])
    with pytest.raises(ValueError, match=r"distinct. Got \['yes'\]"):
        classify(model, "fine", ["yes", "no", "yes"])
    with pytest.raises(ValueError, match="list of strings. Got the string"):
        classify(model, "fine", "yes,no")
    with pytest.raises(ValueError, match=r"should contain \{text\}"):
        classify(model, "fine", ["yes", "no"], template="Review:")
    with pytest.raises(ValueError, match="unknown: \\['label'\\]"):
        classify(model, "fine", ["yes", "no"], template="{text} {label}")
    with pytest.raises(ValueError, match="more than the model's context of 256"):
        classify(model, "word " * 300, ["yes", "no"])
    assert classify(model, [], ["yes", "no"]) == []
    # A trailing space in the template moves onto the label, so it scores the same tokens.
    assert classify(model, "fine", ["yes", "no"], template="{text}\nAnswer: ") == classify(
        model, "fine", ["yes", "no"], template="{text}\nAnswer:"
    )

    encoder = hfjax.load(checkpoint("bert"))
    with pytest.raises(ValueError, match="task='feature-extraction'"):
        classify(encoder, "fine", ["yes", "no"])


def test_cli_prints_the_scores_of_classify(checkpoint, capsys):
    path = checkpoint("llama")
    expected = classify(hfjax.load(path), TEXTS[:2], ["positive", "negative"])

    assert cli.main(["classify", "--model", str(path), "--labels", "positive, negative", *TEXTS[:2]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, scores in zip(lines, expected):
        words = line.split()
        printed = dict(zip(words[::2], map(float, words[1::2])))
        assert list(printed) == sorted(scores, key=scores.get, reverse=True)  # best label first
        np.testing.assert_allclose(
            list(printed.values()), [scores[k] for k in printed], atol=tolerances.PRINTED_4_DECIMALS.atol
        )

    assert cli.main(["classify", "--model", str(path), "--labels", "positive,negative", "--json", *TEXTS[:2]]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in records] == TEXTS[:2]
    assert [r["label"] for r in records] == [max(s, key=s.get) for s in expected]
    for record, scores in zip(records, expected):
        np.testing.assert_allclose(
            list(record["scores"].values()), list(scores.values()), atol=tolerances.JSON_FLOATS.atol
        )


def test_cli_head_model_needs_no_labels(checkpoint, capsys):
    path = checkpoint("qwen3", task="text-classification")
    assert cli.main(["classify", "--model", str(path), "--json", "fine"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert list(record["scores"]) == ["negative", "positive"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--labels", "yes,,no", "text"], "--labels: empty label"),
        (["text"], "needs candidate labels"),
        (["--labels", "yes,no", "--template", "no field", "text"], "should contain {text}"),
    ],
)
def test_cli_bad_input_is_one_line_on_stderr(checkpoint, capsys, argv, message):
    path = checkpoint("llama")
    capsys.readouterr()  # writing the checkpoint shows a progress bar
    code = cli.main(["classify", "--model", str(path), *argv])
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert err.startswith("hfjax classify: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
