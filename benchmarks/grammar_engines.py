"""Grammar engines for structured outputs, measured on one byte-level BPE vocabulary of 32000 tokens.

    pip install llguidance xgrammar outlines-core jsonschema   # not hfjax dependencies (README: how)
    python benchmarks/grammar_engines.py                      # about 90 s on 2 cores
    python benchmarks/grammar_engines.py --runs 1 --walks 2 --cases regex,choice   # a quick check

llguidance, xgrammar and outlines-core, on a JSON schema of 20 properties, any JSON object, a date
regex and a choice of 5 strings: compile time (cold and warm), mask and advance time per token at 1
and 16 rows while following walks that every engine allows, each engine's own answers checked
(jsonschema, the regex, the choices), and outlines-core's token automaton as device arrays with a
jitted JAX step over them. benchmarks/README.md says how each figure is taken.

The last line on stdout is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import outlines_core
import torch
import transformers
import xgrammar

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from grammars import CASES, VOCAB, build_tokenizer  # noqa: E402

ROWS = 16
CLOSERS = (b'"', b"}", b"]", b",", b":")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median_us(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e6, 1)


def token_bytes(hf: transformers.PreTrainedTokenizerFast) -> list[bytes]:
    """Each token's bytes, undoing the byte-level alphabet (printable bytes stand for themselves)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    out = [b""] * len(hf)
    for token, index in hf.get_vocab().items():
        out[index] = b"" if index == hf.eos_token_id else bytes(to_byte[c] for c in token)
    return out


# ---------------------------------------------------------------- engines: one interface


class Engine:
    """One row's mask and advance; subclasses with a batch API (threads over rows) set `batched`."""

    batched = False

    def fill(self, matchers, bitmask, batch_api=True):
        if batch_api and self.batched and len(matchers) > 1:
            return self.fill_batch(matchers, bitmask)
        for row, matcher in enumerate(matchers):
            self.fill_row(matcher, bitmask, row)

    def advance(self, matchers, tokens, batch_api=True):
        if batch_api and self.batched and len(matchers) > 1:
            return self.advance_batch(matchers, tokens)
        return [self.advance_row(matcher, token) for matcher, token in zip(matchers, tokens)]

    def reset(self, matcher):
        matcher.reset()


class Llguidance(Engine):
    name, batched = "llguidance", True

    def __init__(self, hf):
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
        self.executor = llguidance.LLExecutor(2)

    def compile(self, kind, grammar):
        make = (
            llguidance.LLMatcher.grammar_from_json_schema if kind == "json" else llguidance.LLMatcher.grammar_from_regex
        )
        matcher = llguidance.LLMatcher(self.tokenizer, make(grammar), log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance rejected {kind}: {matcher.get_error()}")
        return matcher

    def matchers(self, compiled, rows):
        return [compiled.deep_copy() for _ in range(rows)]

    def fill_row(self, matcher, bitmask, row):
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers, bitmask):
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance_row(self, matcher, token):
        return matcher.consume_token(token)

    def advance_batch(self, matchers, tokens):
        return llguidance.numpy.consume_token_par(self.executor, list(zip(matchers, tokens)))


class Xgrammar(Engine):
    name, batched = "xgrammar", True

    def __init__(self, hf):
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batch = xgrammar.BatchGrammarMatcher(2)

    def compile(self, kind, grammar):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(grammar))
        return self.compiler.compile_regex(grammar)

    def matchers(self, compiled, rows):
        return [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]

    def fill_row(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)  # the tensor shares the array's memory

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    def advance_row(self, matcher, token):
        return matcher.accept_token(token)

    def advance_batch(self, matchers, tokens):
        return xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, tokens)


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, hf):
        by_bytes: dict[bytes, list[int]] = {}
        for index, piece in enumerate(token_bytes(hf)):
            if index != hf.eos_token_id:
                by_bytes.setdefault(piece, []).append(index)
        self.vocabulary = outlines_core.Vocabulary(hf.eos_token_id, by_bytes)

    def compile(self, kind, grammar):
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(grammar)) if kind == "json" else grammar
        return outlines_core.Index(regex, self.vocabulary)

    def matchers(self, compiled, rows):
        return [outlines_core.Guide(compiled) for _ in range(rows)]

    def fill_row(self, guide, bitmask, row):
        guide.write_mask_into(bitmask[row].ctypes.data, bitmask.shape[1], 4)

    def advance_row(self, guide, token):
        guide.advance(token, return_tokens=False)  # raises on a token the state does not allow
        return True


ENGINES = (Llguidance, Xgrammar, OutlinesCore)


def allowed(bitmask_row: np.ndarray) -> np.ndarray:
    return np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


