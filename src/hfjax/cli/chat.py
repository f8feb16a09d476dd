"""`hfjax chat`: a multi-turn terminal chat through the tokenizer's chat template.

Reads one message per line from stdin, so it can be driven by a pipe:
`printf 'hi\\n/reset\\nhello\\n' | hfjax chat --model PATH`.
"""

from __future__ import annotations

import argparse
import sys

from ._options import model_options
from .generate import (
    add_generation_arguments,
    add_image_argument,
    prepare,
    print_stats,
    text_streamer,
)

_HELP = "/reset starts a new conversation, /exit quits (so do Ctrl-D and Ctrl-C)"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "chat",
        parents=[model_options(quantize=True)],
        help="multi-turn chat in the terminal, with the tokenizer's chat template",
        description=f"Chat with a model, one message per line; replies stream as they are generated. {_HELP}.",
    )
    parser.add_argument("--system", default=None, help="a system prompt that starts every conversation (default: none)")
    add_image_argument(parser)
    add_generation_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from hfjax import bridge
    from hfjax._model import chat_prompt

    prepared = prepare(args, "chat")
    if isinstance(prepared, int):
        return prepared
    model, kwargs = prepared
    tokenizer = model.tokenizer
    if not tokenizer.chat_template and not args.image:
        print(
            f"hfjax chat: the tokenizer of {args.model!r} has no chat template; use `hfjax generate` instead",
            file=sys.stderr,
        )
        return 1
    context = bridge.context_length(model.config)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    print(f"hfjax chat: {model}. {_HELP}.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> " if interactive else "").strip()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print(file=sys.stderr)
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            messages = list(start)
            print("[new conversation]", file=sys.stderr)
            continue
        if not line:
            continue
        if args.image and len(messages) == len(start):  # the images open each conversation
            content = [*({"type": "image", "image": image} for image in args.image), {"type": "text", "text": line}]
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "user", "content": line})
        if args.image:
            from hfjax.generation import encode

            encoded, prompt_length = encode(model, [messages])
        else:
            # verbose=False: a conversation that outgrows the context gets hfjax's own message below.
            text = tokenizer(
                chat_prompt(tokenizer, messages), add_special_tokens=False, return_tensors="np", verbose=False
            )
            encoded = {"input_ids": text["input_ids"], "attention_mask": text["attention_mask"]}
            prompt_length = encoded["input_ids"].shape[1]
        room = kwargs["max_new_tokens"] if context is None else min(kwargs["max_new_tokens"], context - prompt_length)
        if room < 1:
            messages.pop()
            print(
                f"hfjax chat: the conversation fills the model's context of {context} tokens; /reset to start over",
                file=sys.stderr,
            )
            continue
        try:
            with bridge.Compiles() as compiles:
                out = model.generate(
                    **encoded,
                    streamer=text_streamer(model),
                    **{**kwargs, "max_new_tokens": room, "seed": kwargs["seed"] + turn},
                )
        except KeyboardInterrupt:
            messages.pop()
            print("\n[reply interrupted]", file=sys.stderr)
            continue
        except ValueError as error:
            messages.pop()
            print(f"hfjax chat: {error}", file=sys.stderr)
            continue
        new = (
            1 if getattr(model.config, "is_encoder_decoder", False) else prompt_length
        )  # after the decoder start token
        reply = tokenizer.decode(out[0, new:].tolist(), skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
        turn += 1
        if args.stats:
            print_stats(model, compiles)
