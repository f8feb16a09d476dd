"""`hfjax serve`: an OpenAI-compatible HTTP server with continuous batching (needs `pip install "hfjax[serve]"`)."""

from __future__ import annotations

import argparse
import errno
import gc
import importlib.util
import json
import os
import pathlib
import signal
import socket
import sys
from typing import NamedTuple

from ._options import mesh, model_options, model_path, quantize_options

_EXTRA = ("fastapi", "uvicorn", "prometheus_client")
# hfjax.serving.TOOL_CALL_PARSERS, without importing it (no JAX at parse time)
_TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")

_SWITCH_INTERVAL_S = 0.0005  # the GIL's, in the server's process (below)
# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, read as vLLM reads it
_RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_LORA_MODULE_FORMS = 'NAME=PATH or JSON such as \'{"name": "mine", "path": "/path/to/adapter"}\''
# --speculative-config: vLLM's keys that hfjax carries out, and vLLM's methods it does not
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
_SPECULATIVE_NOT_DONE = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
_SPECULATIVE_EXAMPLE = '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\''


class SpeculativeConfig(NamedTuple):
    """--speculative-config, read as vLLM reads it: "ngram" (prompt lookup: suffixes of prompt_lookup_max
    down to prompt_lookup_min tokens, both 5 where neither is given, else the one given) or
    "draft_model" (`model`, a checkpoint of the same tokenizer), drafting num_speculative_tokens."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    model: str | None = None


class LoraModule(NamedTuple):
    """One --lora-modules entry (vLLM's): the name requests give as `model`, the peft adapter directory,
    and the base name its /v1/models card gives as parent (None: the served model name)."""

    name: str
    path: str
    base_model_name: str | None = None


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        parents=[model_options(quantize=True)],
        help="serve a model over the OpenAI HTTP API, with continuous batching",
        description="Loads MODEL and answers /v1/chat/completions, /v1/completions (causal LMs), /v1/embeddings "
        "(encoders), /v1/models, /tokenize, /detokenize, /version, /health, /metrics, and a chat page at /. "
        "Requests join and leave a batch of --max-batch sequence slots between decode chunks; with --enable-lora, "
        "each runs on the LoRA adapter its model names, or on the base. SIGTERM stops "
        'accepting requests, finishes those in flight and exits 0. Needs the serve extra: pip install "hfjax[serve]".',
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients pass (default: MODEL as given)"
    )
    parser.add_argument(
        "--max-batch",
        "--max-num-seqs",
        dest="max_batch",
        type=int,
        default=None,
        help="sequences decoded together, at most (default: as many as the KV cache's memory holds, at most 256 "
        "on an accelerator and 64 on the CPU)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="most tokens of one request, prompt and answer (default: the model's context)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=_byte_count,
        default=None,
        help="memory for the KV cache, in bytes or with a unit (4GiB, 512MiB); it overrides "
        "--gpu-memory-utilization (default: 80%% of the accelerator's free memory; on the CPU a quarter of the "
        "free RAM, at most 4GiB)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="vLLM's sizing of the KV cache: it takes FRACTION, in (0, 1], of the device's memory less what is in "
        "use once the model is loaded; the device's memory is what JAX may allocate on an accelerator, and on the "
        "CPU the machine's RAM, less the RAM every process uses; not used with --kv-cache-memory (default: unset, "
        "when --kv-cache-memory's sizing applies)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=256, help="requests waiting for a slot before 429 answers (default: 256)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ endpoints, else 401 (default: no key needed)",
    )
    parser.add_argument("--decode-steps", type=int, default=4, help="decode steps per chunk of every slot (default: 4)")
    parser.add_argument(
        "--max-decode-steps",
        type=int,
        default=None,
        help="the most decode steps of a chunk of fewer rows, which run as many steps as take about the time of a "
        "full chunk while no request waits (default: 8 x --decode-steps; equal to it: every chunk the same)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=64,
        help="prompt tokens per row of a prefill call (default: 64); calls over a longer window read more, an eighth "
        "of the window up to 4x this, and the whole rest of short prompts runs in calls of 32 where this is wider",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start a prompt in the free slot whose KV cache holds the longest prefix of it, reading only the "
        "rest; --no-enable-prefix-caching reads every prompt whole",
    )
    parser.add_argument(
        "--no-prefix-reuse",
        dest="enable_prefix_caching",
        action="store_false",
        help="the same as --no-enable-prefix-caching (its older name)",
    )
    parser.add_argument(
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
        dest="disable_log_requests",
        action="store_true",
        help="no access line per request ('INFO:     127.0.0.1:PORT - \"POST /v1/chat/completions HTTP/1.1\" 200 OK')",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        default="info",
        help="uvicorn's log level; above info, no access lines and no start-up lines of uvicorn's",
    )
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats line (prompt and generation tokens/s, requests running and waiting) every 10 s while busy",
    )
    parser.add_argument(
        "--prefill-rows", type=int, default=4, help="prompts read together in one prefill call (default: 4)"
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a directory whose image files chat requests may name (file:// URLs or paths in image_url parts) "
        "(default: none, no local file is read; vLLM's flag, a security risk: use it only in a trusted environment)",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        help="the most images a chat request may hold, as vLLM's JSON: '{\"image\": 2}' (default: 999)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='read chat answers for tool calls (tool_choice "auto", which a request with tools gets when it leaves '
        "tool_choice out) with --tool-call-parser, or without it the tokenizer's response_template (transformers' "
        'parse_response); without this flag a request with tools needs tool_choice "none"',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=tuple(_TOOL_CALL_PARSERS),
        default=None,
        help="how the model writes tool calls, by vLLM's names: hermes (<tool_call> JSON blocks: Hermes, Qwen 2.5, "
        "Qwen 3), llama3_json (Llama 3.x JSON objects), mistral ([TOOL_CALLS] and a JSON list), pythonic "
        "([f(x=1), g()]) (default: none; with --enable-auto-tool-choice, the tokenizer's response_template)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model: a request's model picks one by name (or the base); with "
        f"{_RUNTIME_LORA}=1 in the environment, POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and "
        "unload them while the server runs",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="with --enable-lora, peft adapter directories to serve from the start, each NAME=PATH or vLLM's JSON "
        '\'{"name": NAME, "path": PATH, "base_model_name": BASE}\' (default: none)',
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="with --enable-lora, adapters held at once (each takes its slot's memory whether loaded or not)",
    )
    parser.add_argument(
        "--max-lora-rank", type=int, default=16, help="with --enable-lora, the highest rank of an adapter served"
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M}\' (prompt lookup) or \'{"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": K}\' (a draft model of the same tokenizer); the same tokens, '
        "fewer forwards of the model (default: none)",
    )


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's JSON read as vLLM reads it (a method left out is "draft_model" where a
    model is given).

    Raises:
        ValueError: one line naming what is wrong and the fix.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--speculative-config is not JSON ({error}); pass e.g. {_SPECULATIVE_EXAMPLE}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config is not a JSON object; pass e.g. {_SPECULATIVE_EXAMPLE}")
    unknown = sorted(set(config) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config key {unknown[0]!r} is not one hfjax takes ({', '.join(_SPECULATIVE_KEYS)}); "
            "remove it"
        )
    method = config.get("method", "draft_model" if "model" in config else None)
    method = "ngram" if method == "[ngram]" else method
    if method in _SPECULATIVE_NOT_DONE:
        raise ValueError(
            f'--speculative-config method {method!r} is not carried out by hfjax; pass "ngram" or "draft_model"'
        )
    if method not in ("ngram", "draft_model"):
        raise ValueError(f'--speculative-config method={method!r}; pass "ngram" (prompt lookup) or "draft_model"')
    if "num_speculative_tokens" not in config:
        raise ValueError(
            '--speculative-config needs "num_speculative_tokens" (the tokens drafted per round); add e.g. '
            '"num_speculative_tokens": 3'
        )
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        value = config.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--speculative-config {key}={value!r}; pass a whole number >= 1")
    model = config.get("model")
    if method == "draft_model":
        looked_up = next((key for key in ("prompt_lookup_max", "prompt_lookup_min") if key in config), None)
        if looked_up is not None:
            raise ValueError(f'--speculative-config {looked_up} is for method "ngram"; remove it for "draft_model"')
        if not isinstance(model, str) or not model:
            raise ValueError(
                f'--speculative-config method "draft_model" needs "model": a checkpoint\'s path or hub id (got '
                f"{model!r}); add it"
            )
        return SpeculativeConfig(method, config["num_speculative_tokens"], model=model)
    if model is not None:
        raise ValueError('--speculative-config method "ngram" drafts from the prompt and takes no "model"; remove it')
    longest = config.get("prompt_lookup_max", config.get("prompt_lookup_min", 5))
    shortest = config.get("prompt_lookup_min", config.get("prompt_lookup_max", 5))
    if shortest > longest:
        raise ValueError(
            f"--speculative-config prompt_lookup_min={shortest} is above prompt_lookup_max={longest}; pass a "
            "minimum no larger than the maximum"
        )
    return SpeculativeConfig(method, config["num_speculative_tokens"], longest, shortest)


def load_draft(model, config: SpeculativeConfig):
    """--speculative-config's draft model, in the model's dtype and on its mesh, checked against it:
    (the draft, None), or (None, one line naming the flag and the fix)."""
    import jax.numpy as jnp

    import hfjax
    from hfjax import GenerationError, LoadError

    dtype = next((str(a.dtype) for a in model.params.values() if jnp.issubdtype(a.dtype, jnp.floating)), None)
    where = f"--speculative-config model {config.model!r}"
    try:
        draft = hfjax.load(config.model, dtype=dtype, mesh=model.mesh)
    except (LoadError, OSError, ValueError) as error:
        return None, f"{where}: {error}"
    theirs, ours = (None if m.tokenizer is None else m.tokenizer.get_vocab() for m in (draft, model))
    if theirs != ours:
        return None, f"{where} has another tokenizer than the model's; pass a draft model with the model's tokenizer"
    try:
        from hfjax import generation

        generation.check_draft(model, draft, name=where)
    except GenerationError as error:
        return None, str(error)
    return draft, None


def _lora_module(text: str) -> LoraModule:
    """A --lora-modules entry: NAME=PATH, or JSON {"name", "path", "base_model_name"} (vLLM's forms)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid JSON ({error}); pass {_LORA_MODULE_FORMS}"
            ) from None
        strings = all(isinstance(entry.get(key), str) and entry[key] for key in ("name", "path"))
        if not strings or set(entry) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(
                f'{text!r} needs the strings "name" and "path" (and at most "base_model_name"); pass '
                f"{_LORA_MODULE_FORMS}"
            )
        base = entry.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"{text!r}: base_model_name={base!r} is not a string; pass a model name")
        return LoraModule(entry["name"], entry["path"], base)
    name, equals, path = text.partition("=")
    if not (equals and name and path):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH; pass {_LORA_MODULE_FORMS}")
    return LoraModule(name, path)


