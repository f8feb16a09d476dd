"""Decode benchmark: hfjax's compiled `generate` against PyTorch and the memory-bandwidth ceiling.

    python benchmarks/decode.py                 # 20M and 150M Llama, prompts 16/512, batch 1/8, 128 tokens
    python benchmarks/decode.py --quick         # 20M only, prompt 16, 32 tokens, 1 run (~3 min on 2 cores)
    python benchmarks/decode.py --gpu-llama-1b  # Llama-3.2-1B-shaped, bfloat16, on a GPU
    python benchmarks/decode.py --quantize int8,int4    # and hfjax with quantized weights beside float32's
    python benchmarks/decode.py --speculative [--quick] # prompt lookup and draft models (benchmarks/speculative.py)

Methods, each timed on the same random-weight checkpoint and the same random prompts:
  hfjax          model.generate: a compiled prefill, then the whole decode loop as one XLA program (while_loops)
  hand_recipe    the public recipe: a Python loop around a jitted one-token step (hfjax.jit of the
                 transformers model, a StaticCache as a pytree), one host round trip per token
  torch_dynamic  transformers generate, PyTorch eager, dynamic cache
  torch_static   transformers generate, PyTorch eager, cache_implementation="static"
  torch_compile  transformers generate with one StaticCache kept across calls (reset in place, so
                 its tensors keep their addresses) and a CompileConfig (fullgraph=True, mode
                 reduce-overhead): transformers torch.compiles the decode step, which CUDA graphs
                 replay on a GPU. The row says whether they did: torch.cuda.CUDAGraph.replay calls
                 counted over the timed runs (at least one per decode step) and inductor's
                 cudagraph_skips counter (zero). A cache made per call would be re-recorded each call.

With --quantize, each mode adds a method "hfjax_<mode>": `hfjax.load(path, quantize=mode)` of the same
checkpoint, timed as hfjax is. Its rows add the weight bytes read per token (quantized weights and
their scales as held, plus the float embedding row and LM head) and the fraction of the bandwidth
ceiling at those bytes; "quantized" in the report gives its tokens/s over float hfjax's in the same
run. A worker process per mode also reports the peak host memory of quantizing while loading the
largest model (anonymous memory, sampled every millisecond), beside the checkpoint's size.

Every method generates exactly --new-tokens tokens (min_new_tokens = max_new_tokens) greedily.
Decode tokens/s is (new tokens - 1) / (total - time to first token), per sequence; "total"
multiplies by the batch. Figures are medians over --runs runs after a warm-up call.
batch8_over_batch1 is the median ratio over --pairs pairs of hfjax runs at batch 8 and batch
1 timed in turn: this machine's bandwidth can change state between configurations.

The PyTorch baselines run in subprocesses that never import JAX: torch's OpenMP threads run up
to 30x slower beside JAX's CPU runtime. Cold and warm time to first token are measured in two
more subprocesses sharing one fresh HFJAX_CACHE_DIR. The last line on stdout is one JSON object;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from unittest import mock

from shapes import LLAMA_1B, LLAMA_20M, LLAMA_150M, LLAMA_TINY
from workers import import_model_code, run_json

SIZES = {
    "tiny": LLAMA_TINY,  # plumbing checks only (benchmarks/accelerator.py --cpu-dry-run)
    "20m": LLAMA_20M,
    "150m": LLAMA_150M,
    "llama-1b": LLAMA_1B,
}
METHODS = ("hfjax", "hand_recipe", "torch_dynamic", "torch_static", "torch_compile")
TORCH_METHODS = ("torch_dynamic", "torch_static", "torch_compile")
FULL = dict(sizes="20m,150m", prompts="16,512", batches="1,8", new_tokens=128, runs=3, pairs=7)
QUICK = dict(sizes="20m", prompts="16", batches="1,8", new_tokens=32, runs=1, pairs=3)
GPU = dict(sizes="llama-1b", prompts="16,128", batches="1", new_tokens=128, runs=3, pairs=3)
GPU_SKIPPED = ("hand_recipe", "torch_dynamic")
TARGETS = dict(
    over_torch_static=2.5,
    over_torch_compile=2.0,
    fraction_of_ceiling=0.85,
    warm_ttft_s=0.5,
    batch8_over_batch1=5.0,
    gpu_fraction_of_ceiling=0.80,
)
QUANTIZE_MODES = ("int8", "fp8", "int4")
QUANTIZED_TARGETS = {"int8": 2.0, "int4": 3.0}  # over float32 hfjax on the CPU (150M Llama, batch 1)
GPU_QUANTIZED_TARGETS = {"fp8": 1.6, "int8": 1.6}  # over bfloat16 hfjax on a GPU (Llama-3.2-1B)
_WARMUP_TOKENS = 4  # eager warm-up length; compiled paths warm up at full length (their shapes depend on it)
_WORKER_TIMEOUT_S = 3600


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- timing records


@dataclasses.dataclass(frozen=True)
class Timing:
    """One generate call. Seconds from the call to the first new token on the host, and to the end."""

    time_to_first_token: float
    total: float
    new_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:  # per sequence
        return (self.new_tokens - 1) / (self.total - self.time_to_first_token)


def summarize(timings: list[Timing], batch: int) -> dict:
    per_sequence = statistics.median(t.decode_tokens_per_s for t in timings)
    return {
        "decode_tokens_per_s": per_sequence,
        "decode_tokens_per_s_total": per_sequence * batch,
        "time_to_first_token_s": statistics.median(t.time_to_first_token for t in timings),
        "total_s": statistics.median(t.total for t in timings),
        "new_tokens": timings[0].new_tokens,
        "runs": len(timings),
    }


def prompt_ids(batch: int, length: int, vocab_size: int, seed: int = 0):
    """int64 [batch, length] random token ids above the special tokens, the same in every process."""
    import numpy as np

    return np.random.default_rng(seed).integers(8, vocab_size, (batch, length), dtype=np.int64)


def common_prefix(a, b) -> int:
    """The fewest leading new tokens that agree, over the rows of two [B, T] arrays."""
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    agree = np.cumprod(a == b, axis=1).sum(axis=1)
    return int(agree.min())


# ---------------------------------------------------------------- PyTorch worker (no JAX here)


def torch_worker(args) -> dict:
    """transformers generate in this process; runs in a subprocess that never imports JAX."""
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    device = "cuda" if args.gpu else "cpu"
    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device).eval()
    ids = torch.as_tensor(prompt_ids(args.batch, args.prompt, model.config.vocab_size)).to(device)
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, num_beams=args.num_beams)
    beams = args.num_beams > 1  # transformers streams no beam search: time to first token is not measured
    cache = None
    if args.method == "torch_static":
        options["cache_implementation"] = "static"
    if args.method == "torch_compile":
        compile_config = transformers.CompileConfig(fullgraph=True)
        # generate compiles on accelerators only unless told otherwise; CPU is what we measure here.
        compile_config._compile_all_devices = True
        options["compile_config"] = compile_config
        cache = transformers.StaticCache(config=model.config, max_cache_len=args.prompt + args.new_tokens)
        replays = _count_graph_replays(torch) if device == "cuda" else None

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    class FirstToken:  # transformers' streamer interface: put(prompt), put(token) per step, end()
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    def once(n: int) -> tuple[Timing, object]:
        streamer = None if beams else FirstToken()
        if cache is not None:
            with torch.inference_mode():  # its tensors were made in inference mode
                cache.reset()
            options["past_key_values"] = cache
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, streamer=streamer, **options)
        sync()
        end = time.perf_counter()
        first = start if beams else streamer.first
        return Timing(first - start, end - start, out.shape[1] - args.prompt), out

    compiled = args.method == "torch_compile"
    try:
        first, _ = once(args.new_tokens if compiled else _WARMUP_TOKENS)
        replayed_before = replays["count"] if compiled and replays is not None else 0
        results = [once(args.new_tokens) for _ in range(args.runs)]
    except Exception as error:  # reported in the JSON line (e.g. inductor failing on this machine)
        return {"error": f"{type(error).__name__}: {str(error)[:800]}"}
    summary = summarize([t for t, _ in results], args.batch)
    summary["first_call_s"] = first.total
    if compiled:
        summary["compile_s"] = first.total - summary["total_s"]
        summary["compile_mode"] = dict(fullgraph=True, mode=compile_config.mode, backend=compile_config.backend)
        summary["cuda_graphs"] = _graph_evidence(torch, replays, replayed_before, args.runs * (args.new_tokens - 1))
    summary["tokens"] = results[0][1][:, args.prompt :].tolist()
    return summary


def _count_graph_replays(torch) -> dict:
    """{"count": CUDA graph replays so far}: torch.compile's CUDA graph trees replay a recorded
    graph through torch.cuda.CUDAGraph.replay, wrapped here to count the calls."""
    replays = {"count": 0}
    original = torch.cuda.CUDAGraph.replay

    def replay(graph):
        replays["count"] += 1
        return original(graph)

    torch.cuda.CUDAGraph.replay = replay
    return replays


def _graph_evidence(torch, replays: dict | None, before: int, decode_steps: int) -> dict:
    """Whether the compiled decode steps ran as CUDA graphs over the timed runs."""
    if replays is None:
        return {"applies": False, "why": "CUDA graphs exist on CUDA devices only"}
    from torch._dynamo.utils import counters

    replayed = replays["count"] - before
    skips = int(counters["inductor"]["cudagraph_skips"])
    return {
        "applies": True,
        "replays_in_timed_runs": replayed,
        "decode_steps_in_timed_runs": decode_steps,
        "cudagraph_skips": skips,
        "verified": replayed >= decode_steps and skips == 0,
    }


def run_worker(kind: str, env: dict, **flags) -> dict:
    """Runs this file as a `--worker` subprocess and returns the JSON object it prints last."""
    command = [sys.executable, __file__, "--worker", kind]
    for name, value in flags.items():
        if value is True:
            command.append(f"--{name.replace('_', '-')}")
        elif value not in (None, False):
            command += [f"--{name.replace('_', '-')}", str(value)]
    return run_json(command, env, timeout=_WORKER_TIMEOUT_S, what=f"worker {kind}")


# ---------------------------------------------------------------- JAX side


_PRODUCTS = ("x @ W.T", "W @ x")


class Probe:
    """One jitted matrix-vector product over a weight W of `shape` in torch Linear's [out, in]
    layout; calling it gives the best bytes/s of W read over `rounds` timings.

    "x @ W.T" is written as a dot_general that contracts W's last axis: XLA's CPU backend
    compiles a literal `x @ W.T` by first copying W into its transpose, which runs at a
    fraction of the bandwidth (1.5 vs 25 GB/s here).
    """

    def __init__(self, product: str, shape: tuple[int, int], dtype: str, gpu: bool):
        import jax
        import jax.numpy as jnp

        rows, cols = shape
        self.product, self.shape = product, [rows, cols]
        self.w = jnp.ones((rows, cols), jnp.dtype(dtype))  # W: [out, in]
        self.x = jnp.ones((1, cols), self.w.dtype)  # x: [1, in]
        if product == "x @ W.T":
            self.run = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))  # [1, out]
        else:
            self.run = jax.jit(lambda x, w: w @ x[0])  # [out]
        self.repeats = 20 if gpu else 1  # on a GPU, repeated so launch cost fades
        self.run(self.x, self.w).block_until_ready()

    def __call__(self, rounds: int) -> float:
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(self.repeats):
                y = self.run(self.x, self.w)
            y.block_until_ready()
            best = min(best, (time.perf_counter() - start) / self.repeats)
        return self.w.nbytes / best / 1e9

    def describe(self, gb_per_s: float) -> dict:
        return {"product": self.product, "shape": self.shape, "dtype": str(self.w.dtype), "gb_per_s": gb_per_s}


def measure_bandwidth(gpu: bool) -> dict:
    """Best bytes/s of jitted matrix-vector products over a few weight shapes (see `Probe`)."""
    dtype = "bfloat16" if gpu else "float32"
    # float32 W of 256-512 MiB on CPU; 0.5-1 GiB of bfloat16 on a GPU.
    shapes = [(16384, 16384), (32768, 16384)] if gpu else [(8192, 8192), (16384, 8192), (8192, 16384)]
    rounds = 5 if gpu else 7
    probes = []
    for shape in shapes:
        for product in _PRODUCTS:
            probe = Probe(product, shape, dtype, gpu)
            probes.append(probe.describe(probe(rounds)))
            del probe  # one W held at a time
    return {"gb_per_s": max(p["gb_per_s"] for p in probes), "probes": probes}


def adjacent_probe(best: dict, gpu: bool) -> Probe:
    """The best probe of `measure_bandwidth`, run again right before each timed hfjax run.

    The bandwidth this shared machine gives one process drifts by a third from minute to
    minute, so the fraction of the ceiling is also taken run by run against the bandwidth
    measured just before it, besides against the best probe of the whole benchmark.
    """
    return Probe(best["product"], best["shape"], best["dtype"], gpu)


def weight_bytes(checkpoint: pathlib.Path, config, itemsize: int) -> dict:
    """Parameter count and bytes of weights read per decoded token, from the checkpoint's tensors."""
    import math

    from safetensors import safe_open

    shapes = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    params = sum(math.prod(s) for s in shapes.values())
    embedding = math.prod(shapes["model.embed_tokens.weight"])
    if config.tie_word_embeddings:
        read = params  # the table is the LM head too, and read in full there
        counted = "every weight once (the tied embedding table is read in full as the LM head)"
    else:
        read = params - embedding + config.hidden_size
        counted = "every weight except the embedding table, of which one row (it is gathered); the LM head in full"
    return {"params": params, "bytes_per_token": read * itemsize, "counted": counted + "; KV cache not counted"}


