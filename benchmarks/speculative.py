"""Speculative decoding benchmark: hfjax's prompt lookup and draft models against its plain decode and
transformers' assisted generation, on the same models and prompts.

    python benchmarks/decode.py --speculative           # 20M Llama, batch 1 and 8, 128 new tokens, 3 runs
    python benchmarks/decode.py --speculative --quick   # the tiny Llama, batch 1, 16 new tokens, 1 run (a smoke run)
    python benchmarks/speculative.py ...                 # the same

The models (random weights, float32, shapes.py):
  target     a Llama of --size whose layers after the first add nothing to the residual stream (their
             o_proj and down_proj weights are zeros): every layer runs, and its logits are exactly
             those of its first layer alone
  shallow    that first layer alone (num_hidden_layers=1, the target's weights): a draft that agrees with
             the target by construction (full acceptance) at one layer's cost
  copy       the target's own checkpoint as its draft: full acceptance at the target's cost
  unrelated  a one-layer Llama of other weights: its drafts are almost never accepted

The prompts: each row a phrase of 8 random tokens of its own said again and again (--prompt tokens in
all). The random model's greedy answer to it falls into repeats of its own, which prompt lookup drafts
from.

--trained (the realistic case): the target (all its layers) and a one-layer draft of its shape are
trained with hfjax's own `Trainer` (--train-steps steps, batch 8, AdamW) on a corpus of 48 code edits:
each record a small Python function, a "# renamed" line, and the same function with one name
changed. Each prompt is the last --prompt tokens of records up to one's "# renamed" line, so the
answer the trained model gives repeats its prompt (prompt lookup) and a draft trained on the same
corpus proposes it (the draft model); configurations plain, lookup_k{k} and trained_k{k}.

Configurations, each generating exactly --new-tokens tokens greedily (min_new_tokens = max_new_tokens):
plain (no speculation), lookup_k{k} (`prompt_lookup_num_tokens=k`, k of --lookup), and shallow_k{k},
copy_k{k}, unrelated_k{k} (`assistant_model=`, `num_assistant_tokens=k`, k = --draft-tokens). In each
run every configuration is timed once, in a rotating order (this machine's speed drifts); figures are
medians over --runs runs after a warm-up call. Reported per batch and configuration: tokens/s over the
whole call (new tokens x batch / seconds), its ratio to plain's in the same run, the acceptance rate
(accepted / drafted tokens), the tokens per forward of the target in the decode ((new tokens - 1) /
target forwards: the first token comes from the prefill), and whether the tokens are plain's.
transformers' generate runs the same configurations in a subprocess that never imports JAX (its
assisted generation takes batches of one: at batch 8 its rows say so). "verify_cost": one forward of
the target over k + 1 positions per row against one position (a plain step), jitted alone, medians.
The last line on stdout is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from shapes import LLAMA_20M, LLAMA_150M, LLAMA_TINY
from workers import run_json

SIZES = {"tiny": LLAMA_TINY, "20m": LLAMA_20M, "150m": LLAMA_150M}
FULL = dict(size="20m", batches="1,8", new_tokens=128, runs=3, lookup="3,4,5", draft_tokens=4)
QUICK = dict(size="tiny", batches="1", new_tokens=16, runs=1, lookup="3", draft_tokens=3)
PHRASE = 8  # tokens of each row's repeated phrase
_WORKER_TIMEOUT_S = 3600


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompt_ids(batch: int, length: int, vocab_size: int):
    """int64 [batch, length]: each row a phrase of PHRASE random ids of its own, repeated."""
    import numpy as np

    phrases = np.random.default_rng(0).integers(8, vocab_size, (batch, PHRASE), dtype=np.int64)
    return np.tile(phrases, (1, -(-length // PHRASE)))[:, :length]


NAMES = ("total", "count", "value", "items", "result", "index", "buffer", "offset", "scale", "weight")
BODIES = (
    "    {a} = 0\n    for {b} in range(n):\n        {a} += {b} * {k}\n    return {a}\n",
    "    {a} = []\n    for {b} in data:\n        if {b} > {k}:\n            {a}.append({b})\n    return {a}\n",
    "    {a} = {k}\n    while {a} < n:\n        {a} = {a} * 2 + {b}\n    return {a}\n",
)


def code_edits(count: int) -> list[str]:
    """`count` records of a code edit: a function, "# renamed", and the function with its first name changed."""
    import random

    rng = random.Random(0)
    records = []
    for i in range(count):
        a, b, new = rng.sample(NAMES, 3)
        body = BODIES[i % len(BODIES)].format(a=a, b=b, k=rng.randint(2, 9))
        function = f"def step_{i}(n, data, {b}):\n{body}"
        records.append(f"{function}# renamed\n{function.replace(a, new)}\n")
    return records


def corpus_prompt_ids(checkpoint, batch: int, length: int):
    """int64 [batch, length]: for row i, the last `length` tokens of the code-edit records up to record
    i's "# renamed" line (`code_edits`), tokenised with the checkpoint's tokenizer."""
    import numpy as np
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    records = code_edits(CORPUS)
    rows = []
    for i in range(batch):
        before = "".join(records[(i + j) % CORPUS] for j in range(1, 4))  # other records, as in a file
        mine = records[i % CORPUS]
        text = before + mine[: mine.index("# renamed\n") + len("# renamed\n")]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            raise SystemExit(
                f"--prompt {length}: the code-edit prompts hold {len(ids)} tokens; pass --prompt {len(ids)}"
            )
        rows.append(ids[-length:])
    return np.asarray(rows, np.int64)


CORPUS = 48  # code-edit records in the training corpus


def write_trained_models(size: str, work: pathlib.Path, steps: int) -> dict[str, pathlib.Path]:
    """The target and a one-layer draft of its shape, each trained with hfjax's Trainer on the
    code-edit corpus for `steps` steps (module docstring), written under `work`."""
    import hfjax
    from hfjax import testing, training

    shape = SIZES[size]
    data = work / "code_edits.jsonl"
    records = code_edits(CORPUS)
    data.write_text("".join(json.dumps({"text": record}) + "\n" for record in records))
    paths = {}
    for name, layers in (("target", shape["num_hidden_layers"]), ("trained", 1)):
        path = testing.save_tiny_checkpoint(
            "llama", work / f"{name}-random", max_position_embeddings=4096, **{**shape, "num_hidden_layers": layers}
        )
        model = hfjax.load(path)
        schedule = training.linear_schedule(1e-3, warmup_steps=min(10, steps), total_steps=steps)
        trainer = hfjax.Trainer(model, optimizer=training.adamw(schedule), max_grad_norm=1.0)
        log(f"training the {name} ({layers} layers) for {steps} steps on {CORPUS} code edits ...")
        history = trainer.fit(str(data), steps=steps, batch_size=8, max_length=256, progress=True)
        log(f"  loss {history[0]['loss']:.2f} -> {history[-1]['loss']:.2f}")
        paths[name] = work / name
        trainer.save_pretrained(paths[name])
        losses = {"first": history[0]["loss"], "last": history[-1]["loss"]}
        (paths[name] / "losses.json").write_text(json.dumps(losses))
    return paths


def write_models(size: str, work: pathlib.Path) -> dict[str, pathlib.Path]:
    """The target, shallow and unrelated checkpoints (module docstring), written under `work`."""
    import torch
    import transformers

    from hfjax import testing

    shape = SIZES[size]
    target = testing.save_tiny_checkpoint("llama", work / "target", max_position_embeddings=4096, **shape)
    module = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        for layer in module.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    module.save_pretrained(target)
    shallow = testing.save_tiny_checkpoint(
        "llama", work / "shallow", max_position_embeddings=4096, **{**shape, "num_hidden_layers": 1}
    )
    first = transformers.AutoModelForCausalLM.from_pretrained(shallow).eval()
    first.load_state_dict(module.state_dict(), strict=False)  # the target's embedding, first layer, norm and head
    first.save_pretrained(shallow)
    unrelated = testing.save_tiny_checkpoint(
        "llama", work / "unrelated", seed=1, max_position_embeddings=4096, **{**shape, "num_hidden_layers": 1}
    )
    return {"target": target, "shallow": shallow, "unrelated": unrelated, "copy": target}


def configurations(args) -> dict[str, dict]:
    """{name: (drafter, k)}: plain, prompt lookup per k, and each draft model at --draft-tokens."""
    configs = {"plain": (None, 0)}
    configs.update({f"lookup_k{k}": ("lookup", k) for k in args.lookup})
    drafts = ("trained",) if args.trained else ("shallow", "copy", "unrelated")
    configs.update({f"{draft}_k{args.draft_tokens}": (draft, args.draft_tokens) for draft in drafts})
    return configs


def prompts_for(args, checkpoint, batch: int, vocab_size: int):
    """The prompts of a run: the code-edit corpus's (--trained), else the repeated random phrases."""
    return (
        corpus_prompt_ids(checkpoint, batch, args.prompt)
        if args.trained
        else prompt_ids(batch, args.prompt, vocab_size)
    )


