"""`hfjax generate`: continue a prompt, streaming the text to stdout.

Also the generation flags, the model loading and the --stats line that `hfjax chat` shares.
"""

from __future__ import annotations

import argparse
import math
import sys

from ._options import at_least_one, mesh, model_options, model_path, quantize_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        parents=[model_options(quantize=True)],
        help="continue a prompt with a causal LM, streaming the text",
        description="Tokenizes PROMPT, generates with the whole decode loop compiled, and streams the new text "
        "to stdout. Settings not given come from the checkpoint's generation_config.json, except beam search "
        "(num_beams): one streamed answer is decoded greedily or by sampling.",
    )
    parser.add_argument("prompt", help="the text to continue (with --image: the question about the images)")
    add_image_argument(parser)
    add_generation_arguments(parser)


def add_image_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image file for a vision-language model, put before the text (repeat for several; default: none)",
    )


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `generate` and `chat` share: max_new_tokens, sampling, seed, --stats."""
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample at this temperature; 0 decodes greedily (default: the checkpoint's generation_config)",
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample from the k most likely tokens (default: generation_config's)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the most likely tokens whose probabilities add up to p, in (0, 1] "
        "(default: generation_config's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampler seed: the same seed gives the same text")
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print time to first token, tokens/s and whether XLA compiled anything to stderr",
    )


def generation_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of `Model.generate` from the flags, checked before the model loads.

    --temperature, --top-k or --top-p turn sampling on, --temperature 0 turns it off, and
    with none of them the checkpoint's generation_config decides. Its num_beams is
    overridden: the commands stream one answer, which beam search cannot do.

    Raises:
      ValueError: for a setting out of range, naming the flag's value.
    """
    from hfjax.generation import SamplingConfig, check_limits

    check_limits(0, args.max_new_tokens, context=None)  # the prompt and the context are checked by generate
    at_least_one(args, "model_parallel", "data_parallel")
    sampling = {
        name: getattr(args, name) for name in ("temperature", "top_k", "top_p") if getattr(args, name) is not None
    }
    do_sample = None
    if args.temperature == 0:
        do_sample = False
        del sampling["temperature"]
    elif sampling:
        do_sample = True
    if sampling:
        SamplingConfig(do_sample=bool(do_sample), **sampling)
    return dict(max_new_tokens=args.max_new_tokens, do_sample=do_sample, num_beams=1, seed=args.seed, **sampling)


def prepare(args: argparse.Namespace, command: str):
    """Checks the flags, then loads the model: returns (model, `Model.generate` keyword
    arguments), or, after printing the error on one line, the exit code: 2 for a bad flag,
    1 for a model that cannot generate text."""
    args.model = model_path(args)
    try:
        kwargs = generation_kwargs(args)
    except ValueError as error:
        print(f"hfjax {command}: {error}", file=sys.stderr)
        return 2
    try:
        return _load_causal_lm(args), kwargs
    except ValueError as error:  # LoadError is a ValueError too
        print(f"hfjax {command}: {error}", file=sys.stderr)
        return 1


def _load_causal_lm(args: argparse.Namespace):
    import hfjax

    model = hfjax.load(args.model, dtype=args.dtype, mesh=mesh(args), **quantize_options(args))
    if model.tokenizer is None:
        raise ValueError(f"the checkpoint at {args.model!r} has no tokenizer files, so text cannot be encoded")
    if getattr(args, "image", None):
        from hfjax.generation import check_takes_images, load_image

        check_takes_images(model, caller=f"--model {args.model!r} with --image")
        for image in args.image:  # a bad file is named before anything is generated
            load_image(image)
    if model.task not in ("text-generation", "text2text-generation", "image-text-to-text"):
        raise ValueError(
            f"{args.model!r} was loaded for task={model.task!r} ({type(model.module).__name__}); "
            "generation needs a causal or sequence-to-sequence LM"
        )
    return model


def text_streamer(model):
    """A transformers `TextStreamer` that prints new text to stdout, flushed, as tokens arrive."""
    from transformers import TextStreamer

    return TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)


def print_stats(model, compiles) -> None:
    """The --stats line on stderr; `compiles`: the call's `hfjax.bridge.Compiles`."""
    stats = model.last_generation_stats
    rate = f"{stats.tokens_per_second:.1f} tokens/s" if math.isfinite(stats.tokens_per_second) else "no decode steps"
    compiled = ", compiled in this call" if compiles.compiled else ""
    print(
        f"{stats.prompt_tokens} prompt tokens, {stats.new_tokens} new tokens: time to first token "
        f"{stats.time_to_first_token:.3f} s, {rate}, total {stats.total:.3f} s{compiled}",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    from hfjax import bridge

    prepared = prepare(args, "generate")
    if isinstance(prepared, int):
        return prepared
    model, kwargs = prepared
    try:
        with bridge.Compiles() as compiles:
            if args.image:
                from hfjax.generation import chat_with_images

                content = [
                    *({"type": "image", "image": image} for image in args.image),
                    {"type": "text", "text": args.prompt},
                ]
                chat_with_images(model, [{"role": "user", "content": content}], streamer=text_streamer(model), **kwargs)
            else:
                # verbose=False: a prompt too long for the context is generate's one-line error.
                encoded = model.tokenizer(args.prompt, return_tensors="np", verbose=False)
                model.generate(encoded["input_ids"], encoded["attention_mask"], streamer=text_streamer(model), **kwargs)
    except ValueError as error:  # e.g. the prompt and max_new_tokens exceed the model's context
        print(f"hfjax generate: {error}", file=sys.stderr)
        return 1
    if args.stats:
        print_stats(model, compiles)
    return 0