def generate_timed(model, ids, new_tokens: int, num_beams: int = 1) -> tuple[Timing, bool, object]:
    """One hfjax `generate` of exactly `new_tokens` tokens: its timing, whether it compiled, its output."""
    import jax

    out = jax.block_until_ready(
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=num_beams)
    )
    stats = model.last_generation_stats
    # With beams, as for transformers (which streams no beam search), tokens/s include the prefill.
    first = 0.0 if num_beams > 1 else stats.time_to_first_token
    return Timing(first, stats.total, stats.new_tokens), stats.compiled, out


def run_hfjax(
    model, ids, new_tokens: int, runs: int, probe: Probe | None = None, num_beams: int = 1
) -> tuple[dict, object]:
    import numpy as np

    first, _, _ = generate_timed(model, ids, new_tokens, num_beams)
    results, adjacent = [], []
    for _ in range(runs):
        if probe is not None:
            adjacent.append(probe(rounds=3))
        results.append(generate_timed(model, ids, new_tokens, num_beams))
    summary = summarize([t for t, _, _ in results], ids.shape[0])
    if probe is not None:
        summary["runs_decode_tokens_per_s"] = [t.decode_tokens_per_s for t, _, _ in results]
        summary["runs_adjacent_gb_per_s"] = adjacent
    summary["first_call_s"] = first.total
    summary["first_call_time_to_first_token_s"] = first.time_to_first_token
    summary["compile_s"] = first.total - summary["total_s"]
    summary["recompiled_in_timed_runs"] = any(compiled for _, compiled, _ in results)
    return summary, np.asarray(results[0][2])[:, ids.shape[1] :]