# ---------------------------------------------------------------- measurements


def rotated(engines, step):
    """The engines in a different order each step, so that noise falls on all alike."""
    shift = step % len(engines)
    return engines[shift:] + engines[:shift]


def compile_times(engines, hf, case, runs):
    """{engine: {cold_s, warm_s}}: medians over runs, the engines alternating within each run."""
    kind, grammar, variant = CASES[case]
    bitmask = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
    cold, warm = ({e.name: [] for e in engines} for _ in range(2))
    for run in range(runs):
        for engine in rotated(engines, run):
            start = time.perf_counter()
            fresh = type(engine)(hf)
            fresh.fill(fresh.matchers(fresh.compile(kind, grammar), 1), bitmask)
            cold[engine.name].append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.fill(engine.matchers(engine.compile(kind, variant(run)), 1), bitmask)
            warm[engine.name].append(time.perf_counter() - start)
    median = lambda xs: round(statistics.median(xs), 4)  # noqa: E731
    return {e.name: {"cold_s": median(cold[e.name]), "warm_s": median(warm[e.name])} for e in engines}


def pick(rng, together, kinds, taken):
    """A seeded-random allowed token: a closing one, more often the longer the answer, else one of the
    longest (as a model says a forced key in one token), else any; whitespace only when nothing else is allowed.
    """
    closers, blank, lengths = kinds
    choices = np.flatnonzero(together & ~blank) if (together & ~blank).any() else np.flatnonzero(together)
    closing = np.flatnonzero(together & closers)
    draw = rng.random()
    if closing.size and draw < taken / 40:
        return int(rng.choice(closing))
    if draw < 0.5 + taken / 80:
        return int(rng.choice(choices[lengths[choices] == lengths[choices].max()]))
    return int(rng.choice(choices))


def walk(engines, compiled, kinds, seed, max_tokens, times):
    """(tokens, how it ended): tokens picked one at a time among those all engines allow, until all allow
    EOS ("eos"), none is allowed by all ("disagree") or max_tokens; times[name] gets mask and advance seconds.
    """
    rng = random.Random(seed)
    state = {e.name: e.matchers(compiled[e.name], 1) for e in engines}
    bitmask = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
    tokens, eos = [], 0
    for step in range(max_tokens):
        order = rotated(engines, step)
        together = np.ones(VOCAB, bool)
        for engine in order:
            start = time.perf_counter()
            engine.fill(state[engine.name], bitmask)
            times[engine.name]["mask"].append(time.perf_counter() - start)
            together &= allowed(bitmask[0])
        if together[eos]:
            return tokens, "eos"
        if not together.any():
            return tokens, "disagree"
        token = pick(rng, together, kinds, len(tokens))
        tokens.append(token)
        for engine in order:
            start = time.perf_counter()
            engine.advance(state[engine.name], [token])
            times[engine.name]["advance"].append(time.perf_counter() - start)
    return tokens, "max_tokens"


def valid(case, text):
    if case in ("schema", "any_object"):
        try:
            jsonschema.validate(json.loads(text), CASES[case][1])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return re.fullmatch(CASES[case][1], text) is not None


def batch_times(engines, compiled, paths, steps, batch_api):
    """Mask and advance seconds for ROWS rows at once per engine, each row replaying its path, again when done."""
    matchers = {e.name: e.matchers(compiled[e.name], ROWS) for e in engines}
    bitmask = llguidance.numpy.allocate_token_bitmask(ROWS, VOCAB)
    position = [0] * ROWS
    times = {e.name: {"mask": [], "advance": []} for e in engines}
    for step in range(steps):
        for row in range(ROWS):
            if position[row] == len(paths[row]):
                for engine in engines:
                    engine.reset(matchers[engine.name][row])
                position[row] = 0
        tokens = [paths[row][position[row]] for row in range(ROWS)]
        for engine in rotated(engines, step):
            start = time.perf_counter()
            engine.fill(matchers[engine.name], bitmask, batch_api)
            times[engine.name]["mask"].append(time.perf_counter() - start)
            start = time.perf_counter()
            accepted = engine.advance(matchers[engine.name], tokens, batch_api)
            times[engine.name]["advance"].append(time.perf_counter() - start)
            if not all(accepted):
                raise RuntimeError(f"{engine.name} refused a token of a path every engine allowed")
        position = [p + 1 for p in position]
    return times


# ---------------------------------------------------------------- outlines-core's automaton as arrays


