"""`hfjax finetune`: full or LoRA fine-tuning of a checkpoint on a JSONL or CSV file."""

from __future__ import annotations

import argparse
import pathlib
import sys

from ._options import mesh, model_options, model_path

_PEFT_TASKS = {"text-generation": "CAUSAL_LM", "text-classification": "SEQ_CLS", "text2text-generation": "SEQ_2_SEQ_LM"}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "finetune",
        parents=[model_options()],
        help="fine-tune a checkpoint (full, or LoRA with --lora-r) on a JSONL or CSV file",
        description='Trains with AdamW and transformers\' linear schedule. Records: {"text"} or {"messages"} '
        '(causal LMs; chat: the loss on the assistant\'s turns), {"text", "label"} (classifiers), '
        '{"source", "target"} (seq2seq). OUT gets the trained model (a transformers checkpoint, or a '
        "peft adapter with --lora-r), loss.png, and OUT/checkpoint: the resumable state, replaced "
        "atomically every --save-every steps.",
    )
    parser.add_argument("--data", required=True, help="training data: a .jsonl or .csv file")
    parser.add_argument(
        "--eval-data",
        default=None,
        help="evaluation data (.jsonl or .csv): its mean loss every --eval-every steps (default: none)",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step (default: 8)")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="peak learning rate (default: 5e-5)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps (default: 0)")
    parser.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW's decay, not on biases and norms (default: 0)"
    )
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="clip the gradient's norm to this (default: 1.0; 0: off)"
    )
    parser.add_argument("--max-length", type=int, default=256, help="tokens per example at most (default: 256)")
    parser.add_argument(
        "--lora-r",
        type=int,
        default=None,
        help="train a LoRA adapter of this rank instead of every weight (default: train every weight)",
    )
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA's alpha (default: 2 x rank)")
    parser.add_argument(
        "--lora-targets", default="all-linear", help="comma-separated module names for LoRA (default: all-linear)"
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=None,
        help="write OUT/checkpoint every K steps and at the end (default: at the end only)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate on --eval-data every K steps and at the end (default: at the end only)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from OUT/checkpoint, exactly as if never stopped"
    )
    parser.add_argument("--seed", type=int, default=0, help="data order and LoRA initialisation (default: 0)")
    parser.add_argument(
        "--fully-sharded",
        action="store_true",
        help="also split weights and optimizer state over the --data-parallel devices (needs --data-parallel > 1)",
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="pack several examples into each row of --max-length tokens, each attending only to itself (causal LMs)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import jax

    import hfjax
    from hfjax import training

    args.model = model_path(args)
    out = pathlib.Path(args.out)
    checkpoint = out / "checkpoint"
    for flag, value in [("--steps", args.steps), ("--batch-size", args.batch_size)]:
        if value < 1:
            print(f"hfjax finetune: {flag} {value}; pass a positive number", file=sys.stderr)
            return 2
    if args.resume:  # (a run killed between the checkpoint's two renames left it beside its place)
        training.restored(checkpoint)
    if args.resume and not checkpoint.is_dir():
        print(
            f"hfjax finetune: --resume, but {str(checkpoint)!r} does not exist; run without --resume first",
            file=sys.stderr,
        )
        return 2
    try:
        model = hfjax.load(args.model, dtype=args.dtype, mesh=mesh(args))
        lora = None
        if args.lora_r is not None:
            import peft

            targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
            alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r
            # peft's task type: for a classifier, it also trains the (new) head.
            task_type = _PEFT_TASKS.get(model.task)
            lora = peft.LoraConfig(r=args.lora_r, lora_alpha=alpha, target_modules=targets, task_type=task_type)
        schedule = training.linear_schedule(args.learning_rate, warmup_steps=args.warmup_steps, total_steps=args.steps)
        optimizer = training.adamw(schedule, weight_decay=args.weight_decay, mask=training.decay_mask(model.module))
        trainer = hfjax.Trainer(
            model,
            optimizer,
            lora=lora,
            max_grad_norm=args.max_grad_norm or None,
            seed=args.seed,
            fully_sharded=args.fully_sharded,
        )
        if args.resume:
            step = trainer.resume(checkpoint)
            print(f"resuming from step {step}", file=sys.stderr)
        trainer.fit(
            args.data,
            steps=args.steps,
            batch_size=args.batch_size,
            max_length=args.max_length,
            eval_dataset=args.eval_data,
            eval_every=args.eval_every,
            checkpoint_dir=checkpoint,
            save_every=args.save_every,
            progress=not args.no_progress,
            packing=args.packing,
        )
        trainer.save_pretrained(out, keep=("checkpoint",))
        if jax.process_index() == 0:  # one writer in a multi-process run (hfjax launch)
            training.plot_losses(trainer.history, out / "loss.png")
    except hfjax.HfjaxError as error:
        print(f"hfjax finetune: {error}", file=sys.stderr)
        return 1
    last = trainer.history[-1]
    evaluated = [h["eval_loss"] for h in trainer.history if "eval_loss" in h]
    summary = f"step {last['step']}: loss {last['loss']:.4f}" + (
        f", eval loss {evaluated[-1]:.4f}" if evaluated else ""
    )
    if jax.process_index() == 0:
        print(f"{summary}; wrote {out}", file=sys.stderr)
    return 0