def alternate_batches(model, prompt: int, batch: int, new_tokens: int, pairs: int) -> dict:
    """hfjax's total decode tokens/s at `batch` over batch 1, the two generated in turn, `pairs` times.

    The timed runs of each configuration are minutes apart, and this machine's bandwidth can
    change state between them (benchmarks/README.md); each ratio here compares two runs
    seconds apart, the order switching every pair, and the median of the ratios is reported."""
    import jax

    ids = {b: jax.numpy.asarray(prompt_ids(b, prompt, model.config.vocab_size).astype("int32")) for b in (1, batch)}

    def total_tokens_per_s(b: int) -> float:
        timing, _, _ = generate_timed(model, ids[b], new_tokens)
        return b * timing.decode_tokens_per_s

    ratios = []
    for pair in range(pairs):
        rates = {b: total_tokens_per_s(b) for b in ((1, batch) if pair % 2 == 0 else (batch, 1))}
        ratios.append(rates[batch] / rates[1])
    return {"median": statistics.median(ratios), "pairs": ratios}


# hfjax.gpu's levers against its default (command buffers on for the decode since the 2026-12-04 H200
# run; cuDNN attention off until a GPU has measured it): the switches each row sets.
GPU_LEVERS = {
    "default": {},
    "no_command_buffers": {"HFJAX_GPU_COMMAND_BUFFERS": "0"},
    "cudnn_attention": {"HFJAX_GPU_ATTENTION": "cudnn"},
    "cudnn_attention_no_command_buffers": {"HFJAX_GPU_COMMAND_BUFFERS": "0", "HFJAX_GPU_ATTENTION": "cudnn"},
}


