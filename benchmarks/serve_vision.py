"""`hfjax serve` against `transformers serve` on a vision-language model: chat requests with an image.

One LLaVA checkpoint (`shapes.LLAVA_20M`: the 20m Llama as its language model, with as many tokens
as testing's tiny tokenizer, 528 + the image token, so every chosen token is text the client sees;
testing's tiny CLIP tower over 32x32 images, 16 image tokens), float32, random weights, saved with
its processor. Each
server starts with its default flags (transformers serve with `--continuous-batching`, its
strongest mode; for a vision-language model it falls back to one request at a time, which its log
says and the JSON records; hfjax from an empty compilation cache, as at a user's first start), then answers the official `openai` client: streamed chat completions
whose user message holds an `image_url` part (a `data:` URL of a PNG, a different image per
request) and a question, `max_tokens` new tokens at temperature 0. Rows, per server:

- "1 client": requests one after another; median tokens/s of a request (its usage's completion
  tokens over its wall time) and median time to first token.
- "N clients" (--clients): --requests requests from N threads at once, after one untimed pass of
  the same load; output tokens/s over the row's wall time, TTFT p50/p99.

hfjax's `hfjax_compilations_total` is read after /health and after the rows: programs it compiled
for the images' traffic after it said it was ready. The last stdout line is JSON.

    python benchmarks/serve_vision.py                      # 1 and 16 clients, both servers
    python benchmarks/serve_vision.py --servers hfjax      # hfjax alone
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import serve  # noqa: E402
from serve import compilations, free_port, in_threads, log, start_server, wait_up  # noqa: E402
from shapes import LLAVA_20M  # noqa: E402

QUESTION = "What is in this picture? Describe it"


def image_url(index: int) -> str:
    """Request `index`'s image, a seeded 48x40 RGB PNG, as a data: URL."""
    import PIL.Image

    pixels = np.random.default_rng(index).integers(0, 255, (40, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def one_request(client, model: str, index: int, new_tokens: int) -> dict:
    """One streamed chat completion with image `index`: its tokens (the usage's), wall time and TTFT."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url(index)}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    start, first, tokens = time.perf_counter(), None, None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and any(choice.delta.content for choice in chunk.choices):
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    seconds = time.perf_counter() - start
    if tokens is None:
        raise RuntimeError("the server sent no usage")
    return {"tokens": tokens, "seconds": seconds, "ttft": (first or float("nan")) - start}


def clients_row(url: str, model: str, clients: int, requests: int, new_tokens: int, offset: int) -> dict:
    """`requests` requests from `clients` threads at once (each its own openai client)."""
    from openai import OpenAI

    indices = iter(range(offset, offset + requests))
    lock, results = threading.Lock(), []

    def client():
        openai = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        while True:
            with lock:
                index = next(indices, None)
            if index is None:
                return
            result = one_request(openai, model, index, new_tokens)
            with lock:
                results.append(result)

    wall = in_threads(client, clients)
    ttfts = sorted(r["ttft"] for r in results if not np.isnan(r["ttft"]))
    return {
        "clients": clients,
        "requests": len(results),
        "requests_without_text": len(results) - len(ttfts),  # (no TTFT: every chunk's content empty)
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "completion_tokens": sum(r["tokens"] for r in results),
    }


def bench(kind: str, checkpoint: pathlib.Path, args, logs: pathlib.Path) -> dict:
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    process = start_server(kind, checkpoint, port, logs)
    try:
        asyncio.run(wait_up(url, process))
        listening = time.perf_counter() - started
        log(f"{kind}: /health after {listening:.1f} s")
        model = "bench" if kind == "hfjax" else str(checkpoint)
        ready_compilations = asyncio.run(compilations(url)) if kind == "hfjax" else None
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for index in range(2):  # warm-up: the first image request of each server
            one_request(client, model, 10_000 + index, args.new_tokens)
        single = [one_request(client, model, index, args.new_tokens) for index in range(args.single_requests)]
        report = {
            "listening_after_s": listening,
            "1_client": {
                "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in single),
                "ttft_p50_s": statistics.median(r["ttft"] for r in single),
                "completion_tokens": [r["tokens"] for r in single],
            },
        }
        clients_row(url, model, args.clients, args.requests, args.new_tokens, offset=1_000)  # untimed pass
        report[f"{args.clients}_clients"] = clients_row(
            url, model, args.clients, args.requests, args.new_tokens, offset=2_000
        )
        if kind == "hfjax":
            after = asyncio.run(compilations(url))
            report["compilations_after_health"] = (
                None if after is None or ready_compilations is None else after - ready_compilations
            )
        else:  # its log says where it fell back from continuous batching (at the first request)
            text = (logs / f"{kind}.log").read_text(errors="replace")
            report["mode"] = "one request at a time" if "Falling back to sequential" in text else "continuous batching"
        log(f"{kind}: {json.dumps(report)}")
        return report
    finally:
        process.terminate()
        process.wait(timeout=60)


def write_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """LLAVA_20M with as many tokens as its tokenizer has (testing's tiny BPE and LLaVA's image token),
    so that every token the random weights choose decodes to text the client sees."""
    import transformers

    from hfjax import testing

    testing.save_tiny_checkpoint("llava", path, task="image-text-to-text", dtype="float32", **LLAVA_20M)
    vocab = len(transformers.AutoTokenizer.from_pretrained(path))
    text = {**LLAVA_20M["text_config"], "vocab_size": vocab}
    return testing.save_tiny_checkpoint("llava", path, task="image-text-to-text", dtype="float32", text_config=text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=["hfjax", "transformers"], choices=["hfjax", "transformers"])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="requests of the N-clients row")
    parser.add_argument("--single-requests", type=int, default=8, help="requests of the 1-client row")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work:
        work = pathlib.Path(work)
        checkpoint = write_checkpoint(work / "llava")
        logs = work / "logs"
        logs.mkdir()
        serve.CACHE_DIR = work / "compilation-cache"  # hfjax's first start, as a new user's
        results = {name: bench(name, checkpoint, args, logs) for name in args.servers}
    summary = {"checkpoint": "LLAVA_20M", "new_tokens": args.new_tokens, "servers": results}
    if {"hfjax", "transformers"} <= results.keys():
        hfjax, peer = results["hfjax"], results["transformers"]
        row = f"{args.clients}_clients"
        summary["ratios"] = {
            "1_client_tokens_per_s": hfjax["1_client"]["tokens_per_s"] / peer["1_client"]["tokens_per_s"],
            f"{row}_tokens_per_s": hfjax[row]["output_tokens_per_s"] / peer[row]["output_tokens_per_s"],
            f"{row}_ttft_p99": hfjax[row]["ttft_p99_s"] / peer[row]["ttft_p99_s"],
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