# ---------------------------------------------------------------- transformers (no JAX in this process)


def torch_worker(args) -> dict:
    """transformers generate of each configuration, timed as hfjax's are (rotating order, medians)."""
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    drafts = {
        name: transformers.AutoModelForCausalLM.from_pretrained(path).eval() for name, path in args.drafts.items()
    }
    ids = torch.as_tensor(prompts_for(args, args.checkpoint, args.batch, target.config.vocab_size))
    configs = configurations(args)
    n = args.new_tokens

    def options(drafter, k) -> dict:
        if drafter is None:
            return {}
        if drafter == "lookup":
            return {"prompt_lookup_num_tokens": k}
        return {
            "assistant_model": drafts[drafter],
            "num_assistant_tokens": k,
            "num_assistant_tokens_schedule": "constant",
        }

    def once(drafter, k):
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0, **options(drafter, k),
            )  # fmt: skip
        return time.perf_counter() - start, out[:, args.prompt :].tolist()

    usable = {name: c for name, c in configs.items() if c[0] is None or args.batch == 1}
    for drafter, k in usable.values():
        once(drafter, k)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in usable}
    tokens = {}
    names = list(usable)
    for run in range(args.runs):
        for name in names[run % len(names) :] + names[: run % len(names)]:
            took, tokens[name] = once(*usable[name])
            seconds[name].append(took)
    rows = {name: _row(seconds[name], args.batch * n) | {"tokens": tokens[name]} for name in usable}
    for name in configs.keys() - usable.keys():
        rows[name] = {"error": "transformers' assisted generation takes batches of one"}
    return rows


