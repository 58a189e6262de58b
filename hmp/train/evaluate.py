"""Test accuracy and loss of a model, or of every member of an HFTA sweep."""

from __future__ import annotations

from typing import Any

import torch

from hmp.data import whole_batch


def evaluate_sweep(array: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Per-member test accuracy of an HFTA sweep (``member<b>_accuracy``), the best as ``test_accuracy``."""
    accs = array.evaluate(x, y)
    out = {f"member{b}_accuracy": a for b, a in enumerate(accs)}
    out["test_accuracy"] = max(accs)
    out["best_member"] = float(accs.index(max(accs)))
    return out


def evaluate(model: torch.nn.Module, x: Any, y: torch.Tensor, batch: int = 4096) -> dict[str, float]:
    """Test accuracy and mean cross-entropy of ``model`` on ``(x, y)``, ``batch`` rows at a time. ``x``: a
    feature tensor, or :class:`hmp.data.CSRRows` (each slice reaches the model as a ``CSRBatch``)."""
    device = next(model.parameters()).device
    correct, loss, n = 0, 0.0, len(y)
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            out = model(whole_batch(x[i:i + batch]).to(device))
            yy = y[i:i + batch].to(device)
            loss += torch.nn.functional.cross_entropy(out, yy, reduction="sum").item()
            correct += (out.argmax(1) == yy).sum().item()
    model.train()
    return {"test_accuracy": correct / max(1, n), "test_loss": loss / max(1, n)}