def runtime_lora_updating(environ=os.environ) -> bool:
    """Whether VLLM_ALLOW_RUNTIME_LORA_UPDATING allows loading and unloading adapters at run time ("1" or
    "true", in any case, as vLLM reads it)."""
    return environ.get(_RUNTIME_LORA, "0").strip().lower() in ("1", "true")


def _byte_count(text: str) -> int:
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    number = text.strip().lower().rstrip("ibkmg")
    unit = text.strip().lower()[len(number) :]
    try:
        count = int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; pass bytes or a size such as 4GiB or 512MiB"
        ) from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a size above 0, such as 4GiB")
    return count


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; pass a fraction in (0, 1], such as 0.9")
    return value


def _say(line: str) -> None:  # the server's progress, stats and address lines
    print(f"hfjax serve: {line}", file=sys.stderr, flush=True)


def _exit_cleanly(signum, frame):
    sys.exit(0)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn binds one, for uvicorn to listen on once the model is
    loaded: a taken port fails before the loading does.

    Raises:
        OSError, OverflowError: the address cannot be bound (taken, not this machine's, a port past 65535).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_problem(host: str, port: int, error: Exception) -> str:
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return (
            f"hfjax serve: --port {port}: {host}:{port} is already in use (another server listens there); "
            f"pass another port, such as --port {port + 1 if port < 65535 else 8000}"
        )
    reason = (error.strerror if isinstance(error, OSError) and error.strerror else str(error)).rstrip(".")
    return f"hfjax serve: cannot listen on {host}:{port} (--host {host} --port {port}): {reason}; pass another --host or --port"


def missing_extra() -> list[str]:
    """The serve extra's packages that are not installed."""
    return [name for name in _EXTRA if importlib.util.find_spec(name) is None]


def limit_mm_per_prompt(text: str) -> int | None:
    """The images per prompt of vLLM's --limit-mm-per-prompt JSON ('{"image": 2}'; other modalities: 0);
    None where it names no image limit.

    Raises:
        ValueError: not a JSON object of whole numbers >= 0, or a modality other than image above 0.
    """
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--limit-mm-per-prompt {text!r} is not JSON ({error}); pass e.g. '{{\"image\": 2}}'"
        ) from None
    if not isinstance(limits, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values()
    ):
        raise ValueError(
            f"--limit-mm-per-prompt {text!r}: pass a JSON object of whole numbers >= 0, e.g. '{{\"image\": 2}}'"
        )
    others = sorted(name for name, limit in limits.items() if name != "image" and limit > 0)
    if others:
        raise ValueError(
            f"--limit-mm-per-prompt {text!r}: hfjax serve reads images only; leave out {', '.join(others)}"
        )
    return limits.get("image")


