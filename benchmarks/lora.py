"""LoRA adapters served beside the base: what they cost `Model.generate` and `hfjax serve` against the
base alone, measured in the same run.

    python benchmarks/lora.py                     # 20m Llama, 4 adapters of rank 16; about 10 min on 2 cores
    python benchmarks/lora.py --size tiny --rounds 1 --requests-per-client 1   # a quick check

The checkpoint is serve.py's (a Llama of shapes.py, float32, random weights, a word-level tokenizer);
the adapters are peft's (`hfjax.testing.save_tiny_adapter`), rank 16, alpha 32, on the seven linear
layers of each block (q, k, v, o, gate, up, down), as a chat fine-tune targets them.

1. `Model.generate`, in this process (--prompt-tokens, --new-tokens, greedy, no EOS): the base model with
   no adapter against the same checkpoint with 4 adapters loaded, run on an adapter (batch 1) and with
   the batch spread over the 4 (batch 8); also the adapters' model on the base alone (adapter=None).
   Calls alternate, and the ratio is the median over rounds of the ratio within a round.
2. Two servers at once, each with its default flags: the base (`hfjax serve CKPT`) and the adapters'
   (`--enable-lora --max-loras 5 --max-lora-rank 16 --lora-modules a0=... a3=...`). Per round, each
   in turn: 16 clients (streamed /v1/completions, `--requests-per-client` each), on the base server
   with the base's name, on the adapters' server with the 4 adapters' names in turn; and 1 client on
   each (the base; adapter a0). Output tokens/s over the level's wall time; medians of ratios.
3. Loading an adapter while serving (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): 16 clients on the adapters'
   server, and one second in, `POST /v1/load_lora_adapter` of a fifth adapter: its time, and the p99
   time to first token and inter-token latency of the requests meanwhile against the same level
   without a load in the same round. The adapter is unloaded after each round.

The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import serve  # noqa: E402

TARGETS = dict(serve_16_clients=0.8, serve_1_client=0.9, generate_batch_1=0.9)
LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = 4


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_adapters(checkpoint: pathlib.Path, root: pathlib.Path, count: int) -> list[pathlib.Path]:
    from hfjax import testing

    return [
        testing.save_tiny_adapter(
            checkpoint, root / f"a{i}", r=16, lora_alpha=32, target_modules=LAYERS, seed=i, scale=0.02
        )
        for i in range(count)
    ]


def generate_rows(checkpoint, adapters, args) -> dict:
    """Part 1: Model.generate with and without adapters, alternated."""
    import hfjax

    base = hfjax.load(checkpoint)
    tuned = hfjax.load(checkpoint)
    for i, path in enumerate(adapters):
        tuned.load_adapter(path, adapter_name=f"a{i}")
    prompt = serve.prompt_text(0, args.prompt_tokens)
    cases = {  # name: (model, batch, adapter=)
        "base_batch_1": (base, 1, None),
        "adapter_batch_1": (tuned, 1, "a0"),
        "adapters_model_on_base_batch_1": (tuned, 1, None),
        "base_batch_8": (base, 8, None),
        "4_adapters_batch_8": (tuned, 8, [f"a{i % ADAPTERS}" for i in range(8)]),
    }

    def run(model, batch, adapter) -> float:
        ids = np.asarray(model.tokenizer([prompt] * batch, return_tensors="np")["input_ids"], np.int32)
        kwargs = {} if adapter is None else {"adapter": adapter}
        start = time.perf_counter()
        out = np.asarray(
            model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=[], **kwargs)
        )
        seconds = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + args.new_tokens
        return batch * args.new_tokens / seconds

    for case in cases.values():
        run(*case)  # compiles
    rates = {name: [] for name in cases}
    for round_ in range(args.generate_rounds):
        order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        for name in order:
            rates[name].append(run(*cases[name]))
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(rates[a], rates[b]))  # noqa: E731
    return {
        "tokens_per_s": {name: statistics.median(values) for name, values in rates.items()},
        "adapter_over_base_batch_1": ratio("adapter_batch_1", "base_batch_1"),
        "adapters_model_on_base_over_base_batch_1": ratio("adapters_model_on_base_batch_1", "base_batch_1"),
        "4_adapters_over_base_batch_8": ratio("4_adapters_batch_8", "base_batch_8"),
        "rounds": args.generate_rounds,
    }


async def level(url: str, models: list[str], args, clients: int, requests: int, offset: int = 0) -> dict:
    """`requests` streamed completions from `clients` clients at once, request i naming models[i % len]."""
    results, wall = await serve.async_level(
        url, models, args.prompt_tokens, args.new_tokens, clients, requests, 0, offset
    )
    ttft = [r["ttft"] for r in results if not np.isnan(r["ttft"])]
    itl = [r["itl"] for r in results if not np.isnan(r["itl"])]
    return {
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
        "itl_p99_s": float(np.percentile(itl, 99)) if itl else None,
    }


async def load_while_serving(url: str, models: list[str], args, path: pathlib.Path, offset: int) -> dict:
    """Part 3's level: the 16-client load, with a fifth adapter loaded one second in."""
    import httpx

    async def load() -> float:
        await asyncio.sleep(1.0)
        async with httpx.AsyncClient(timeout=600) as http:
            start = time.perf_counter()
            answer = await http.post(url + "/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(path)})
            seconds = time.perf_counter() - start
        answer.raise_for_status()
        return seconds

    served, seconds = await asyncio.gather(level(url, models, args, 16, 16 * args.requests_per_client, offset), load())
    async with httpx.AsyncClient(timeout=600) as http:
        (await http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "extra"})).raise_for_status()
    return {**served, "load_seconds": seconds}