def automaton_arrays(index):
    """The index as CSR arrays, states renumbered 0..S-1: row_start [S+1], token [T], target [T].

    A final state's EOS is a transition to itself, so the arrays alone give every allowed token.
    """
    transitions = index.get_transitions()
    states = sorted(set(transitions) | {n for row in transitions.values() for n in row.values()})
    number = {s: i for i, s in enumerate(states)}
    row_start, token, target = [0], [], []
    for s in states:
        row = sorted(transitions.get(s, {}).items())
        token += [t for t, _ in row]
        target += [number[n] for _, n in row]
        row_start.append(len(token))
    return number, *(np.asarray(xs, np.int32) for xs in (row_start, token, target))


def csr_next(state, tok, row_start, token, target, degree):
    """Each row's next state: a binary search of tok in token[row_start[s]:row_start[s + 1]]."""
    low, high = row_start[state], row_start[state + 1]
    last = token.size - 1

    def halve(_, bounds):
        low, high = bounds
        middle = (low + high) // 2
        right = (low < high) & (token[jnp.minimum(middle, last)] < tok)
        return jnp.where(right, middle + 1, low), jnp.where(right | (low >= high), high, middle)

    slot, _ = jax.lax.fori_loop(0, degree.bit_length(), halve, (low, high))
    found = (slot < row_start[state + 1]) & (token[jnp.minimum(slot, last)] == tok)
    return jnp.where(found, target[jnp.minimum(slot, last)], 0)