def media_policy(args: argparse.Namespace):
    """The server's `MediaPolicy` of --allowed-local-media-path and --limit-mm-per-prompt (checked by preflight)."""
    from hfjax.serving import MediaPolicy

    limit = None if args.limit_mm_per_prompt is None else limit_mm_per_prompt(args.limit_mm_per_prompt)
    local = None if args.allowed_local_media_path is None else pathlib.Path(args.allowed_local_media_path)
    return MediaPolicy(allowed_local_media_path=local, **({} if limit is None else {"image_limit": limit}))


def preflight(args: argparse.Namespace) -> int | None:
    """What `hfjax serve` checks before JAX starts, so that a mistake is one line in the first second:
    the serve extra, the flags, and the port, which it binds (`args.listening`); an exit code, or None."""
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
        "max_loras",
        "max_lora_rank",
    )
    problem = _lora_problem(args)
    if args.limit_mm_per_prompt is not None and not problem:
        try:
            limit_mm_per_prompt(args.limit_mm_per_prompt)
        except ValueError as error:
            problem = str(error)
    if args.allowed_local_media_path is not None and not os.path.isdir(args.allowed_local_media_path):
        problem = problem or (
            f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a directory; pass one that exists"
        )
    if args.speculative_config is not None and not problem:
        try:
            speculative_config(args.speculative_config)
        except ValueError as error:
            problem = str(error)
    if problem:
        print(f"hfjax serve: {problem}", file=sys.stderr)
        return 2
    for flag in flags:
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            print(f"hfjax serve: --{flag.replace('_', '-')}={getattr(args, flag)} must be at least 1", file=sys.stderr)
            return 2
    if args.max_decode_steps is not None and args.max_decode_steps < args.decode_steps:
        print(
            f"hfjax serve: --max-decode-steps={args.max_decode_steps} must be at least --decode-steps="
            f"{args.decode_steps}",
            file=sys.stderr,
        )
        return 2
    model_path(args)
    try:
        args.listening = _listening_socket(args.host, args.port)
    except (OSError, OverflowError) as error:
        print(_bind_problem(args.host, args.port, error), file=sys.stderr)
        return 1
    return None