def gpu_levers(model, ids, new_tokens: int, runs: int, rounds: int) -> dict:
    """hfjax's decode tokens/s under each of the GPU hook's levers, in one process: each lever's
    programs are its own (a fresh `Generator`, compiled with the lever's switches set), and the levers
    take turns, the order reversed every round (A B C D D C B A ...). Off a GPU the hook is another,
    the switches do nothing, and the rows only check that this runs."""
    import numpy as np

    from hfjax import _backend

    generators, rates, tokens, errors = {}, {name: [] for name in GPU_LEVERS}, {}, {}
    for turn in range(rounds):
        for name in list(GPU_LEVERS) if turn % 2 == 0 else list(GPU_LEVERS)[::-1]:
            if name in errors:
                continue
            try:
                with mock.patch.dict(os.environ, GPU_LEVERS[name]):  # the switches, for this lever's calls only
                    model._generator = generators.get(name)  # None: a new one, whose programs read the switches
                    row, tokens[name] = run_hfjax(model, ids, new_tokens, runs)
                    generators[name] = model._generator
                rates[name].append(row["decode_tokens_per_s"])
            except Exception as error:  # noqa: BLE001 (a lever that fails is recorded; the others run)
                errors[name] = f"{type(error).__name__}: {error}"[:2000]
                log(f"    {name}: {errors[name][:300]}")
    medians = {name: statistics.median(values) for name, values in rates.items() if values}
    default = medians.get("default")
    return {
        "hook": _backend.active().name,  # "gpu" where the levers act
        "switches": GPU_LEVERS,
        "decode_tokens_per_s": medians,
        "runs": rates,
        "over_default": {name: rate / default for name, rate in medians.items()} if default else {},
        "same_tokens_as_default": {
            name: bool(np.array_equal(tokens[name], tokens["default"])) for name in tokens if "default" in tokens
        },
        **({"error": errors} if errors else {}),
    }


