"""`hfjax serve`: an OpenAI-compatible HTTP server with continuous batching (needs `pip install "hfjax[serve]"`)."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import signal
import sys

from .. import _dtypes

_EXTRA = ("fastapi", "uvicorn")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over the OpenAI HTTP API, with continuous batching",
        description="Loads MODEL and answers /v1/chat/completions, /v1/completions (causal LMs), /v1/embeddings "
        "(encoders), /v1/models, /health, /metrics, and a chat page at /. Requests join and leave a batch of "
        "--max-batch sequence slots between decode chunks. SIGTERM stops accepting requests, finishes those in "
        'flight and exits 0. Needs the serve extra: pip install "hfjax[serve]".',
    )
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients pass (default: the --model argument)"
    )
    parser.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens of one request, prompt and answer (default: the model's context, at most 2048)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=256, help="requests waiting for a slot before 429 answers (default 256)"
    )
    parser.add_argument(
        "--dtype", choices=_dtypes.NAMES, default=None, help="weights dtype (default: the checkpoint's)"
    )
    parser.add_argument("--model-parallel", type=int, default=1, help="split the weights over this many devices")
    parser.add_argument("--data-parallel", type=int, default=1, help="split the batch over this many devices")
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ endpoints (else 401)"
    )
    parser.add_argument("--decode-steps", type=int, default=4, help="decode steps per chunk of every slot (default 4)")
    parser.add_argument(
        "--max-decode-steps",
        type=int,
        default=None,
        help="the most decode steps of a chunk of fewer rows, which run as many steps as take about the time of a "
        "full chunk while no request waits (default: 4 x --decode-steps; equal to it: every chunk the same)",
    )
    parser.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per prefill chunk (default 64)")
    parser.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="read every prompt whole, even when a free slot holds the keys of its first tokens",
    )
    parser.add_argument(
        "--prefill-rows", type=int, default=4, help="prompts read together in one prefill call (default 4)"
    )


def _exit_cleanly(signum, frame):
    sys.exit(0)


def missing_extra() -> list[str]:
    """The serve extra's packages that are not installed."""
    return [name for name in _EXTRA if importlib.util.find_spec(name) is None]


def run(args: argparse.Namespace) -> int:
    missing = missing_extra()
    if missing:
        print(
            f'hfjax serve needs {", ".join(missing)}, which are not installed; run: pip install "hfjax[serve]"',
            file=sys.stderr,
        )
        return 1
    flags = (
        "max_batch",
        "max_queue",
        "model_parallel",
        "data_parallel",
        "decode_steps",
        "prefill_chunk",
        "prefill_rows",
    )
    for flag in flags:
        if getattr(args, flag) < 1:
            print(f"hfjax serve: --{flag.replace('_', '-')}={getattr(args, flag)} must be at least 1", file=sys.stderr)
            return 2
    if args.max_decode_steps is not None and args.max_decode_steps < args.decode_steps:
        print(
            f"hfjax serve: --max-decode-steps={args.max_decode_steps} must be at least --decode-steps="
            f"{args.decode_steps}",
            file=sys.stderr,
        )
        return 2
    import uvicorn

    import hfjax
    from hfjax.serving import Engine
    from hfjax.serving._app import build_app

    mesh = None
    if args.model_parallel * args.data_parallel > 1:
        mesh = hfjax.make_mesh(data=args.data_parallel, model=args.model_parallel)
    model = hfjax.load(args.model, dtype=args.dtype, mesh=mesh)
    gc.freeze()  # see below; here it spares the warm-up's compiles the full passes over the model
    engine = None
    if model.task == "text-generation":
        engine = Engine(
            model, max_batch=args.max_batch, max_model_len=args.max_model_len, max_queue=args.max_queue,
            decode_steps=args.decode_steps, max_decode_steps=args.max_decode_steps, prefill_chunk=args.prefill_chunk, prefill_rows=args.prefill_rows,
            prefix_reuse=not args.no_prefix_reuse,
        )  # fmt: skip
        engine.warm_up()
    elif model.task != "feature-extraction":
        print(
            f"hfjax serve: {args.model} loads as task={model.task!r}; serve a causal LM or an encoder", file=sys.stderr
        )
        return 2
    # What is loaded by now lives as long as the server: out of the garbage collector's full passes,
    # which otherwise scanned all of it mid-stream (pauses of 100-270 ms, seen at one stream).
    gc.freeze()
    name = args.served_model_name or args.model
    app = build_app(model, served_model_name=name, engine=engine, api_key=args.api_key)
    print(f"hfjax serve: {name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM (no new connections, the answers in flight finished, the engine
    # stopped), then raises the signal again under the handler it found: this one makes that an exit with 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=None)
    return 0
