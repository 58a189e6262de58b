"""The model of conf/breast_cancer.toml (``[model] name = "user_model.py:TabularNet"``), and its data.

A model of your own is any ``torch.nn.Module`` a function or class returns; the config names it by an
import path, a file relative to the config (``user_model.py:TabularNet``) or an importable module
(``mypackage.models:build``), and passes ``[model] args`` as keyword arguments (docs/data.md).

``python conf/user_model.py`` writes scikit-learn's bundled breast_cancer data (569 rows, 30 raw
features of very different scales, 2 classes) to ``runs/data/breast_cancer.npz`` and ``.svm``, the files
conf/breast_cancer.toml trains on: nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn


class TabularNet(nn.Module):
    """A one-hidden-layer MLP for tabular features: ``[N, in_features]`` float32 in, ``[N, classes]`` logits out."""

    def __init__(self, in_features: int, classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def write_breast_cancer(folder: str | Path) -> list[Path]:
    """scikit-learn's breast_cancer as ``folder/breast_cancer.npz`` (arrays x, y) and ``.svm`` (svmlight)."""
    import numpy as np
    from sklearn.datasets import dump_svmlight_file, load_breast_cancer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d = load_breast_cancer()
    np.savez(folder / "breast_cancer.npz", x=d.data.astype(np.float32), y=d.target)
    dump_svmlight_file(d.data, d.target, str(folder / "breast_cancer.svm"), zero_based=False)
    return [folder / "breast_cancer.npz", folder / "breast_cancer.svm"]


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "runs" / "data"
    for path in write_breast_cancer(out):
        print(path)