def _row(seconds: list[float], tokens: int) -> dict:
    total = statistics.median(seconds)
    return {"total_s": total, "tokens_per_s": tokens / total, "runs": len(seconds)}


# ---------------------------------------------------------------- hfjax


def run_hfjax(models: dict, paths: dict, args, batch: int) -> dict:
    """Each configuration at `batch`: timed in rotating order, medians, with the draft counts."""
    import jax
    import numpy as np

    target = models["target"]
    ids = prompts_for(args, paths["target"], batch, target.config.vocab_size)
    configs = configurations(args)
    n = args.new_tokens

    def once(drafter, k):
        options = {}
        if drafter == "lookup":
            options = {"prompt_lookup_num_tokens": k}
        elif drafter is not None:
            options = {"assistant_model": models[drafter], "num_assistant_tokens": k}
        start = time.perf_counter()
        out = jax.block_until_ready(
            target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **options)
        )
        took = time.perf_counter() - start
        stats = target.last_generation_stats
        return took, np.asarray(out)[:, ids.shape[1] :], stats

    for name, config in configs.items():
        log(f"  batch {batch}: {name} (warm-up) ...")
        once(*config)
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    ratios: dict[str, list[float]] = {name: [] for name in configs}
    last = {}
    names = list(configs)
    for run in range(args.runs):
        took_now = {}
        for name in names[run % len(names) :] + names[: run % len(names)]:
            took, tokens, stats = once(*configs[name])
            took_now[name], last[name] = took, (tokens, stats)
            seconds[name].append(took)
        for name in names:
            ratios[name].append(took_now["plain"] / took_now[name])
    rows = {}
    for name in names:
        tokens, stats = last[name]
        row = _row(seconds[name], batch * n)
        row["over_plain_median_of_runs"] = statistics.median(ratios[name])
        row["same_tokens_as_plain"] = bool(np.array_equal(tokens, last["plain"][0]))
        if name != "plain":
            row["drafted_tokens"], row["accepted_tokens"] = stats.drafted_tokens, stats.accepted_tokens
            row["acceptance_rate"] = stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else None
            row["target_forwards"] = stats.target_forwards
            row["tokens_per_target_forward"] = (n - 1) / stats.target_forwards if stats.target_forwards else None
        rows[name] = row
    rows["_tokens"] = {name: last[name][0].tolist() for name in names}
    return rows


def verify_cost(model, batch: int, prompt: int, k: int, repeats: int) -> dict:
    """Seconds of one jitted forward of `model` over k + 1 positions per row against one position, at
    the prompt's end of a cache of `batch` rows (donated, as the decode's is), medians of `repeats`."""
    import jax
    import jax.numpy as jnp

    from hfjax import generation

    slots = generation.SlotModel(model, batch, prompt + 128)

    def forward(params, cache, ids, positions):
        with slots.bound(params):
            logits, cache = slots.run(params, cache, ids, positions, positions)
        return logits, cache

    program = jax.jit(forward, donate_argnums=1)
    cache = slots.empty_state(generation.SamplingFeatures()).cache
    seconds = {}
    for width in (1, k + 1):
        ids = jnp.zeros((batch, width), jnp.int32)
        positions = jnp.broadcast_to(prompt + jnp.arange(width, dtype=jnp.int32), (batch, width))
        logits, cache = jax.block_until_ready(program(model.params, cache, ids, positions))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            logits, cache = jax.block_until_ready(program(model.params, cache, ids, positions))
            samples.append(time.perf_counter() - start)
        seconds[width] = statistics.median(samples)
    return {
        "plain_step_s": seconds[1], f"verify_{k + 1}_positions_s": seconds[k + 1],
        "verify_over_plain_step": seconds[k + 1] / seconds[1],
    }  # fmt: skip


