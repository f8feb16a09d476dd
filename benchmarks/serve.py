"""`hfjax serve` against `transformers serve --continuous-batching --device cpu` on one checkpoint.

Three servers, one at a time: hfjax with its default flags (as a user starts it), hfjax with tuned
flags (`--max-batch 16 --max-model-len 256 --prefill-chunk 32 --prefill-rows 8`, a second row), and
transformers serve. Each answers two clients: an async generator (httpx, streamed /v1/completions in
one process) and the official `openai` client (streamed chat.completions, one thread per concurrent
client), fixed prompt and output lengths. The checkpoint is a Llama shape of shapes.py in float32
with random weights, a 2048-token context in its config, and a word-level tokenizer of the model's
whole vocabulary (every token decodes to a word, so the client sees every streamed token).

Two rows per server and client first, as a user meets the server: "ready" (the server started, /health
waited for, 4 warm-up requests one at a time, then --ready-clients clients send --ready-requests
requests at once; the first client listed meets the server first) and "steady" (the same load again).
Then each concurrency level, after one untimed pass of it. `Model.generate` at batch 1, same
lengths, is the concurrency-1 reference: after hfjax's default levels, one hfjax request and one
`Model.generate` call in this process take turns (order swapped every pair), and the ratio is the
median over pairs (this machine's speed drifts within seconds).

    python benchmarks/serve.py --quick          # 20m, ready and steady, concurrency 1 and 16
    python benchmarks/serve.py                  # 20m, ready and steady, concurrency 1, 4, 16
    python benchmarks/serve.py --concurrency    # ready and steady only
    python benchmarks/serve.py --concurrency --servers hfjax hfjax-warm transformers   # a first and a second start
    python benchmarks/serve.py --concurrency --context 8192 --mixed-prompts 32 4000 --servers hfjax transformers
    python benchmarks/serve.py --quick --servers hfjax hfjax-speculative --repeat-prompts \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'

hfjax-speculative is hfjax's default server with `--speculative-config`; "over_hfjax" gives its tokens/s
over the plain server's per client and level. `--repeat-prompts` makes each prompt a short phrase of its
own said again and again (an answer that repeats its prompt is what prompt lookup drafts from).

hfjax servers start from a compilation cache of their own, empty at the run's first start (`--cache
user`: the user's cache); hfjax-warm is the same server started again, reading its programs back.

Reported per server and level: output tokens/s and requests/s over the level's wall time, time to
first token p50/p99, and inter-token latency p50/p99 (per request: (last token - first token) /
(tokens - 1), so a server that sends tokens in bunches is not flattered). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from shapes import LLAMA_20M, LLAMA_150M, LLAMA_TINY  # noqa: E402

SIZES = {"tiny": LLAMA_TINY, "20m": LLAMA_20M, "150m": LLAMA_150M}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_checkpoint(size: str, path: pathlib.Path, context: int = 2048) -> pathlib.Path:
    import tokenizers
    import transformers

    from hfjax import testing

    testing.save_tiny_checkpoint("llama", path, dtype="float32", max_position_embeddings=context, **SIZES[size])
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, SIZES[size]["vocab_size"])}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (path / name).unlink(missing_ok=True)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# hfjax serve's flags per configuration: the defaults, and the tuned second row.
HFJAX_CONFIGS = {
    "hfjax": (),
    "hfjax-warm": (),  # the same server started again: its programs read from the compilation cache
    "hfjax-tuned": ("--max-batch", "16", "--max-model-len", "256", "--prefill-chunk", "32", "--prefill-rows", "8"),
    "hfjax-speculative": (),  # with --speculative-config (main)
}
REPEAT = [False]  # --repeat-prompts
# The sampling settings every request sends (greedy unless a caller such as ab_serve.py's --top-p
# sets others; top_k and min_p go as vLLM's extra parameters, which the openai client sends in its body).
SAMPLING = {"temperature": 0}


CACHE_DIR: pathlib.Path | None = None  # the hfjax servers' HFJAX_CACHE_DIR (`--cache empty`), else theirs


def start_server(
    kind: str, checkpoint: pathlib.Path, port: int, logs: pathlib.Path, flags=(), torch_device: str = "cpu"
) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    if kind in HFJAX_CONFIGS and CACHE_DIR is not None:
        env["HFJAX_CACHE_DIR"] = str(CACHE_DIR)
    if kind in HFJAX_CONFIGS:
        argv = [
            sys.executable, "-m", "hfjax.cli", "serve", "--model", str(checkpoint), "--port", str(port),
            "--max-queue", "1024", "--served-model-name", "bench", *HFJAX_CONFIGS[kind], *flags,
        ]  # fmt: skip
    else:
        transformers_cli = shutil.which("transformers") or str(pathlib.Path(sys.executable).parent / "transformers")
        argv = [
            transformers_cli, "serve", "--continuous-batching", "--device", torch_device, "--dtype", "float32",
            "--port", str(port), "--host", "127.0.0.1", "--log-level", "warning", str(checkpoint),
        ]  # fmt: skip
    log(f"starting {kind}: {' '.join(argv)}")
    return subprocess.Popen(argv, stdout=open(logs / f"{kind}.log", "a"), stderr=subprocess.STDOUT, env=env)


async def counter(url: str, name: str) -> float | None:
    """A counter of hfjax serve's /metrics (None for a server without it)."""
    import httpx

    async with httpx.AsyncClient() as http:
        text = (await http.get(url + "/metrics", timeout=5)).text
    count = [line for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(count[0].split()[1]) if count else None


async def compilations(url: str) -> float | None:
    """hfjax serve's count of XLA programs made so far (None for a server without it)."""
    return await counter(url, "hfjax_compilations_total")


async def wait_up(url: str, process: subprocess.Popen, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}")
            try:
                if (await http.get(url + "/health", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


async def one_request(http, url: str, model: str, prompt: str, new_tokens: int, *, every_token: bool = False) -> dict:
    """One streamed completion: its tokens as the client sees them (words: each token of the word-level
    vocabulary is one), TTFT and ITL. `every_token` (hfjax alone, set against `Model.generate` with no
    end of sequence): `ignore_eos`, and the tokens the stream's usage counts, as a random model's may
    be special tokens that the text leaves out."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, **SAMPLING, "stream": True}
    if every_token:
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    times, counted = [], None
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if every_token and chunk.get("usage"):
                counted = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or ""
                times.extend([time.perf_counter()] * len(text.split()))
    tokens = len(times) if counted is None else counted
    return {
        "tokens": tokens,
        "ttft": times[0] - start if times else float("nan"),
        "itl": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan"),
    }


def prompt_text(index: int, tokens: int | range, prefix: int = 0) -> str:
    """Request `index`'s prompt: `prefix` words every request shares, then words of its own; `tokens`
    words in all, or where it is a range, a length of it drawn from the index (mixed lengths)."""
    if isinstance(tokens, range):
        tokens = tokens[(7919 * index) % len(tokens)]
    shared = [f"w{3 + (11 * i) % 997}" for i in range(prefix)]
    own = [f"w{3 + (7 * (i % 8 if REPEAT[0] else i) + 131 * index) % 30000}" for i in range(tokens - prefix)]
    return " ".join(shared + own)


async def run_level(
    url: str,
    model: str,
    prompt_tokens: int,
    new_tokens: int,
    concurrency: int,
    requests: int,
    prefix: int = 0,
    client: str = "async",
) -> dict:
    """`requests` streamed requests from `concurrency` clients at once: the async generator, or the
    official openai client in as many threads."""
    if client == "openai":
        results, wall = await asyncio.to_thread(
            openai_level, url, model, prompt_tokens, new_tokens, concurrency, requests, prefix
        )
    else:
        results, wall = await async_level(url, model, prompt_tokens, new_tokens, concurrency, requests, prefix)
    # A request that streams no word has no TTFT: random weights with a small vocabulary (the
    # accelerator dry run's tiny model) may pick the end of sequence, or special tokens, which
    # the answer's text leaves out, for every token.
    ttft = [r["ttft"] for r in results if not np.isnan(r["ttft"])]
    itl = [r["itl"] for r in results if not np.isnan(r["itl"])]
    return {
        "client": client,
        "concurrency": concurrency,
        "requests": requests,
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "requests_per_s": requests / wall,
        "mean_output_tokens": statistics.mean(r["tokens"] for r in results),
        "requests_without_tokens": requests - len(ttft),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
        "itl_p50_s": float(np.percentile(itl, 50)) if itl else None,
        "itl_p99_s": float(np.percentile(itl, 99)) if itl else None,
    }


async def async_level(
    url, model, prompt_tokens, new_tokens, concurrency, requests, prefix, offset: int = 0
) -> tuple[list, float]:
    """`requests` streamed completions from `concurrency` clients: request i has prompt `offset + i` and
    names `model`, or where it is a list, model[i % len(model)]."""
    import httpx

    queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results = []

    async def client(http):
        while not queue.empty():
            index = queue.get_nowait()
            prompt = prompt_text(offset + index, prompt_tokens, prefix)
            named = model[index % len(model)] if isinstance(model, list) else model
            results.append(await one_request(http, url, named, prompt, new_tokens))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return results, time.perf_counter() - start


def openai_level(url, model, prompt_tokens, new_tokens, concurrency, requests, prefix) -> tuple[list, float]:
    """The official openai client, as a user drives it: one client per thread, streamed chat completions."""
    import queue as queues

    from openai import OpenAI

    todo = queues.Queue()
    for i in range(requests):
        todo.put(i)
    results, lock = [], threading.Lock()

    standard = {k: v for k, v in SAMPLING.items() if k in ("temperature", "top_p")}  # OpenAI's own fields
    extra = {k: v for k, v in SAMPLING.items() if k not in standard} or None

    def client():
        openai = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        while True:
            try:
                index = todo.get_nowait()
            except queues.Empty:
                return
            messages = [{"role": "user", "content": prompt_text(index, prompt_tokens, prefix)}]
            start, times = time.perf_counter(), []
            stream = openai.chat.completions.create(
                model=model, messages=messages, max_tokens=new_tokens, stream=True, **standard, extra_body=extra
            )
            for chunk in stream:
                for choice in chunk.choices:
                    text = choice.delta.content or ""
                    times.extend([time.perf_counter()] * len(text.split()))
            tokens = len(times)
            with lock:
                results.append({
                    "tokens": tokens,
                    "ttft": times[0] - start if times else float("nan"),
                    "itl": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else float("nan"),
                })  # fmt: skip

    return results, in_threads(client, concurrency)


def in_threads(client, count: int) -> float:
    """Runs `client` in `count` threads at once; returns the seconds until the last one ended."""
    threads = [threading.Thread(target=client) for _ in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


async def bench_server(
    kind: str, checkpoint, args, logs: pathlib.Path, *, shared_prefix_only=False, flags=(), reference=None
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    process = start_server(kind, checkpoint, port, logs, flags, torch_device=args.transformers_device)
    try:
        await wait_up(url, process)
        report = {"listening_after_s": time.monotonic() - started}
        model = "bench" if kind in HFJAX_CONFIGS else str(checkpoint)
        compiled_at_health = await compilations(url) if kind in HFJAX_CONFIGS else None
        if not shared_prefix_only:
            await run_level(url, model, args.prompt_tokens, args.new_tokens, 1, 4)  # 4 warm-up requests
            for row in ("ready", "steady"):
                report[row] = []
                for client in args.clients:
                    log(
                        f"  {kind}: {row}, {client} client, {args.ready_clients} clients, {args.ready_requests} requests ..."
                    )
                    level = await run_level(
                        url, model, args.prompt_tokens, args.new_tokens, args.ready_clients, args.ready_requests,
                        client=client,
                    )  # fmt: skip
                    log(f"    {json.dumps(level)}")
                    report[row].append(level)
            if compiled_at_health is not None:
                report["compilations_after_health"] = await compilations(url) - compiled_at_health
        else:
            await run_level(url, model, args.prompt_tokens, args.new_tokens, 1, 2)  # warm-up: the first requests
        levels = []
        for client in [] if shared_prefix_only else args.clients:
            for concurrency in args.concurrency:
                requests = max(args.requests_per_client * concurrency, args.min_requests)
                await run_level(url, model, args.prompt_tokens, args.new_tokens, concurrency, requests, client=client)
                log(f"  {kind}: {client} client, concurrency {concurrency}, {requests} requests ...")
                level = await run_level(
                    url, model, args.prompt_tokens, args.new_tokens, concurrency, requests, client=client
                )
                log(f"    {json.dumps(level)}")
                levels.append(level)
        if args.prefix_tokens and (kind == "hfjax" or shared_prefix_only or kind == "transformers"):
            # One client, prompts that share their first prefix_tokens words (a system prompt).
            log(f"  {kind} {' '.join(flags)}: shared prefix of {args.prefix_tokens} tokens ...")
            level = await run_level(
                url, model, args.prefix_tokens + args.prompt_tokens, args.new_tokens, 1, args.min_requests,
                prefix=args.prefix_tokens,
            )  # fmt: skip
            log(f"    {json.dumps(level)}")
            report["shared_prefix"] = {**level, "shared_prefix_tokens": args.prefix_tokens}
        if reference is not None:
            log(f"  {kind}: one request at a time, taking turns with Model.generate ({args.pairs} pairs) ...")
            await reference.alternate(url, model, args.prompt_tokens, args.pairs)
        if kind == "hfjax-speculative":  # vLLM's spec-decode counters, over the whole run
            names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
            drafts, drafted, accepted = [await counter(url, f"hfjax_spec_decode_{name}_total") for name in names]
            report["drafts"] = {
                "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            }  # fmt: skip
        return {**report, "levels": levels}
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


class GenerateReference:
    """Model.generate's output tokens/s at batch 1 (prefill included, as a request at concurrency 1
    sees it), in this process, loaded and compiled once, taking turns with single requests to a
    server (`alternate`): neither runs while the other does, and both see the same moments of this
    machine's drifting speed."""

    def __init__(self, checkpoint, prompt: str, new_tokens: int):
        import hfjax

        self.model = hfjax.load(checkpoint)
        self.ids = self.model.tokenizer([prompt], return_tensors="np")["input_ids"].astype("int32")
        self.new_tokens = new_tokens
        self.times: list[float] = []  # Model.generate's
        self.request_times: list[float] = []  # the server's, pair by pair
        self._generate()  # compiles

    def _generate(self) -> float:
        start = time.perf_counter()
        out = np.asarray(
            self.model.generate(self.ids, max_new_tokens=self.new_tokens, do_sample=False, eos_token_id=[])
        )
        assert out.shape[1] == self.ids.shape[1] + self.new_tokens
        return time.perf_counter() - start

    async def alternate(self, url: str, model: str, prompt_tokens: int, pairs: int) -> None:
        """`pairs` turns of one streamed request (a prompt of its own each time) and one
        Model.generate call, which goes first in every other pair."""
        import httpx

        async with httpx.AsyncClient(timeout=600) as http:
            for i in range(pairs):
                for turn in ("server", "generate") if i % 2 == 0 else ("generate", "server"):
                    if turn == "generate":
                        self.times.append(self._generate())
                        continue
                    start = time.perf_counter()
                    answer = await one_request(
                        http, url, model, prompt_text(i, prompt_tokens), self.new_tokens, every_token=True
                    )
                    self.request_times.append(time.perf_counter() - start)
                    if answer["tokens"] != self.new_tokens:
                        raise RuntimeError(f"the server sent {answer['tokens']} tokens, not {self.new_tokens}")

    def report(self) -> dict:
        if not self.times:  # hfjax was not run: time it alone
            self.times = [self._generate() for _ in range(3)]
        seconds = statistics.median(self.times)
        report = {"output_tokens_per_s": self.new_tokens / seconds, "seconds": seconds, "runs": len(self.times)}
        if self.request_times:
            request = statistics.median(self.request_times)
            report["hfjax_taking_turns"] = {
                "output_tokens_per_s": self.new_tokens / request,
                "seconds": request,
                "over_generate_median_of_pairs": statistics.median(
                    g / r for g, r in zip(self.times, self.request_times)
                ),
            }
        return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="20m")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--ready-clients", type=int, default=16, help="clients of the ready and steady rows")
    parser.add_argument("--ready-requests", type=int, default=64, help="requests of the ready and steady rows")
    parser.add_argument("--clients", nargs="+", default=["async", "openai"], choices=["async", "openai"])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument(
        "--mixed-prompts", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="prompts of mixed lengths, LOW to HIGH tokens, in place of --prompt-tokens (no shared-prefix level)",
    )  # fmt: skip
    parser.add_argument("--context", type=int, default=2048, help="the checkpoint's max_position_embeddings")
    parser.add_argument(
        "--cache", choices=["empty", "user"], default="empty",
        help="hfjax servers' compilation cache: a new, empty one for this run (the first start is a user's "
        "first; hfjax-warm is the second), or the user's (HFJAX_CACHE_DIR, ~/.cache/hfjax)",
    )  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument(
        "--prefix-tokens", type=int, default=128,
        help="also time one client whose prompts share this many first tokens, hfjax with and without prefix "
        "reuse (0: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--servers", nargs="+", default=["hfjax", "hfjax-tuned", "transformers"],
        choices=["hfjax", "hfjax-warm", "hfjax-tuned", "hfjax-speculative", "transformers"],
    )  # fmt: skip
    parser.add_argument(
        "--pairs", type=int, default=16,
        help="turns of one hfjax request and one Model.generate call for the concurrency-1 reference",
    )  # fmt: skip
    parser.add_argument(
        "--transformers-device", default="cpu", help="transformers serve's --device (default cpu; cuda on a GPU)"
    )
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 16 only")
    parser.add_argument(
        "--speculative-config", default=None,
        help="hfjax-speculative's --speculative-config (vLLM's JSON); adds that server where --servers does not name it",
    )  # fmt: skip
    parser.add_argument(
        "--repeat-prompts", action="store_true", help="each prompt: a phrase of 8 words of its own, repeated"
    )
    args = parser.parse_args()
    REPEAT[0] = args.repeat_prompts
    if args.speculative_config is not None:
        HFJAX_CONFIGS["hfjax-speculative"] = ("--speculative-config", args.speculative_config)
        if "hfjax-speculative" not in args.servers:
            args.servers.append("hfjax-speculative")
    elif "hfjax-speculative" in args.servers:
        parser.error("--servers hfjax-speculative needs --speculative-config JSON")
    if args.quick:
        args.concurrency = [1, 16]
    if args.mixed_prompts:
        args.prompt_tokens, args.prefix_tokens = range(args.mixed_prompts[0], args.mixed_prompts[1] + 1), 0
    work = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-bench-serve-"))
    global CACHE_DIR
    CACHE_DIR = work / "compilation-cache" if args.cache == "empty" else None
    try:
        checkpoint = write_checkpoint(args.size, work / args.size, args.context)
        report = {
            "size": args.size, "dtype": "float32", "context": args.context, "prompt_tokens": str(args.prompt_tokens),
            "compilation_cache": args.cache,
            "new_tokens": args.new_tokens, "hfjax_tuned_flags": " ".join(HFJAX_CONFIGS["hfjax-tuned"]), "servers": {},
        }  # fmt: skip
        reference = None  # (prompts of mixed lengths: no one prompt to pair Model.generate's with)
        if not args.mixed_prompts:
            log("Model.generate at batch 1 (the concurrency-1 reference) ...")
            reference = GenerateReference(checkpoint, prompt_text(0, args.prompt_tokens), args.new_tokens)
        import httpx

        for kind in args.servers:
            paired = reference if kind == "hfjax" else None
            try:
                report["servers"][kind] = asyncio.run(bench_server(kind, checkpoint, args, work, reference=paired))
            except (httpx.HTTPError, OSError, RuntimeError) as error:
                if kind != "transformers":
                    raise
                # The peer failed (its server closed a stream, or never came up): its row says so, and the
                # servers measured before and after it keep theirs; no ratio is made against it.
                log(f"  transformers failed: {type(error).__name__}: {error}")
                report["servers"][kind] = {"error": f"{type(error).__name__}: {error}"}
        if args.prefix_tokens and "hfjax" in args.servers:
            without = asyncio.run(
                bench_server("hfjax", checkpoint, args, work, shared_prefix_only=True, flags=("--no-prefix-reuse",))
            )
            with_reuse = report["servers"]["hfjax"]["shared_prefix"]
            report["hfjax_shared_prefix"] = {"reuse": with_reuse, "no_reuse": without["shared_prefix"]}
            report["hfjax_shared_prefix_ttft_p50_saved_s"] = (
                without["shared_prefix"]["ttft_p50_s"] - with_reuse["ttft_p50_s"]
            )
        if reference is not None:
            report["model_generate_batch_1"] = reference.report()

        def level(kind, client, concurrency):
            for entry in report["servers"].get(kind, {}).get("levels", []):
                if entry["client"] == client and entry["concurrency"] == concurrency:
                    return entry
            return None

        ratios = {}
        for kind in ("hfjax", "hfjax-warm", "hfjax-tuned", "hfjax-speculative"):
            for row in ("ready", "steady"):
                for ours, theirs in zip(
                    report["servers"].get(kind, {}).get(row, []), report["servers"].get("transformers", {}).get(row, [])
                ):
                    ratios[f"{kind} {row} {ours['client']} c{args.ready_clients}"] = {
                        "tokens_per_s": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                        "ttft_p99_s": [ours["ttft_p99_s"], theirs["ttft_p99_s"]],
                    }
            for client in args.clients:
                for concurrency in args.concurrency:
                    ours, theirs = level(kind, client, concurrency), level("transformers", client, concurrency)
                    if ours and theirs:
                        ratios[f"{kind} {client} c{concurrency}"] = {
                            "tokens_per_s": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                            "ttft_p99_s": [ours["ttft_p99_s"], theirs["ttft_p99_s"]],
                        }
        report["over_transformers"] = ratios
        if "hfjax-speculative" in report["servers"]:
            report["speculative_config"] = args.speculative_config
            report["hfjax_speculative_over_hfjax"] = {
                f"{client} c{concurrency}": level("hfjax-speculative", client, concurrency)["output_tokens_per_s"]
                / level("hfjax", client, concurrency)["output_tokens_per_s"]
                for client in args.clients
                for concurrency in args.concurrency
                if level("hfjax-speculative", client, concurrency) and level("hfjax", client, concurrency)
            }
        if "hfjax_taking_turns" in report.get("model_generate_batch_1", {}):
            report["hfjax_c1_over_generate"] = report["model_generate_batch_1"]["hfjax_taking_turns"][
                "over_generate_median_of_pairs"
            ]
        print(json.dumps(report))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