def _lora_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the LoRA flags together, in one line; else None."""
    modules = args.lora_modules or []
    if modules and not args.enable_lora:
        return f"--lora-modules {modules[0].name}={modules[0].path} needs --enable-lora; pass --enable-lora with it"
    names = [m.name for m in modules]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        return f"--lora-modules names {twice!r} twice; give each adapter a name of its own"
    if args.enable_lora and len(modules) > args.max_loras >= 1:
        return (
            f"--lora-modules names {len(modules)} adapters, more than --max-loras={args.max_loras} holds; pass "
            f"--max-loras {len(modules)} or fewer modules"
        )
    return None


def _load_adapters(model, args: argparse.Namespace) -> str | None:
    """Reserves room for --max-loras adapters of rank <= --max-lora-rank and loads --lora-modules,
    before the engine compiles its programs; one line naming the flag where that fails, else None. The
    slots cover every linear layer but the LM head where adapters may be loaded at run time, else only
    the layers the --lora-modules adapt."""
    from hfjax import LoadError, lora

    targets = None  # every linear layer but the LM head: an adapter loaded at run time may adapt any
    if args.lora_modules and not runtime_lora_updating():  # the adapters are fixed: only their layers pay
        layers = set()
        for module in args.lora_modules:
            try:
                layers |= set(lora.read_adapter(module.path, caller="hfjax serve").layers)
            except LoadError as error:
                return f"--lora-modules {module.name}={module.path}: {error}"
        targets = sorted(layers)
    try:
        model.reserve_adapters(args.max_loras, args.max_lora_rank, targets)
    except LoadError as error:
        return f"--max-loras {args.max_loras} --max-lora-rank {args.max_lora_rank}: {error}"
    for module in args.lora_modules or []:
        try:
            model.load_adapter(module.path, module.name)
        except LoadError as error:
            return f"--lora-modules {module.name}={module.path}: {error}"
        _say(f"LoRA adapter {module.name} from {module.path}")
    return None


# The tasks served through the engine: causal LMs, encoder-decoders on text, speech to text (Whisper).
SERVED_TASKS = ("text-generation", "image-text-to-text", "text2text-generation", "automatic-speech-recognition")


def run(args: argparse.Namespace) -> int:
    """Loads the model and serves it on the socket `preflight` bound."""
    path, sock = model_path(args), args.listening
    import uvicorn

    import hfjax
    from hfjax.serving import Engine, build_app, tool_call_parser

    model = hfjax.load(path, dtype=args.dtype, mesh=mesh(args), **quantize_options(args, path))
    gc.freeze()  # see below; here it spares the warm-up's compiles the full passes over the model
    if args.enable_auto_tool_choice or args.tool_call_parser is not None:
        try:  # before the engine compiles: a parser that cannot be had is an error at once
            tool_call_parser(args.tool_call_parser, model.tokenizer)
        except ValueError as error:
            print(f"hfjax serve: {error}", file=sys.stderr)
            return 2
    if args.enable_lora:
        if model.task != "text-generation":
            print(
                f"hfjax serve: --enable-lora: {path} loads as task={model.task!r}; LoRA serves a causal LM",
                file=sys.stderr,
            )
            return 2
        problem = _load_adapters(model, args)
        if problem:
            print(f"hfjax serve: {problem}", file=sys.stderr)
            return 1
    speculation = draft = None
    speculative = None if args.speculative_config is None else speculative_config(args.speculative_config)
    if speculative is not None:
        if model.task != "text-generation":
            print(f"hfjax serve: --speculative-config: {path} loads as task={model.task!r}; it speeds up a causal LM",
                  file=sys.stderr)  # fmt: skip
            return 2
        from hfjax.generation import Speculation

        if speculative.model is not None:
            draft, problem = load_draft(model, speculative)
            if problem:
                print(f"hfjax serve: {problem}", file=sys.stderr)
                return 2
            _say(f"draft model {speculative.model}")
        speculation = Speculation(**{k: v for k, v in speculative._asdict().items() if k != "model"})
    engine = None
    if model.task in SERVED_TASKS:
        engine = Engine(
            model, max_num_seqs=args.max_batch, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization, max_queue=args.max_queue,
            decode_steps=args.decode_steps, max_decode_steps=args.max_decode_steps, prefill_chunk=args.prefill_chunk,
            prefill_rows=args.prefill_rows, prefix_reuse=args.enable_prefix_caching,
            progress=_say, speculation=speculation, draft=draft,
        )  # fmt: skip
        _say(engine.sizing.describe())
        engine.start()  # every program it will run, compiled (or read from the cache) before it listens
    elif model.task != "feature-extraction":
        print(
            f"hfjax serve: {path} loads as task={model.task!r}; serve a causal LM, a vision-language model, an "
            "encoder-decoder, a speech-to-text model or an encoder",
            file=sys.stderr,
        )
        return 2
    # What is loaded by now lives as long as the server: out of the garbage collector's full passes,
    # which otherwise scanned all of it mid-stream (pauses of 100-270 ms, seen at one stream).
    gc.freeze()
    # The engine thread waits for the device without the GIL; when a chunk's tokens come back while the
    # event loop runs Python, it waited up to CPython's switch interval (5 ms) for the GIL before sending
    # the next chunk, the device idle meanwhile. At 0.5 ms: 1.14x the tokens/s at one stream and 1.09x at
    # 16 (medians of five A-B pairs of servers, 2 CPU cores; docs/architecture.md).
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    name = args.served_model_name or path
    runtime_lora = args.enable_lora and runtime_lora_updating()
    if runtime_lora:
        _say(f"{_RUNTIME_LORA} is set: POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and unload adapters")
    app = build_app(
        model, served_model_name=name, engine=engine, api_key=args.api_key,
        log_stats=None if args.disable_log_stats else _say,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        enable_lora=args.enable_lora, runtime_lora_updating=runtime_lora,
        lora_parents={m.name: m.base_model_name for m in args.lora_modules or [] if m.base_model_name},
        media=media_policy(args),
    )  # fmt: skip
    host = f"[{args.host}]" if ":" in args.host else args.host
    _say(f"{name} on http://{host}:{sock.getsockname()[1]}")
    # uvicorn shuts down gracefully on SIGTERM (no new connections, the answers in flight finished, the engine
    # stopped), then raises the signal again under the handler it found: this one makes that an exit with 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # At log level info uvicorn writes an access line per request, as vLLM's server does.
    config = uvicorn.Config(
        app, log_level=args.uvicorn_log_level, access_log=not args.disable_log_requests, timeout_graceful_shutdown=None
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C, after the same graceful shutdown (as uvicorn.run)
        pass
    return 0 if server.started else 3  # 3: uvicorn's status when the application failed to start
