"""Which engine runs `Model.generate` for each model_type transformers generates text with.

For every causal LM and seq2seq model_type in transformers' auto mappings (or those named), a tiny
checkpoint (`hfjax.testing`) generates 3 greedy tokens for a left-padded batch of two prompts, and one
line is printed (and appended to --out): "model_type kind engine", where engine is `slots` (the slot
core's decode ran), `GENERATOR` (`Generator`'s own loop ran) or `error` with the exception's first
line. docs/architecture.md ("What `Generator`'s own loops still run") lists the last survey.

    python scripts/engine_survey.py --out engines.txt                # ~20 minutes on 2 CPU cores
    python scripts/engine_survey.py llama nemotron_h --kind causal
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch and JAX share this process


def model_types(kind: str | None) -> list[tuple[str, str]]:
    """(kind, model_type) of every causal LM ("causal") and seq2seq LM ("seq2seq") transformers maps."""
    from transformers.models.auto import modeling_auto

    kinds = {
        "causal": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    }
    return [(name, family) for name, names in kinds.items() if kind in (None, name) for family in sorted(names)]


def engine_of(kind: str, family: str) -> str:
    """The engine that ran a greedy `Model.generate` of `family`'s tiny checkpoint, or the error."""
    import hfjax
    from hfjax import testing
    from hfjax.generation import SlotPrograms

    task = "text2text-generation" if kind == "seq2seq" else "text-generation"
    decodes = []
    decode = SlotPrograms.decode

    def counted(self, *args, **kwargs):
        decodes.append(1)
        return decode(self, *args, **kwargs)

    SlotPrograms.decode = counted
    try:
        model = hfjax.load(testing.save_tiny_checkpoint(family, tempfile.mkdtemp(), task=task))
        tokenizer = model.tokenizer
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(["The quick brown fox", "Hi"], padding=True, return_tensors="np")
        model.generate(
            batch["input_ids"],
            batch["attention_mask"],
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            num_beams=1,
        )
    except Exception as error:  # (the survey goes on: a failure is a row of the table)
        first = str(error).splitlines()[0][:150] if str(error) else ""
        return f"error {type(error).__name__}: {first}"
    finally:
        SlotPrograms.decode = decode
    return "slots" if decodes else "GENERATOR"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model_types (default: all of --kind)")
    parser.add_argument("--kind", choices=("causal", "seq2seq"), help="only this kind (default: both)")
    parser.add_argument("--out", help="a file each line is appended to as well")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    known = dict((family, kind) for kind, family in model_types(None))
    if args.families:
        wanted = [(args.kind or known.get(family, "causal"), family) for family in args.families]
    else:
        wanted = model_types(args.kind)
    for kind, family in wanted:
        line = f"{family} {kind} {engine_of(kind, family)}"
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as out:
                print(line, file=out)


if __name__ == "__main__":
    main()
