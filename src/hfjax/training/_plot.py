"""The loss curve as a PNG, drawn by matplotlib (the `train` extra) on a Figure of its own."""

from __future__ import annotations

import pathlib


def loss_curve(history: list[dict], path: str | pathlib.Path) -> pathlib.Path:
    """Writes the training loss (and the eval loss, where measured) against the step to `path`, a
    640x360 PNG; returns the path.

    Example:
      >>> hfjax.training.plot_losses(trainer.history, "loss.png")
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "the loss curve is drawn by matplotlib, part of the train extra: pip install 'hfjax[train]'"
        ) from error
    # A Figure on the Agg canvas, not pyplot: no global figure state, no GUI backend chosen for the process.
    figure = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    axes.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss")
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if evals:
        axes.plot(*zip(*evals), "o-", label="eval loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    figure.tight_layout()
    path = pathlib.Path(path)
    figure.savefig(path, format="png")
    return path
