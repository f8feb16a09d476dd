"""Structured outputs in `hfjax serve`: what a JSON schema costs the requests that carry it and the
requests beside them, measured through the official `openai` client.

    python benchmarks/structured.py            # 20m Llama, 32k byte-level BPE; about 10 min on 2 cores
    python benchmarks/structured.py --size tiny --rounds 1 --requests-per-client 1   # a quick check

One server with its default flags, on a Llama of benchmarks/shapes.py (random weights, float32) with
the byte-level BPE tokenizer of 32000 tokens that grammars.py trains, and a chat template. Requests
are streamed chat completions of `--new-tokens` tokens at temperature 0 (an answer held to the
schema may end sooner, when the grammar completes: tokens/s counts the tokens each answer has).
Each round runs, in turn:

- unconstrained and schema-constrained (RECORD, 5 bounded properties, `response_format`
  json_schema) requests at 1 and at 16 clients: output tokens/s over the level's wall time;
- a mixed level of 16 clients, 8 constrained and 8 not: each unconstrained request's own tokens/s
  (its tokens over its time) against the same figure in the all-unconstrained level of 16;
- the first request with a schema no cache has seen (grammars.SCHEMA, 20 properties, a new description each time),
  max_tokens 1, against an unconstrained request of max_tokens 1, taken in turns: the difference is
  what the schema's compilation adds to the time to first token.

Ratios are taken within a round (the machine's speed drifts) and reported as medians over rounds.
The host's share of a constrained token is timed here, in this process, with llguidance itself on
the constrained answers' tokens (fill the next token's bitmask, then consume the token); the rest of
the difference in inter-token latency at 1 client is the device's and the engine's (a constrained
row makes every chunk one step long). Every constrained answer that ended with "stop" is checked
with `jsonschema`; one that ended at max_tokens is counted apart. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import jsonschema
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grammars import SCHEMA, VOCAB, build_tokenizer  # noqa: E402
from serve import SIZES, free_port, log, start_server, wait_up  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# What an extraction pipeline asks for: a record of a few bounded fields (a random model's answer
# under SCHEMA, 20 properties with strings up to 80 characters, takes hundreds of tokens).
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "late"]}, "maxItems": 3},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "status", "tags", "verified"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}


def write_checkpoint(size: str, path: pathlib.Path) -> pathlib.Path:
    from hfjax import testing

    testing.save_tiny_checkpoint(
        "llama", path, dtype="float32", max_position_embeddings=2048, **{**SIZES[size], "vocab_size": VOCAB}
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (path / name).unlink(missing_ok=True)
    tokenizer = build_tokenizer(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def one_request(client, index: int, new_tokens: int, response_format=None) -> dict:
    """A streamed chat request: its tokens, time to first token, inter-token latency, text and finish."""
    messages = [{"role": "user", "content": f"Describe customer number {index} as a record."}]
    extra = {} if response_format is None else {"response_format": response_format}
    start, times, text, finish, tokens = time.perf_counter(), [], [], None, 0
    stream = client.chat.completions.create(
        model="bench", messages=messages, max_tokens=new_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, **extra,
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                times.append(time.perf_counter())
                text.append(choice.delta.content)
            finish = choice.finish_reason or finish
    end = time.perf_counter()
    return {
        "tokens": tokens,
        "seconds": end - start,
        "ttft": times[0] - start if times else float("nan"),
        "itl": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan"),
        "text": "".join(text),
        "finish": finish,
    }


def level(url: str, clients: list[dict | None], requests_each: int, new_tokens: int) -> tuple[list[list[dict]], float]:
    """One thread per entry of `clients` (its response_format, or None), each sending `requests_each`
    requests in turn: (each thread's results, the level's wall seconds)."""
    from openai import OpenAI

    results = [[] for _ in clients]

    def run(k: int, response_format) -> None:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for i in range(requests_each):
            results[k].append(one_request(client, 1000 * k + i, new_tokens, response_format))

    threads = [threading.Thread(target=run, args=(k, f)) for k, f in enumerate(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


def tokens_per_s(results: list[dict], wall: float) -> float:
    return sum(r["tokens"] for r in results) / wall


def valid(result: dict) -> bool | None:
    """Whether a constrained answer validates (None: it ended at max_tokens, before the grammar did)."""
    if result["finish"] != "stop":
        return None
    try:
        jsonschema.validate(json.loads(result["text"]), RECORD)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def first_schema(url: str, rounds: int) -> list[float]:
    """Seconds a schema no cache has seen adds to a max_tokens=1 request, per pair (order swapped each pair)."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    added = []
    for n in range(rounds):
        schema = {**SCHEMA, "description": f"variant {time.time_ns()} {n}"}
        fresh = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
        pair = [("plain", None), ("schema", fresh)]
        seconds = {}
        for name, response_format in pair if n % 2 == 0 else pair[::-1]:
            seconds[name] = one_request(client, n, 1, response_format)["seconds"]
        added.append(seconds["schema"] - seconds["plain"])
    return added