def benchmark(args, work: pathlib.Path) -> dict:
    import hfjax

    log(f"writing the {args.size} target and its drafts ...")
    paths = write_trained_models(args.size, work, args.train_steps) if args.trained else write_models(args.size, work)
    models = {name: hfjax.load(path) for name, path in paths.items() if name != "copy"}
    if "copy" in paths:
        models["copy"] = hfjax.load(paths["copy"])  # the target's checkpoint, loaded again as its draft
    report = {
        "benchmark": "speculative",
        "size": args.size,
        "dtype": "float32",
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "prompts": f"each row a phrase of {PHRASE} random tokens of its own, repeated (the random model)",
        "models": {
            "target": "layers after the first add nothing (o_proj, down_proj zeros)",
            "shallow": "the target's first layer alone: agrees by construction",
            "copy": "the target itself",
            "unrelated": "a one-layer Llama of other weights",
        },
        "hfjax": {},
        "transformers": {},
        "verify_cost": {},
    }
    if args.trained:
        report["prompts"] = "code edits: records up to one's '# renamed' line (the trained models' corpus)"
        report["models"] = {
            name: f"{what}, trained {args.train_steps} steps: loss {losses['first']:.2f} -> {losses['last']:.2f}"
            for name, what in (("target", f"the {args.size} Llama"), ("trained", "a one-layer Llama of its shape"))
            for losses in [json.loads((paths[name] / "losses.json").read_text())]
        }
    env = {**os.environ}
    for batch in args.batches:
        log(f"hfjax at batch {batch} ...")
        report["hfjax"][batch] = rows = run_hfjax(models, paths, args, batch)
        log(f"transformers at batch {batch} ...")
        theirs = run_json(
            [sys.executable, __file__, "--worker", "--checkpoint", str(paths["target"]), "--drafts",
             json.dumps({name: str(path) for name, path in paths.items() if name != "target"}),
             "--batch", str(batch), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--runs",
             str(args.runs), "--lookup", ",".join(map(str, args.lookup)), "--draft-tokens", str(args.draft_tokens),
             "--torch-threads", str(args.torch_threads), *(["--trained"] if args.trained else [])],
            env, timeout=_WORKER_TIMEOUT_S, what="the transformers worker",
        )  # fmt: skip
        ours_tokens = rows.pop("_tokens")
        for name, row in theirs.items() if isinstance(theirs, dict) and "error" not in theirs else ():
            if "tokens" in row:
                row["same_tokens_as_hfjax"] = row.pop("tokens") == ours_tokens[name]
            if name in rows and "tokens_per_s" in row:
                rows[name]["over_transformers"] = rows[name]["tokens_per_s"] / row["tokens_per_s"]
        report["transformers"][batch] = theirs
        report["verify_cost"][batch] = {
            f"k{k}": verify_cost(models["target"], batch, args.prompt, k, repeats=max(5, 5 * args.runs))
            for k in sorted({*args.lookup, args.draft_tokens})
        }
        log(json.dumps({"batch": batch, "hfjax": rows, "verify_cost": report["verify_cost"][batch]}))
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny Llama, batch 1, 16 new tokens, 1 run")
    parser.add_argument("--size", choices=SIZES, help=f"the target's shape (default {FULL['size']})")
    parser.add_argument("--batches", help=f"batch sizes, comma-separated (default {FULL['batches']})")
    parser.add_argument("--prompt", type=int, help="prompt tokens per row (default 64; --trained: 256)")
    parser.add_argument("--new-tokens", type=int, help=f"tokens generated per row (default {FULL['new_tokens']})")
    parser.add_argument("--runs", type=int, help=f"timed runs of each configuration (default {FULL['runs']})")
    parser.add_argument("--lookup", help=f"prompt lookup's k, comma-separated (default {FULL['lookup']})")
    parser.add_argument("--draft-tokens", type=int, help=f"the draft models' k (default {FULL['draft_tokens']})")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1, help="PyTorch's threads")
    parser.add_argument("--trained", action="store_true", help="the realistic case: models trained on code edits")
    parser.add_argument("--train-steps", type=int, default=300, help="--trained: training steps (default 300)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--drafts", type=json.loads, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prompt is None:
        args.prompt = 256 if args.trained else 64
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.lookup = [int(k) for k in str(args.lookup).split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(torch_worker(args)))
        return
    with tempfile.TemporaryDirectory(prefix="hfjax-speculative-") as tmp:
        os.environ["HFJAX_CACHE_DIR"] = str(pathlib.Path(tmp) / "xla-cache")
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch beside JAX in this process (model writing)
        report = benchmark(args, pathlib.Path(tmp))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
