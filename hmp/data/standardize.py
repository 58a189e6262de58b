"""Feature scaling by the training split's statistics (:func:`standardize`), and :func:`scale_advice`, which says
when raw features likely need it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .csr import CSRRows
from .dataset import Dataset


@dataclass(frozen=True, eq=False)
class FeatureStats:
    """Per-feature mean and standard deviation of a training split (each position of a row, for ``[N, ...]`` data)."""

    mean: Tensor
    std: Tensor

    @classmethod
    def of(cls, x: Tensor) -> FeatureStats:
        """The statistics of ``x``'s rows (float64 sums over bounded blocks; a constant feature gets std 1,
        so that it stays as it is rather than being divided by zero)."""
        if isinstance(x, CSRRows):
            raise ValueError("standardize needs dense features; sparse rows cannot be centred without densifying them")
        if not x.is_floating_point():
            raise ValueError(f"standardize needs float features, got {x.dtype} (categorical ids are not scaled)")
        if len(x) == 0:
            raise ValueError("standardize needs training rows to take statistics from")
        total = torch.zeros(x.shape[1:], dtype=torch.float64)
        sq = torch.zeros(x.shape[1:], dtype=torch.float64)
        for start in range(0, len(x), 65536):
            block = x[start:start + 65536].double()
            total += block.sum(0)
            sq += (block * block).sum(0)
        mean = total / len(x)
        std = (sq / len(x) - mean * mean).clamp_min(0).sqrt()
        std[std < 1e-12] = 1.0
        return cls(mean.float(), std.float())

    def apply(self, x: Tensor) -> Tensor:
        """``(x - mean) / std`` in place (``x`` must own its memory)."""
        return x.sub_(self.mean).div_(self.std)


def standardize(ds: Dataset, stats: FeatureStats | None = None) -> Dataset:
    """``ds`` with every feature scaled to mean 0, variance 1 by ``stats`` (default: of ``ds``'s training
    rows only, so that nothing of the test set leaks into training). Train and test are scaled alike, in
    place: the loaded tensors are this function's to change, and a copy would double the data's memory.
    Sparse rows (:class:`CSRRows`) are refused: centring would fill in every zero."""
    if ds.sparse:
        raise ValueError(f"dataset {ds.name!r}: sparse rows cannot be standardized (subtracting the mean makes every "
                         "zero nonzero, i.e. the data dense); scale the values before writing the file")
    stats = stats or FeatureStats.of(ds.x_train)
    stats.apply(ds.x_train)
    stats.apply(ds.x_test)
    return ds


#: Raw features whose spreads differ by more than this factor usually leave a model at the majority class.
SCALE_RATIO_WARN = 1000.0


def scale_advice(ds: Dataset, stats: FeatureStats | None = None) -> str | None:
    """One line suggesting ``[data] standardize = true`` when the features' scales differ wildly (float
    data only; none for sparse rows, which cannot be standardized), else None."""
    if ds.sparse or not ds.x_train.is_floating_point() or len(ds.x_train) < 2:
        return None
    stats = stats or FeatureStats.of(ds.x_train)
    scale = torch.maximum(stats.std, stats.mean.abs()).flatten()
    scale = scale[scale > 1e-6]
    if len(scale) < 2:
        return None
    ratio = float(scale.max() / scale.min())
    if ratio <= SCALE_RATIO_WARN:
        return None
    return (f"dataset {ds.name!r}: the features' scales differ by a factor of {ratio:.3g} (largest "
            f"{float(scale.max()):.3g}, smallest {float(scale.min()):.3g}); raw features like these often keep a "
            "model at the majority class: set [data] standardize = true")
