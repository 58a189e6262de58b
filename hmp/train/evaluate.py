"""A model's test metrics under its task (:mod:`hmp.train.task`), or every member's accuracy in an HFTA sweep."""

from __future__ import annotations

from typing import Any

import torch

from hmp.train.task import CLASSIFICATION, Task


def evaluate_sweep(array: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Per-member test accuracy of an HFTA sweep (``member<b>_accuracy``), the best as ``test_accuracy``."""
    accs = array.evaluate(x, y)
    out = {f"member{b}_accuracy": a for b, a in enumerate(accs)}
    out["test_accuracy"] = max(accs)
    out["best_member"] = float(accs.index(max(accs)))
    return out


def evaluate(model: torch.nn.Module, x: Any, y: torch.Tensor, batch: int = 4096, task: Task | None = None
             ) -> dict[str, float]:
    """The test metrics of ``model`` on ``(x, y)`` under ``task`` (default classification: ``test_accuracy`` and
    the mean cross-entropy ``test_loss``), ``batch`` rows at a time (:meth:`hmp.train.task.Task.evaluate`).
    ``x``: a feature tensor, or :class:`hmp.data.CSRRows` (each slice reaches the model as a ``CSRBatch``)."""
    return (task or CLASSIFICATION).evaluate(model, x, y, batch)
