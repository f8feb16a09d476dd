"""`hfjax classify`: label probabilities for texts, from a classification head or zero-shot."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "classify",
        help="label probabilities for texts (a classification head, or zero-shot with a causal LM)",
        description="With a sequence-classification checkpoint, prints its head's probabilities. With a causal LM, "
        "classifies zero-shot: scores each label as the continuation of a prompt built from the text. "
        "One line per text, best label first.",
    )
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("texts", nargs="+", metavar="TEXT", help="texts to classify")
    parser.add_argument(
        "--labels",
        default=None,
        help="comma-separated labels, e.g. positive,negative: required with a causal LM; "
        "with a classification head, new names for its labels (default: config.id2label)",
    )
    parser.add_argument(
        "--template",
        default=None,
        help="causal LM only: the prompt, with a {text} field and optionally {labels} "
        "(default: a question that lists the labels)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights dtype (default: the checkpoint's)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per text: text, label, scores")


def run(args: argparse.Namespace) -> int:
    import hfjax

    labels = None
    if args.labels is not None:
        labels = [label.strip() for label in args.labels.split(",")]
        if not all(labels):
            message = f"--labels: empty label in {args.labels!r}; write e.g. --labels positive,negative"
            print(f"hfjax classify: {message}", file=sys.stderr)
            return 2
    try:
        model = hfjax.load(args.model, dtype=args.dtype)
    except ValueError as error:  # LoadError
        print(f"hfjax classify: {error}", file=sys.stderr)
        return 1
    try:
        results = model.classify(args.texts, labels, template=args.template)
    except ValueError as error:
        print(f"hfjax {error}", file=sys.stderr)  # the message starts with "classify: "
        return 1
    for text, scores in zip(args.texts, results):
        best_first = sorted(scores.items(), key=lambda item: item[1], reverse=True)
        if args.json:
            print(json.dumps({"text": text, "label": best_first[0][0], "scores": scores}))
        else:
            print("  ".join(f"{label} {prob:.4f}" for label, prob in best_first))
    return 0