def host_cost(checkpoint: pathlib.Path, answers: list[str]) -> dict:
    """The engine's host work per constrained token, with its own parts (`generation.Grammars`, a
    row's `Matcher`) on the constrained answers' tokens: fill the row's bitmask, consume the token."""
    import transformers

    from hfjax import generation

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    grammars = generation.Grammars(tokenizer, vocab_size=VOCAB, eos_token_ids=[tokenizer.eos_token_id])
    constraint = generation.Constraint.json_schema(RECORD)
    row = np.zeros(grammars.words, np.int32)
    fill, consume = [], []
    for answer in answers:
        matcher = grammars.matcher(constraint)
        for token in tokenizer.encode(answer, add_special_tokens=False):
            start = time.perf_counter()
            matcher.fill(row)
            middle = time.perf_counter()
            if not matcher.consume(token):
                break  # the text tokenized again left the grammar's path: time what came before
            fill.append(middle - start)
            consume.append(time.perf_counter() - middle)
    return {
        "tokens_timed": len(fill),
        "fill_bitmask_us": round(statistics.median(fill) * 1e6, 1) if fill else None,
        "consume_us": round(statistics.median(consume) * 1e6, 1) if consume else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="20m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-schema-pairs", type=int, default=6)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        log(f"writing a {args.size} Llama with a {VOCAB}-token byte-level BPE ...")
        checkpoint = write_checkpoint(args.size, scratch / "model")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process = start_server("hfjax", checkpoint, port, scratch)
        try:
            started = time.monotonic()
            wait_up_sync(url, process)
            listening = time.monotonic() - started
            log(f"listening after {listening:.1f} s; warming up ...")
            level(url, [None, FORMAT], 1, args.new_tokens)
            rounds, checked, answers = [], [], []
            each = args.requests_per_client
            for r in range(args.rounds):
                row = {}
                for clients in (1, 16):
                    plain, wall = level(url, [None] * clients, each, args.new_tokens)
                    held, held_wall = level(url, [FORMAT] * clients, each, args.new_tokens)
                    plain, held = sum(plain, []), sum(held, [])
                    row[f"plain_{clients}_tok_s"] = tokens_per_s(plain, wall)
                    row[f"schema_{clients}_tok_s"] = tokens_per_s(held, held_wall)
                    row[f"schema_over_plain_{clients}"] = row[f"schema_{clients}_tok_s"] / row[f"plain_{clients}_tok_s"]
                    row[f"plain_{clients}_itl_s"] = float(np.nanmedian([x["itl"] for x in plain]))
                    row[f"schema_{clients}_itl_s"] = float(np.nanmedian([x["itl"] for x in held]))
                    if clients == 16:
                        alone = statistics.median(x["tokens"] / x["seconds"] for x in plain)
                    checked += [valid(x) for x in held]
                    answers += [x["text"] for x in held]
                mixed, _ = level(url, [None] * 8 + [FORMAT] * 8, each, args.new_tokens)
                beside = statistics.median(x["tokens"] / x["seconds"] for x in sum(mixed[:8], []))
                row["plain_beside_schema_over_plain_alone_16"] = beside / alone
                checked += [valid(x) for x in sum(mixed[8:], [])]
                log(f"round {r + 1}: {json.dumps({k: round(v, 4) for k, v in row.items()})}")
                rounds.append(row)
            log("first requests with new schemas ...")
            added = first_schema(url, args.first_schema_pairs)
        finally:
            process.terminate()
            process.wait(timeout=60)
        host = host_cost(checkpoint, answers[:20])

    medians = {key: round(statistics.median(row[key] for row in rounds), 4) for key in rounds[0]}
    itl_added = medians["schema_1_itl_s"] - medians["plain_1_itl_s"]
    host_s = ((host["fill_bitmask_us"] or 0) + (host["consume_us"] or 0)) / 1e6
    report = {
        "size": args.size,
        "vocab": VOCAB,
        "new_tokens": args.new_tokens,
        "rounds": rounds,
        "medians": medians,
        "first_new_schema_added_s": {"median": round(statistics.median(added), 4), "max": round(max(added), 4)},
        "per_token_added_at_1_client_s": {
            "all": round(itl_added, 6),
            "host_llguidance": round(host_s, 6),
            "device_and_engine": round(itl_added - host_s, 6),
        },
        "host": host,
        "constrained_answers": {
            "valid": checked.count(True),
            "invalid": checked.count(False),
            "ended_at_max_tokens": checked.count(None),
        },
    }
    print(json.dumps(report))


def wait_up_sync(url: str, process) -> None:
    import asyncio

    asyncio.run(wait_up(url, process))


if __name__ == "__main__":
    main()