def run_hand_recipe(checkpoint, ids, new_tokens: int, runs: int, dtype: str) -> tuple[dict, object]:
    """The write-ups' recipe, on transformers 5: jit one step with a StaticCache, loop in Python."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torchax.interop
    import transformers

    import hfjax

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    step = hfjax.jit(torch_model)
    argmax = jax.jit(
        lambda logits: jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    )  # [B, S, V] -> [B, 1]

    def pick(logits):  # the logits come back as torchax tensors
        return argmax(torchax.interop.jax_view(logits))

    batch, length = ids.shape

    def once(n: int) -> tuple[Timing, np.ndarray]:
        cache = transformers.StaticCache(config=torch_model.config, max_cache_len=length + new_tokens)
        start = time.perf_counter()
        out = step(input_ids=ids, past_key_values=cache, use_cache=True)
        tokens = [np.asarray(pick(out.logits))]  # [B, 1] on the host: the recipe's round trip per token
        first = time.perf_counter()
        for _ in range(n - 1):
            out = step(input_ids=tokens[-1], past_key_values=cache, use_cache=True)
            tokens.append(np.asarray(pick(out.logits)))
        end = time.perf_counter()
        return Timing(first - start, end - start, n), np.concatenate(tokens, axis=1)

    first, _ = once(_WARMUP_TOKENS)
    results = [once(new_tokens) for _ in range(runs)]
    summary = summarize([t for t, _ in results], batch)
    summary["first_call_s"] = first.total
    summary["programs_compiled"] = step.compile_count
    return summary, results[0][1]


def quantized_weight_bytes(model, config) -> dict:
    """Bytes a quantized model reads per decoded token: every tensor as held (quantized weights with
    their scales and zero points, float norms and LM head), the embedding table but one row."""
    import math

    held = {name: math.prod(a.shape) * a.dtype.itemsize for name, a in model.params.items()}
    table = model.params["model.embed_tokens.weight"]
    read = sum(held.values())
    if not config.tie_word_embeddings:
        read -= held["model.embed_tokens.weight"] - config.hidden_size * table.dtype.itemsize
    return {"bytes_per_token": read, "quantized_layers": len(model.quantization.layers)}


def load_memory_worker(args) -> dict:
    """Peak anonymous memory (the process's own, not the page cache of the mapped files) while
    `hfjax.load(checkpoint, quantize=mode)` runs, sampled every millisecond, beside the checkpoint's
    size and its largest tensor."""
    import math
    import threading

    import jax
    from safetensors import safe_open

    import hfjax

    def anonymous() -> int:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("RssAnon")).split()[1]) * 1024

    # The runtime's own memory first (torch, transformers, XLA's client, the CPU kernels): a tiny load.
    with tempfile.TemporaryDirectory() as scratch:
        from hfjax import testing

        hfjax.load(testing.save_tiny_checkpoint("llama", scratch), dtype=args.dtype, quantize=args.quantize)
    before, peak, loading = anonymous(), [0], [True]

    def watch():
        while loading[0]:
            peak[0] = max(peak[0], anonymous())
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    model = hfjax.load(args.checkpoint, dtype=args.dtype, quantize=args.quantize)
    jax.block_until_ready(model.params)
    loading[0] = False
    watcher.join()
    files = sorted(pathlib.Path(args.checkpoint).glob("*.safetensors"))
    largest = 0
    for file in files:
        with safe_open(file, framework="np") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                largest = max(largest, math.prod(piece.get_shape()) * (4 if piece.get_dtype() == "F32" else 2))
    checkpoint_bytes = sum(file.stat().st_size for file in files)
    return {
        "mode": args.quantize,
        "peak_bytes": peak[0] - before,
        "checkpoint_bytes": checkpoint_bytes,
        "largest_tensor_bytes": largest,
        "below_checkpoint_plus_one_tensor": peak[0] - before < checkpoint_bytes + largest,
    }


def ttft_worker(args) -> dict:
    """Time to first token of the first generate call in a fresh process (HFJAX_CACHE_DIR set by the caller)."""
    start = time.perf_counter()
    import jax
    import numpy as np

    import hfjax

    imported = time.perf_counter()
    # The load's parts apart (the first H200 run saw 15-17 s of load_s for 2.47 GB, cause unknown):
    # starting JAX's backend (a GPU's client), then transformers' modeling code for the checkpoint's
    # class, which hfjax.load imports, then the load itself.
    jax.device_put(np.zeros(1, np.float32)).block_until_ready()
    backend = time.perf_counter()
    import_model_code(args.checkpoint)
    modeling = time.perf_counter()
    model = hfjax.load(args.checkpoint, dtype=args.dtype)
    loaded = time.perf_counter()
    ids = prompt_ids(args.batch, args.prompt, model.config.vocab_size).astype("int32")
    model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    stats = model.last_generation_stats
    return {
        "time_to_first_token_s": stats.time_to_first_token,
        "first_generate_total_s": stats.total,
        "import_s": imported - start,
        "backend_start_s": backend - imported,
        "modeling_import_s": modeling - backend,
        "load_s": loaded - modeling,
        "cache_entries": len(list(pathlib.Path(os.environ["HFJAX_CACHE_DIR"]).iterdir())),
    }


# ---------------------------------------------------------------- the run


def device_info() -> dict:
    import jax
    import torch
    import transformers

    return {
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d.device_kind) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }


def benchmark(args, work: pathlib.Path, envs: dict[str, dict]) -> dict:
    import jax

    import hfjax
    from hfjax import testing

    dtype = "bfloat16" if args.gpu_llama_1b else "float32"
    itemsize = 2 if dtype == "bfloat16" else 4
    methods = [m for m in METHODS if m not in args.skip]
    report = {
        "benchmark": "decode",
        "device": device_info(),
        "dtype": dtype,
        "new_tokens": args.new_tokens,
        "num_beams": args.num_beams,
        "runs": args.runs,
        "methods": methods,
        "models": {},
        "results": [],
        "batch_scaling_alternated": {},
        "gpu_levers": {},
        "torch_settings": {"threads": args.torch_threads, "OMP_WAIT_POLICY": envs["torch"].get("OMP_WAIT_POLICY")},
    }
    log(f"device: {report['device']}")
    probes = [measure_bandwidth(args.gpu_llama_1b)]
    log(f"bandwidth probe: {probes[0]['gb_per_s']:.1f} GB/s")
    probe = adjacent_probe(max(probes[0]["probes"], key=lambda p: p["gb_per_s"]), args.gpu_llama_1b)

    for size in args.sizes:
        checkpoint = testing.save_tiny_checkpoint(
            "llama", work / size, dtype=dtype, max_position_embeddings=4096, **SIZES[size]
        )
        model = hfjax.load(checkpoint, dtype=dtype)
        info = weight_bytes(checkpoint, model.config, itemsize)
        report["models"][size] = info
        log(f"{size}: {info['params']:,} parameters, {info['bytes_per_token'] / 1e6:.1f} MB read per token")
        quantized = {mode: hfjax.load(checkpoint, dtype=dtype, quantize=mode) for mode in args.quantize}
        info["quantized"] = {mode: quantized_weight_bytes(q, q.config) for mode, q in quantized.items()}
        for mode, held in info["quantized"].items():
            log(f"{size} quantize={mode}: {held['bytes_per_token'] / 1e6:.1f} MB read per token")
        for prompt in args.prompts:
            for batch in args.batches:
                config = dict(size=size, prompt=prompt, batch=batch)
                ids = prompt_ids(batch, prompt, model.config.vocab_size).astype("int32")
                reference = None
                for method in methods:
                    log(f"  {size} prompt {prompt} batch {batch}: {method} ...")
                    if method == "hfjax":
                        row, reference = run_hfjax(
                            model,
                            jax.numpy.asarray(ids),
                            args.new_tokens,
                            args.runs,
                            probe if batch == 1 and args.num_beams == 1 else None,
                            args.num_beams,
                        )
                    elif method == "hand_recipe":
                        row, tokens = run_hand_recipe(checkpoint, ids, args.new_tokens, args.runs, dtype)
                        row["common_prefix_with_hfjax"] = (
                            None if reference is None else common_prefix(tokens, reference)
                        )
                    else:
                        row = run_worker(
                            "torch",
                            envs["torch"],
                            checkpoint=checkpoint,
                            method=method,
                            prompt=prompt,
                            batch=batch,
                            new_tokens=args.new_tokens,
                            runs=args.runs,
                            dtype=dtype,
                            gpu=args.gpu_llama_1b,
                            torch_threads=args.torch_threads,
                            num_beams=args.num_beams,
                        )
                        tokens = row.pop("tokens", None)
                        if tokens is not None and reference is not None:
                            row["common_prefix_with_hfjax"] = common_prefix(tokens, reference)
                    report["results"].append({**config, "method": method, **row})
                    log("    " + _describe(row))
                for mode, quantized_model in quantized.items():
                    log(f"  {size} prompt {prompt} batch {batch}: hfjax quantize={mode} ...")
                    row, tokens = run_hfjax(
                        quantized_model,
                        jax.numpy.asarray(ids),
                        args.new_tokens,
                        args.runs,
                        probe if batch == 1 and args.num_beams == 1 else None,
                        args.num_beams,
                    )
                    row["common_prefix_with_hfjax"] = None if reference is None else common_prefix(tokens, reference)
                    report["results"].append({**config, "method": f"hfjax_{mode}", **row})
                    log("    " + _describe(row))
            if "hfjax" in methods and args.num_beams == 1 and 1 in args.batches:
                for batch in (b for b in args.batches if b > 1):
                    log(f"  {size} prompt {prompt}: hfjax batch {batch} and batch 1 in turn, {args.pairs} pairs ...")
                    scaling = alternate_batches(model, prompt, batch, args.new_tokens, args.pairs)
                    report["batch_scaling_alternated"][f"{size}/p{prompt}/b{batch}"] = scaling
                    log(
                        f"    batch {batch} over batch 1: median {scaling['median']:.2f} "
                        f"(pairs {', '.join(f'{r:.2f}' for r in scaling['pairs'])})"
                    )
            if args.gpu_levers and "hfjax" in methods and args.num_beams == 1 and prompt == args.prompts[0]:
                log(f"  {size} prompt {prompt} batch 1: hfjax under each GPU lever, {args.pairs} rounds ...")
                ids = jax.numpy.asarray(prompt_ids(1, prompt, model.config.vocab_size).astype("int32"))
                levers = gpu_levers(model, ids, args.new_tokens, args.runs, args.pairs)
                model._generator = None
                report["gpu_levers"][f"{size}/p{prompt}/b1"] = levers
                log(
                    f"    hook {levers['hook']}: "
                    + ", ".join(f"{k} {v:.2f}x" for k, v in levers["over_default"].items())
                )
        del model, quantized

    del probe
    if "hfjax" in methods and args.num_beams == 1:
        report["time_to_first_token_new_process"] = _new_process_ttft(args, work, envs["ttft"], dtype)
    report["quantize"] = args.quantize
    report["quantized_load_memory"] = {
        mode: run_worker(
            "load_memory", envs["torch"], checkpoint=work / _largest(args.sizes), dtype=dtype, quantize=mode
        )
        for mode in args.quantize
    }
    probes.append(measure_bandwidth(args.gpu_llama_1b))
    report["bandwidth_probes"] = [probe for p in probes for probe in p["probes"]]
    adjacent = [gb for row in report["results"] for gb in row.get("runs_adjacent_gb_per_s", [])]
    # The best reading of the probe product, at the start, at the end or beside a timed run:
    # a run that read faster than the start and end probes must not exceed its ceiling.
    report["bandwidth_gb_per_s"] = max([p["gb_per_s"] for p in probes] + adjacent)
    report["bandwidth_gb_per_s_median_probe"] = statistics.median(p["gb_per_s"] for p in report["bandwidth_probes"])
    log(
        f"bandwidth: {report['bandwidth_gb_per_s']:.1f} GB/s (best of {len(report['bandwidth_probes']) + len(adjacent)} probes)"
    )
    _add_ceilings(report)
    report["ratios"] = _ratios(report)
    report["quantized"] = _quantized_ratios(report)
    report["batch8_over_batch1"] = {
        key: scaling["median"] for key, scaling in report["batch_scaling_alternated"].items()
    }
    report["batch8_over_batch1_separate_runs"] = _batch_scaling(report)
    # The targets are for greedy decoding.
    report["targets"] = _targets(report, args) if args.num_beams == 1 else None
    return report


def _new_process_ttft(args, work: pathlib.Path, env: dict, dtype: str) -> dict:
    """Cold, then warm: two fresh processes sharing one new persistent compilation cache (env's HFJAX_CACHE_DIR)."""
    size, prompt = _largest(args.sizes), args.prompts[0]
    flags = dict(checkpoint=work / size, prompt=prompt, batch=1, new_tokens=args.new_tokens, dtype=dtype)
    result = {"size": size, "prompt": prompt, "batch": 1}
    for label in ("cold", "warm"):
        result[label] = run_worker("ttft", env, **flags)
        log(f"time to first token in a new process, {label} cache: {result[label]}")
    return result


def _largest(sizes: list[str]) -> str:
    return max(sizes, key=list(SIZES).index)


def _describe(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    text = (
        f"{row['decode_tokens_per_s']:.1f} tok/s per sequence, {row['decode_tokens_per_s_total']:.1f} total, "
        f"ttft {row['time_to_first_token_s'] * 1e3:.0f} ms, total {row['total_s']:.2f} s"
    )
    if "compile_s" in row:
        text += f", compile {row['compile_s']:.1f} s"
    return text


def _find(report: dict, size: str, prompt: int, batch: int, method: str) -> dict | None:
    for row in report["results"]:
        if (row["size"], row["prompt"], row["batch"], row["method"]) == (size, prompt, batch, method):
            return row if "error" not in row else None
    return None


def _add_ceilings(report: dict) -> None:
    bandwidth = report["bandwidth_gb_per_s"] * 1e9
    for info in report["models"].values():
        info["ceiling_tokens_per_s"] = bandwidth / info["bytes_per_token"]
    for row in report["results"]:
        if row["batch"] == 1 and "error" not in row:
            info = report["models"][row["size"]]
            mode = row["method"].removeprefix("hfjax_") if row["method"].startswith("hfjax_") else None
            if mode is not None:  # a quantized model reads its own bytes per token
                info = dict(info, bytes_per_token=info["quantized"][mode]["bytes_per_token"])
                info["ceiling_tokens_per_s"] = bandwidth / info["bytes_per_token"]
                row["bytes_per_token"] = info["bytes_per_token"]
            row["fraction_of_ceiling"] = row["decode_tokens_per_s"] / info["ceiling_tokens_per_s"]
            if "runs_adjacent_gb_per_s" in row:
                # Run by run: the bytes this run read per second over the bandwidth measured just before it.
                row["fraction_of_adjacent_ceiling"] = statistics.median(
                    rate * info["bytes_per_token"] / (gb * 1e9)
                    for rate, gb in zip(row["runs_decode_tokens_per_s"], row["runs_adjacent_gb_per_s"])
                )


def _quantized_ratios(report: dict) -> dict:
    """Per configuration and mode: quantized hfjax's decode tokens/s, bytes per token, fraction of
    the ceiling at those bytes, and its tokens/s over float hfjax's in the same run."""
    table = {}
    for row in report["results"]:
        if not row["method"].startswith("hfjax_") or "error" in row:
            continue
        mode = row["method"].removeprefix("hfjax_")
        key = f"{row['size']}/p{row['prompt']}/b{row['batch']}"
        float_row = _find(report, row["size"], row["prompt"], row["batch"], "hfjax")
        table.setdefault(key, {})[mode] = {
            "decode_tokens_per_s": row["decode_tokens_per_s"],
            "bytes_per_token": report["models"][row["size"]]["quantized"][mode]["bytes_per_token"],
            "fraction_of_ceiling": row.get("fraction_of_ceiling"),
            "fraction_of_adjacent_ceiling": row.get("fraction_of_adjacent_ceiling"),
            "over_hfjax": None if float_row is None else row["decode_tokens_per_s"] / float_row["decode_tokens_per_s"],
        }
    return table


def _ratios(report: dict) -> dict:
    """hfjax's decode tokens/s over each baseline's, per configuration."""
    ratios = {}
    for row in report["results"]:
        if row["method"] != "hfjax" or "error" in row:
            continue
        key = f"{row['size']}/p{row['prompt']}/b{row['batch']}"
        ratios[key] = {}
        for method in report["methods"]:
            other = _find(report, row["size"], row["prompt"], row["batch"], method)
            if method != "hfjax" and other is not None:
                ratios[key][f"over_{method}"] = row["decode_tokens_per_s"] / other["decode_tokens_per_s"]
    return ratios


def _batch_scaling(report: dict) -> dict:
    """hfjax's total decode throughput at each larger batch over batch 1, per model and prompt, from
    the medians of the configurations' own timed runs (minutes apart)."""
    scaling = {}
    for row in report["results"]:
        if row["method"] == "hfjax" and row["batch"] == 1 and "error" not in row:
            larger = [
                r
                for r in report["results"]
                if r["method"] == "hfjax"
                and "error" not in r
                and (r["size"], r["prompt"]) == (row["size"], row["prompt"])
                and r["batch"] > 1
            ]
            for other in larger:
                scaling[f"{row['size']}/p{row['prompt']}/b{other['batch']}"] = (
                    other["decode_tokens_per_s_total"] / row["decode_tokens_per_s_total"]
                )
    return scaling


def _targets(report: dict, args) -> dict:
    """The issue's targets as booleans next to the figures, for the largest model at batch 1, first prompt."""
    size, prompt = _largest(args.sizes), args.prompts[0]
    key = f"{size}/p{prompt}/b1"

    def check(value, bound: float, above: bool = True) -> dict:
        if value is None:
            return {"value": None, "met": None}
        return {"value": value, "min" if above else "max": bound, "met": value >= bound if above else value < bound}

    hfjax_row = _find(report, size, prompt, 1, "hfjax") or {}
    ratios = report["ratios"].get(key, {})
    targets = {"config": key}
    quantized = report.get("quantized", {}).get(key, {})
    for mode, bound in (GPU_QUANTIZED_TARGETS if args.gpu_llama_1b else QUANTIZED_TARGETS).items():
        if mode in args.quantize:
            targets[f"{mode}_over_hfjax"] = check(quantized.get(mode, {}).get("over_hfjax"), bound)
    if args.gpu_llama_1b:
        targets["hfjax_fraction_of_ceiling"] = check(
            hfjax_row.get("fraction_of_ceiling"), TARGETS["gpu_fraction_of_ceiling"]
        )
        for method in ("torch_static", "torch_compile"):
            targets[f"{method}_fraction_of_ceiling"] = (_find(report, size, prompt, 1, method) or {}).get(
                "fraction_of_ceiling"
            )
        return targets
    targets["over_torch_static"] = check(ratios.get("over_torch_static"), TARGETS["over_torch_static"])
    targets["over_torch_compile"] = check(ratios.get("over_torch_compile"), TARGETS["over_torch_compile"])
    targets["fraction_of_ceiling"] = check(
        hfjax_row.get("fraction_of_adjacent_ceiling"), TARGETS["fraction_of_ceiling"]
    )
    targets["fraction_of_ceiling"]["of_best_probe"] = hfjax_row.get("fraction_of_ceiling")
    warm = report.get("time_to_first_token_new_process", {}).get("warm", {}).get("time_to_first_token_s")
    targets["warm_time_to_first_token_s"] = check(warm, TARGETS["warm_ttft_s"], above=False)
    targets["batch8_over_batch1"] = check(
        report["batch8_over_batch1"].get(f"{size}/p{prompt}/b8"), TARGETS["batch8_over_batch1"]
    )
    return targets


# ---------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20m only, prompt 16, batch 1 and 8, 32 new tokens, 1 run")
    parser.add_argument("--sizes", help=f"models, comma-separated, of {', '.join(SIZES)} (default {FULL['sizes']})")
    parser.add_argument("--prompts", help=f"prompt lengths, comma-separated (default {FULL['prompts']})")
    parser.add_argument("--batches", help=f"batch sizes, comma-separated (default {FULL['batches']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens generated per sequence (default {FULL['new_tokens']})")
    parser.add_argument(
        "--runs", type=int, help=f"timed runs after the warm-up; medians are reported (default {FULL['runs']})"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        help="batch-1 and larger-batch hfjax runs timed in turn for the batch "
        f"scaling; the median ratio is reported (default {FULL['pairs']})",
    )
    parser.add_argument("--skip", default="", help=f"methods to leave out, comma-separated, of {', '.join(METHODS)}")
    parser.add_argument(
        "--quantize",
        default="",
        help=f"also time hfjax with weights quantized on load, comma-separated modes of {', '.join(QUANTIZE_MODES)} "
        "(default: none)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=os.cpu_count(),
        help="torch.set_num_threads for the PyTorch baselines (default: the core count)",
    )
    parser.add_argument(
        "--torch-omp-wait-policy",
        choices=("PASSIVE", "ACTIVE", "unset"),
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the PyTorch baselines' processes (default PASSIVE: spinning OpenMP "
        "threads slow torch several-fold when other processes share the cores)",
    )
    parser.add_argument(
        "--num-beams",
        type=int,
        default=1,
        help="beam search with this many beams (default 1: greedy); the hand recipe, which is greedy, "
        "is left out, and tokens/s include the prefill, as transformers streams no beam search",
    )
    parser.add_argument(
        "--gpu-levers",
        action="store_true",
        help="also decode at batch 1 under each of hfjax.gpu's levers (HFJAX_GPU_COMMAND_BUFFERS, "
        "HFJAX_GPU_ATTENTION), alternated with the default, --pairs rounds; they act on a GPU only",
    )
    parser.add_argument("--device-info", action="store_true", help="print the device and versions as JSON and exit")
    parser.add_argument(
        "--speculative", action="store_true",
        help="run benchmarks/speculative.py instead (speculative decoding; its flags follow, e.g. --quick)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-llama-1b",
        action="store_true",
        help="Llama-3.2-1B-shaped model in bfloat16 on the GPU: hfjax vs torch static and torch.compile",
    )
    # Used when this file runs itself as a subprocess.
    parser.add_argument("--worker", choices=("torch", "ttft", "load_memory"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=TORCH_METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    defaults = GPU if args.gpu_llama_1b else QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.sizes = _choices("--sizes", args.sizes, SIZES)
    args.prompts = [int(p) for p in args.prompts.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.skip = _choices("--skip", args.skip, METHODS) if args.skip else []
    args.quantize = _choices("--quantize", args.quantize, QUANTIZE_MODES) if args.quantize else []
    if args.num_beams < 1:
        raise SystemExit(f"--num-beams={args.num_beams} must be at least 1")
    if args.pairs < 1:
        raise SystemExit(f"--pairs={args.pairs} must be at least 1")
    if args.num_beams > 1:
        args.skip = sorted(set(args.skip) | {"hand_recipe"})
    if args.gpu_llama_1b:
        args.skip = sorted(set(args.skip) | set(GPU_SKIPPED))
    return args


def _choices(flag: str, text: str, allowed) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise SystemExit(f"{flag}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}")
    return values


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--speculative" in argv:  # its own benchmark, with its own flags
        import speculative

        speculative.main([a for a in argv if a != "--speculative"])
        return
    args = parse_args(argv)
    if args.worker == "torch":
        print(json.dumps(torch_worker(args)))
        return
    if args.worker == "ttft":
        print(json.dumps(ttft_worker(args)))
        return
    if args.worker == "load_memory":
        print(json.dumps(load_memory_worker(args)))
        return
    if args.device_info:
        print(json.dumps(device_info()))
        return
    if args.gpu_llama_1b:
        # JAX would otherwise take 75% of GPU memory up front, leaving PyTorch's worker too little.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    with tempfile.TemporaryDirectory(prefix="hfjax-decode-") as tmp:
        work = pathlib.Path(tmp)
        # Workers get the environment as it is now, before this process sets OMP_WAIT_POLICY for itself.
        envs = {
            "ttft": {**os.environ, "HFJAX_CACHE_DIR": str(work / "xla-cache-ttft")},
            "torch": {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")},
        }
        if args.torch_omp_wait_policy != "unset":
            envs["torch"]["OMP_WAIT_POLICY"] = args.torch_omp_wait_policy
        # A fresh compilation cache, so the compile times measured here are cold ones.
        os.environ["HFJAX_CACHE_DIR"] = str(work / "xla-cache")
        # This process runs torch (model building, the hand recipe's module) beside JAX's CPU runtime:
        # torch's OpenMP threads must sleep, not spin, while they wait (set before torch is imported).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if args.gpu_llama_1b:
            import jax

            if jax.default_backend() != "gpu":
                raise SystemExit(
                    f"--gpu-llama-1b needs JAX with a GPU backend; this JAX runs on {jax.default_backend()!r}"
                )
        report = benchmark(args, work, envs)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
