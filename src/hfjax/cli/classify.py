"""`hfjax classify`: label probabilities for texts, from a classification head or zero-shot."""

from __future__ import annotations

import argparse
import json
import sys

from ._options import model_options, model_path, quantize_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "classify",
        parents=[model_options(mesh=False, quantize=True)],
        help="label probabilities for texts or an image (a classification head, or zero-shot)",
        description="With a sequence-classification checkpoint, prints its head's probabilities. With a causal LM, "
        "classifies zero-shot: scores each label as the continuation of a prompt built from the text. "
        "With --image, an image classifier (ViT, ...) or, with --labels, a zero-shot one (CLIP, SigLIP). "
        "One line per text or image, best label first.",
    )
    parser.add_argument(
        "texts",
        nargs="*",
        metavar="TEXT",
        help="texts to classify, after MODEL (with --model: every positional argument)",
    )
    parser.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="FILE",
        help="an image file to classify (repeatable; default: none, classify TEXTs)",
    )
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
    parser.add_argument("--json", action="store_true", help="print one JSON object per text: text, label, scores")


def run(args: argparse.Namespace) -> int:
    args.model = model_path(args)
    import hfjax

    labels = None
    if args.labels is not None:
        labels = [label.strip() for label in args.labels.split(",")]
        if not all(labels):
            message = f"--labels: empty label in {args.labels!r}; write e.g. --labels positive,negative"
            print(f"hfjax classify: {message}", file=sys.stderr)
            return 2
    if args.image and args.texts:
        print("hfjax classify: pass texts or --image, not both", file=sys.stderr)
        return 2
    if not args.image and not args.texts:
        print(
            f"hfjax classify: nothing to classify; pass texts after MODEL {args.model!r}, or --image FILE",
            file=sys.stderr,
        )
        return 2
    if args.image:
        return _classify_images(args, labels)
    try:
        model = hfjax.load(args.model, dtype=args.dtype, **quantize_options(args))
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


def _classify_images(args: argparse.Namespace, labels: list[str] | None) -> int:
    import hfjax
    from hfjax import _tasks, bridge

    try:
        task = _tasks.infer(bridge.read_config(bridge.resolve_checkpoint(args.model)))
        if task not in ("image-classification", "zero-shot-image-classification"):
            raise hfjax.PipelineError(
                f"--image: {args.model!r} is a {task} model; pass an image-classification checkpoint (ViT, ...) "
                "or a zero-shot one (CLIP, SigLIP) with --labels"
            )
        if task == "zero-shot-image-classification" and not labels:
            raise hfjax.PipelineError(
                f"--image: {args.model!r} classifies zero-shot; pass the candidate labels, e.g. --labels cat,dog"
            )
        images = [_open_image(path) for path in args.image]
        classifier = hfjax.pipeline(task, model=args.model, dtype=args.dtype)
        if task == "image-classification":
            results = [classifier(image, top_k=None) for image in images]
            if labels is not None:
                raise hfjax.PipelineError("--labels: an image-classification head names its own labels; leave it out")
        else:
            results = [classifier(image, candidate_labels=labels) for image in images]
    except ValueError as error:  # PipelineError, LoadError
        print(f"hfjax classify: {error}", file=sys.stderr)
        return 1
    for path, result in zip(args.image, results):
        if args.json:
            scores = {item["label"]: item["score"] for item in result}
            print(json.dumps({"image": path, "label": result[0]["label"], "scores": scores}))
        else:
            print("  ".join(f"{item['label']} {item['score']:.4f}" for item in result))
    return 0


def _open_image(path: str):
    from hfjax import PipelineError

    try:
        import PIL.Image
    except ImportError as error:
        raise PipelineError(f"--image {path}: reading images needs Pillow: pip install 'hfjax[vision]'") from error

    try:
        with PIL.Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise PipelineError(f"--image: {path!r} does not exist") from None
    except PIL.UnidentifiedImageError:
        raise PipelineError(f"--image: {path!r} is not an image file PIL can read (PNG, JPEG, ...)") from None
