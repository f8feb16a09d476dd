"""`hfjax demo`: the main job on an embedded default.

Builds a small Llama-shaped checkpoint on disk (no hub needed), loads it through the
same path a hub model takes, runs it in PyTorch and in hfjax, and prints the parity
and the speed side by side.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

DEMO_CONFIG = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="build a small Llama checkpoint, run it in PyTorch and hfjax, compare parity and speed",
        description="Writes a small random Llama-shaped checkpoint (config.json, safetensors, tokenizer), "
        "loads it with hfjax.load, and compares hfjax against PyTorch on the same inputs.",
    )
    parser.add_argument(
        "--family", default="llama", help="model family to build (default: llama; see hfjax.testing.FAMILIES)"
    )
    parser.add_argument("--out", default=None, help="directory to keep the checkpoint in (default: a temporary one)")
    parser.add_argument("--batch", type=int, default=1, help="rows of the compared forward's random input (default: 1)")
    parser.add_argument(
        "--seq-len", type=int, default=128, help="tokens per row of the compared forward's random input (default: 128)"
    )


def run(args: argparse.Namespace) -> int:
    import hfjax
    from hfjax import testing

    overrides = DEMO_CONFIG if args.family == "llama" else {}
    with tempfile.TemporaryDirectory(prefix="hfjax-demo-") as scratch:
        path = pathlib.Path(args.out) if args.out else pathlib.Path(scratch) / args.family
        testing.save_tiny_checkpoint(args.family, path, **overrides)
        model = hfjax.load(path)
        print(f"checkpoint: {path}")
        print(f"loaded:     {model}")
        prompt = "The quick brown fox jumps over the lazy dog."
        if model.tokenizer is not None:
            ids = model.tokenizer(prompt, return_tensors="np")["input_ids"]
            print(f"tokenizer:  {prompt!r} -> {ids.shape[1]} token ids")
        print(
            f"compared:   a forward on random token ids, batch {args.batch} x {args.seq_len} tokens "
            "(--batch, --seq-len)"
        )
        report = hfjax.check(path, batch=args.batch, seq_len=args.seq_len, repeats=5)
    print(report.table())
    jit_rows = [r for r in report.rows if r.path == "jit" and r.seconds]
    if report.torch_seconds and jit_rows:
        speedup = report.torch_seconds / jit_rows[0].seconds
        print(
            f"forward:    PyTorch {report.torch_seconds * 1e3:.1f} ms, "
            f"hfjax {jit_rows[0].seconds * 1e3:.1f} ms ({speedup:.2f}x)"
        )
    print("parity: " + ("PASS" if report.passed else "FAIL"))
    return 0 if report.passed else 1