async def serve_rows(checkpoint, adapters, extra, args, work: pathlib.Path) -> dict:
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    modules = [f"a{i}={path}" for i, path in enumerate(adapters)]
    flags = {
        "base": (),
        "lora": (
            "--enable-lora",
            "--max-loras",
            str(ADAPTERS + 1),
            "--max-lora-rank",
            "16",
            "--lora-modules",
            *modules,
        ),
    }
    servers, urls = {}, {}
    try:
        for kind, extra_flags in flags.items():  # one at a time: each compiles on both cores
            port = serve.free_port()
            servers[kind] = serve.start_server("hfjax", checkpoint, port, logs, flags=extra_flags)
            urls[kind] = f"http://127.0.0.1:{port}"
            await serve.wait_up(urls[kind], servers[kind])
            log(f"{kind} server up")
        names = {"base": ["bench"], "lora": [f"a{i}" for i in range(ADAPTERS)], "lora_on_base": ["bench"]}
        url_of = {"base": urls["base"], "lora": urls["lora"], "lora_on_base": urls["lora"]}
        for kind in names:  # untimed: every program and path warmed
            await level(url_of[kind], names[kind], args, 16, 16)
        rows = {key: [] for key in ("base_16", "lora_16", "lora_on_base_16", "base_1", "lora_1", "loading_16")}
        requests = 16 * args.requests_per_client
        for round_ in range(args.rounds):
            offset = 1000 * (round_ + 1)
            order = ["base", "lora", "lora_on_base"] if round_ % 2 == 0 else ["lora_on_base", "lora", "base"]
            for kind in order:
                rows[f"{kind}_16"].append(await level(url_of[kind], names[kind], args, 16, requests, offset))
            for kind in order[:2] if round_ % 2 == 0 else order[1:][::-1]:
                model = names[kind][:1]
                rows[f"{kind}_1"].append(await level(url_of[kind], model, args, 1, args.single_requests, offset))
            rows["loading_16"].append(await load_while_serving(urls["lora"], names["lora"], args, extra, offset))
            log(
                f"round {round_ + 1}: "
                + json.dumps({k: round(v[-1]["output_tokens_per_s"], 1) for k, v in rows.items()})
            )
    finally:
        for process in servers.values():
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

    def ratio(a: str, b: str, field: str = "output_tokens_per_s") -> float | None:
        # (a tiny model's answers may stream no word, or all at once: no latency to compare)
        pairs = [x[field] / y[field] for x, y in zip(rows[a], rows[b]) if x[field] is not None and y[field]]
        return statistics.median(pairs) if pairs else None

    return {
        "levels": {
            key: {f: statistics.median(r[f] for r in values) for f in values[0]} for key, values in rows.items()
        },
        "lora_over_base_16_clients": ratio("lora_16", "base_16"),
        "lora_server_on_base_over_base_16_clients": ratio("lora_on_base_16", "base_16"),
        "lora_over_base_1_client": ratio("lora_1", "base_1"),
        "load_seconds": statistics.median(r["load_seconds"] for r in rows["loading_16"]),
        "loading_ttft_p99_over_without": ratio("loading_16", "lora_16", "ttft_p99_s"),
        "loading_itl_p99_over_without": ratio("loading_16", "lora_16", "itl_p99_s"),
        "rounds": args.rounds,
    }


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=serve.SIZES, default="20m")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--single-requests", type=int, default=8, help="requests of the 1-client levels")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the server levels")
    parser.add_argument("--generate-rounds", type=int, default=7, help="rounds of the Model.generate calls")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-bench-lora-"))
    serve.CACHE_DIR = work / "compilation-cache"
    checkpoint = serve.write_checkpoint(args.size, work / args.size)
    adapters = write_adapters(checkpoint, work / "adapters", ADAPTERS + 1)
    report = {
        "size": args.size, "dtype": "float32", "adapters": ADAPTERS, "rank": 16, "layers": LAYERS,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "targets": TARGETS,
    }  # fmt: skip
    if not args.skip_generate:
        log("Model.generate with and without adapters ...")
        report["generate"] = generate_rows(checkpoint, adapters[:ADAPTERS], args)
        log(json.dumps(report["generate"]))
    if not args.skip_serve:
        report["serve"] = asyncio.run(serve_rows(checkpoint, adapters[:ADAPTERS], adapters[ADAPTERS], args, work))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