def device_steps(row_start, token, target, degree):
    """Jittable steps (states [R], tokens [R]) -> (next states [R], allowed [R, VOCAB]) per layout."""

    def csr(state, tok, row_start, token, target):  # the mask scattered from the next state's row
        following = csr_next(state, tok, row_start, token, target, degree)
        offsets = row_start[following][:, None] + jnp.arange(degree)[None, :]
        live = offsets < row_start[following + 1][:, None]
        columns = jnp.where(live, token[jnp.minimum(offsets, token.size - 1)], VOCAB)
        rows = jnp.arange(state.size)[:, None]
        return following, jnp.zeros((state.size, VOCAB), bool).at[rows, columns].set(True, mode="drop")

    def csr_bitmask(state, tok, row_start, token, target, bits):  # the mask a row of [S, VOCAB/32] bits
        following = csr_next(state, tok, row_start, token, target, degree)
        unpacked = (bits[following][:, :, None] >> jnp.arange(32)) & 1
        return following, unpacked.reshape(state.size, -1)[:, :VOCAB].astype(bool)

    def dense(state, tok, table):
        following = jnp.maximum(table[state, tok], 0)
        return following, table[following] >= 0

    states = row_start.size - 1
    owner = np.repeat(np.arange(states), np.diff(row_start))
    bits = np.zeros((states, (VOCAB + 31) // 32 * 32), bool)
    bits[owner, token] = True
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    csr_arrays = [jnp.asarray(a) for a in (row_start, token, target)]
    steps = {"csr": (csr, csr_arrays), "csr_bitmask": (csr_bitmask, [*csr_arrays, jnp.asarray(packed)])}
    if states * VOCAB * 4 <= 2**31:
        table = np.full((states, VOCAB), -1, np.int32)
        table[owner, token] = target
        steps["dense"] = (dense, [jnp.asarray(table)])
    return {name: (jax.jit(step), arrays) for name, (step, arrays) in steps.items()}


def device_step_times(index, paths, runs):
    number, row_start, token, target = automaton_arrays(index)
    states, degree = len(row_start) - 1, int(np.diff(row_start).max())
    figures = {
        "states": states,
        "transitions": int(token.size),
        "max_out_degree": degree,
        "dense_int32_bytes": states * VOCAB * 4,
        "csr_bytes": int(row_start.nbytes + token.nbytes + target.nbytes),
        "bitmask_bytes": states * ((VOCAB + 31) // 32) * 4,
    }
    # ROWS rows at assorted points of the walks: the state before a token, the token, outlines-core's answers
    rng, before, tokens, expected, masks = random.Random(0), [], [], [], []
    bitmask = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
    for row in range(ROWS):
        path = paths[row % len(paths)]
        cut = rng.randrange(len(path))
        guide = outlines_core.Guide(index)
        for t in path[:cut]:
            guide.advance(t, return_tokens=False)
        before.append(number[guide.get_state()])
        guide.advance(path[cut], return_tokens=False)
        tokens.append(path[cut])
        expected.append(number[guide.get_state()])
        guide.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)
        masks.append(allowed(bitmask[0]))
    before, tokens = jnp.asarray(before, jnp.int32), jnp.asarray(tokens, jnp.int32)
    for name, (step, arrays) in device_steps(row_start, token, target, degree).items():
        following, mask = jax.block_until_ready(step(before, tokens, *arrays))  # compiles
        if np.asarray(following).tolist() != expected or not np.array_equal(np.asarray(mask), np.stack(masks)):
            raise RuntimeError(f"the {name} layout's step differs from outlines-core's Guide")
        seconds = []
        for _ in range(runs):
            start = time.perf_counter()
            jax.block_until_ready(step(before, tokens, *arrays))
            seconds.append(time.perf_counter() - start)
        figures[f"jax_{name}_step_{ROWS}_rows_us"] = median_us(seconds)
    return figures


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="compile runs (cold and warm) per engine and case")
    parser.add_argument("--walks", type=int, default=ROWS, help="seeded walks per case, all engines in lockstep")
    parser.add_argument("--own-walks", type=int, default=8, help="seeded walks per engine and case, alone")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-steps", type=int, default=64, help="16-row steps per engine and case")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    cases = args.cases.split(",")

    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        hf = build_tokenizer(directory)
        log(f"tokenizer: {len(hf)} tokens in {time.perf_counter() - start:.1f}s")
    assert len(hf) == VOCAB and hf.eos_token_id == 0, (len(hf), hf.eos_token_id)
    pieces = token_bytes(hf)
    kinds = (
        np.array([p in CLOSERS for p in pieces]),
        np.array([not p.strip() for p in pieces]),
        np.array(list(map(len, pieces))),
    )
    engines = []
    result = {"vocab": VOCAB, "versions": {}, "engines": {}, "automaton": {}, "walks": {}}
    for engine_type in ENGINES:
        start = time.perf_counter()
        engines.append(engine_type(hf))
        result["engines"][engine_type.name] = {"tokenizer_info_s": round(time.perf_counter() - start, 3)}
        result["versions"][engine_type.name] = importlib.metadata.version(engine_type.name)
    result["versions"] |= {"jax": jax.__version__, "jsonschema": importlib.metadata.version("jsonschema")}

    for case in cases:
        kind, grammar, _ = CASES[case]
        log(f"{case}: compiling")
        for name, figures in compile_times(engines, hf, case, args.runs).items():
            result["engines"][name][case] = figures
        compiled = {e.name: e.compile(kind, grammar) for e in engines}
        times = {e.name: {"mask": [], "advance": []} for e in engines}
        paths, ends = [], []
        for seed in range(args.walks):
            tokens, end = walk(engines, compiled, kinds, seed, args.max_tokens, times)
            paths.append(tokens)
            ends.append(end)
        answers = [hf.decode(p) for p in paths]
        result["walks"][case] = {
            "ends": {e: ends.count(e) for e in sorted(set(ends))},
            "tokens_median": statistics.median(map(len, paths)),
            "valid": f"{sum(valid(case, a) for a in answers)}/{len(answers)}",
            "example": answers[0][:200],
        }
        log(f"{case}: lockstep walks {result['walks'][case]}")
        complete = [p for p, end in zip(paths, ends) if end == "eos" and p]
        rows = [complete[i % len(complete)] for i in range(ROWS)]
        batch = batch_times(engines, compiled, rows, args.batch_steps, batch_api=True)
        loop = batch_times([e for e in engines if e.batched], compiled, rows, args.batch_steps, batch_api=False)
        for engine in engines:
            figures = result["engines"][engine.name][case]
            figures["mask_1_row_us"] = median_us(times[engine.name]["mask"])
            figures["advance_1_row_us"] = median_us(times[engine.name]["advance"])
            figures[f"mask_{ROWS}_rows_us"] = median_us(batch[engine.name]["mask"])
            figures[f"advance_{ROWS}_rows_us"] = median_us(batch[engine.name]["advance"])
            if engine.name in loop:  # the same rows one after another through the one-row API
                figures[f"mask_{ROWS}_rows_loop_us"] = median_us(loop[engine.name]["mask"])
                figures[f"advance_{ROWS}_rows_loop_us"] = median_us(loop[engine.name]["advance"])
            answers, own = [], {engine.name: {"mask": [], "advance": []}}
            for seed in range(100, 100 + args.own_walks):
                tokens, end = walk([engine], compiled, kinds, seed, args.max_tokens, own)
                answers.append(hf.decode(tokens) if end == "eos" else None)
            wrong = [a for a in answers if a is None or not valid(case, a)]
            figures["own_walks_valid"] = f"{len(answers) - len(wrong)}/{len(answers)}"
            if wrong:
                figures["own_walk_invalid_example"] = (wrong[0] or "(no EOS within --max-tokens)")[:200]
            log(f"{case} {engine.name}: {figures}")
        result["automaton"][case] = device_step_times(compiled["outlines-core"], complete, runs=20)
        log(f"{case} automaton: {result['automaton'][case]}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
