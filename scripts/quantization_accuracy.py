"""Accuracy of quantize-on-load: each mode on each family of hfjax.testing.FAMILIES, against the same
model unquantized; writes the "Quantized weights" table of docs/coverage.md.

    python scripts/quantization_accuracy.py                # every family, int8 / fp8 / int4
    python scripts/quantization_accuracy.py --families llama,gpt2 --out -   # print the table only

For each family a tiny random checkpoint (`hfjax.testing.save_tiny_checkpoint`: causal and encoder
families with an LM head, "text-generation"; t5 and bart "text2text-generation") is loaded by hfjax
unquantized and with `quantize=mode`, and both run one forward on the same fixed text. The table
gives the relative L2 error of the logits, ||quantized - unquantized|| / ||unquantized||, and the
share of positions whose most likely token is the same. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import tempfile

_ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = ("int8", "fp8", "int4")
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest."
BEGIN = "<!-- quantization table: written by scripts/quantization_accuracy.py -->"
END = "<!-- end of quantization table -->"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(family: str, work: pathlib.Path) -> dict:
    import numpy as np

    import hfjax
    from hfjax import testing
    from hfjax.testing._families import REGISTRY

    kind = REGISTRY[family].kind
    task = "text2text-generation" if kind == "seq2seq" else "text-generation"
    try:
        path = testing.save_tiny_checkpoint(family, work / family, task=task)
    except ValueError:  # an encoder without an LM head class (ModernBERT): its hidden states
        task = "feature-extraction"
        path = testing.save_tiny_checkpoint(family, work / family, task=task)
    base = hfjax.load(path)
    ids = base.tokenizer(TEXT, return_tensors="np")["input_ids"].astype(np.int32)
    inputs = {"input_ids": ids}
    if kind == "seq2seq":
        inputs["decoder_input_ids"] = ids
    reference = _outputs(base, inputs)
    row = {"family": family, "task": task}
    for mode in MODES:
        try:
            model = hfjax.load(path, quantize=mode)
            logits = _outputs(model, inputs)
            row[mode] = {
                "relative_l2": float(np.linalg.norm(logits - reference) / np.linalg.norm(reference)),
                "top1": None
                if task == "feature-extraction"
                else float((logits.argmax(-1) == reference.argmax(-1)).mean()),
                "layers": len(model.quantization.layers),
                "skipped": len(model.quantization.skipped),
            }
        except Exception as error:  # reported in the table
            row[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
        log(f"{family} {mode}: {row[mode]}")
    return row


def _outputs(model, inputs):
    import numpy as np

    out = model(**inputs)
    logits = getattr(out, "logits", None)
    return np.asarray(out.last_hidden_state if logits is None else logits, dtype=np.float64)


def table(rows: list[dict]) -> str:
    import jax
    import transformers

    import hfjax

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    lines = [
        BEGIN,
        "## Quantized weights (`hfjax.load(path, quantize=...)`)",
        "",
        f"Generated {stamp} (UTC) by `python scripts/quantization_accuracy.py`; hfjax {hfjax.__version__}, "
        f"transformers {transformers.__version__}, jax {jax.__version__}, on {jax.default_backend()}.",
        "",
        "Each family's tiny random checkpoint (hidden 64, 2 layers; causal and encoder families with an LM "
        "head, t5 and bart as sequence-to-sequence LMs) run by hfjax unquantized and with `quantize=` on one "
        f"fixed text ({len(TEXT.split())} words); an encoder without an LM head (ModernBERT) is compared on its "
        "last hidden states, without a top-1. Each cell: the relative L2 error of the logits against the "
        "unquantized model's, then the share of positions whose most likely token agrees, then how many "
        "linear layers were quantized. What the numbers mean: these models' weights are random (N(0, 0.02)), "
        "so nothing in them is robust to rounding the way a trained model's features are, and a relative "
        "error of a few percent moves the top token wherever the two best logits of a random model are "
        "close. They compare the modes and families with each other and catch a broken layer (an error "
        "near 1 or above); they do not predict a trained model's loss of accuracy, which is smaller. "
        "int8: one scale per output channel; fp8: e4m3, one scale per output channel; int4: asymmetric, "
        "groups of 128 inputs (64 where a tiny layer has 64). Embeddings, norms and LM heads stay in float32; "
        "mixture-of-experts expert weights (fused 3-D tensors, not linear layers) and routers stay too. "
        '"A/B" in the last column: int4 quantized A of the B layers the other modes did (a layer whose '
        "inputs no group size divides, such as Mamba's dt_proj with 4, stays in float32).",
        "",
        "| family | task | int8 rel. L2 / top-1 | fp8 rel. L2 / top-1 | int4 rel. L2 / top-1 | layers quantized |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = []
        for mode in MODES:
            result = row[mode]
            if "error" in result:
                cells.append(f"error: {result['error']}")
            else:
                top1 = "-" if result["top1"] is None else f"{result['top1']:.0%}"
                cells.append(f"{result['relative_l2']:.3g} / {top1}")
        counts = sorted({row[m].get("layers") for m in MODES if "layers" in row[m]})
        lines.append(f"| {row['family']} | {row['task']} | {' | '.join(cells)} | {'/'.join(map(str, counts)) or '-'} |")
    lines.append(END)
    return "\n".join(lines)


def write(text: str, out: pathlib.Path) -> None:
    """Puts the table into `out` in place of the one there, or at its end."""
    old = out.read_text() if out.is_file() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text + "\n"
    out.write_text(new)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=None, help="comma-separated families (default: hfjax.testing.FAMILIES)")
    parser.add_argument(
        "--out", default=str(_ROOT / "docs" / "coverage.md"), help="file to write the table into; - prints it"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch beside JAX's CPU runtime (set before torch loads)
    from hfjax import testing

    families = args.families.split(",") if args.families else list(testing.FAMILIES)
    with tempfile.TemporaryDirectory(prefix="hfjax-quantization-") as tmp:
        rows = []
        for family in families:
            try:
                rows.append(measure(family, pathlib.Path(tmp)))
            except Exception as error:  # the unquantized model itself: one row saying so
                log(f"{family}: {type(error).__name__}: {error}")
                message = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
                rows.append({"family": family, "task": "-", **{mode: message for mode in MODES}})
    text = table(rows)
    if args.out == "-":
        print(text)
    else:
        write(text, pathlib.Path(args.out))
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
