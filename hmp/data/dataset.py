"""The :class:`Dataset` every loader returns: features ``x`` float32 ``[N, F]`` (or ``[N, ...]``, e.g. images), int64
bucket ids ``[N, fields]`` or :class:`~hmp.data.csr.CSRRows`, labels ``y`` int64 ``[N]`` in ``0..num_classes-1`` (or
float32 targets ``[N]`` / ``[N, k]`` for regression, ``num_classes`` 0); and what the loaders share: the seeded stratified split, the rows a partial load keeps, argument checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .csr import CSRRows

if TYPE_CHECKING:
    from .standardize import FeatureStats


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split. ``label_values[c]`` is the original label of class ``c`` (when remapped). ``y``:
    int64 class labels ``[N]``, or float32 target values ``[N]`` or ``[N, k]`` (regression; ``num_classes`` 0).

    ``x`` has one row per example and any shape per example (``[N, F]`` features, ``[N, C, H, W]``
    images, ...); train and test agree on it. Sparse data (``[data] sparse``) holds :class:`CSRRows`
    in both ``x_train`` and ``x_test`` instead. A partial load (:func:`load_dataset` with ``part`` or
    ``share``) holds rows ``[train_offset, train_offset + len(y_train))`` of a training split of
    ``train_total`` rows (None: all of it), and possibly no test rows. ``stats``: the statistics a
    standardized dataset was scaled by (another part of the same data is scaled alike with them).
    """

    x_train: Tensor | CSRRows
    y_train: Tensor
    x_test: Tensor | CSRRows
    y_test: Tensor
    name: str
    num_classes: int
    label_values: tuple[float, ...] = ()
    train_offset: int = 0
    train_total: int | None = None
    stats: FeatureStats | None = None  # standardized: the training split's statistics it was scaled by

    def __post_init__(self) -> None:
        if isinstance(self.x_train, CSRRows) != isinstance(self.x_test, CSRRows):
            raise ValueError(f"dataset {self.name!r}: x_train is {type(self.x_train).__name__} but x_test is "
                             f"{type(self.x_test).__name__}; expected both CSRRows (sparse) or both tensors")
        for xs, ys, part in ((self.x_train, self.y_train, "train"), (self.x_test, self.y_test, "test")):
            if not _targets_ok(ys):
                raise ValueError(f"dataset {self.name!r} {part}: expected y int64 class labels [N] or float32 target "
                                 f"values [N] or [N, k], got {ys.dtype}{list(ys.shape)}")
            if isinstance(xs, CSRRows):
                if len(xs) != ys.shape[0]:
                    raise ValueError(f"dataset {self.name!r} {part}: expected a target per row for {len(xs)} CSR rows, "
                                     f"got {ys.dtype}{list(ys.shape)}")
                if xs.dtype != torch.float32:
                    raise ValueError(f"dataset {self.name!r} {part}: expected float32 CSR values, got {xs.dtype}")
                continue
            if xs.dim() < 2 or xs.shape[0] != ys.shape[0]:
                raise ValueError(
                    f"dataset {self.name!r} {part}: expected x [N, F] (or [N, ...]) and y [N], got {list(xs.shape)} "
                    f"and {list(ys.shape)}")
            if xs.dtype not in (torch.float32, torch.int64):
                raise ValueError(f"dataset {self.name!r} {part}: expected x float32/int64, got {xs.dtype}")
        if self.y_train.dtype != self.y_test.dtype or self.y_train.shape[1:] != self.y_test.shape[1:]:
            raise ValueError(f"dataset {self.name!r}: train targets are {self.y_train.dtype}{list(self.y_train.shape[1:])}"
                             f" per row, test targets {self.y_test.dtype}{list(self.y_test.shape[1:])}")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(f"dataset {self.name!r}: train rows are {list(self.x_train.shape[1:])}, test rows "
                             f"{list(self.x_test.shape[1:])}")

    @property
    def regression(self) -> bool:
        """Whether ``y`` holds float target values (not class labels)."""
        return self.y_train.is_floating_point()

    @property
    def num_features(self) -> int:
        """Columns of ``x``: features (float) or fields (categorical ids); for ``[N, ...]`` data, values per row."""
        return int(np.prod(self.x_train.shape[1:]))

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """One example's shape: ``(F,)``, or e.g. ``(C, H, W)`` for images."""
        return tuple(self.x_train.shape[1:])

    @property
    def n_train(self) -> int:
        """Rows of the whole training split (a partial load holds only some of them)."""
        return len(self.y_train) if self.train_total is None else self.train_total

    @property
    def sparse(self) -> bool:
        """Whether ``x`` is sparse rows (:class:`CSRRows`; a batch ``x[idx]`` is then a :class:`CSRBatch`)."""
        return isinstance(self.x_train, CSRRows)


def _targets_ok(y: Tensor) -> bool:
    """Class labels int64 ``[N]``, or target values float32 ``[N]`` / ``[N, k]``."""
    return (y.dtype == torch.int64 and y.dim() == 1) or (y.dtype == torch.float32 and y.dim() in (1, 2))


class DataWarning(UserWarning):
    """Data that loads but likely trains badly (e.g. raw features of very different scales)."""


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, stratify: bool = True):
    """Seeded train/test split of numpy arrays, stratified by label where possible."""
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    # Stratify when sklearn can: every class needs 2+ rows and each side a row per class.
    classes, counts = np.unique(y, return_counts=True)
    n_test = int(np.ceil(test_fraction * len(y)))
    possible = len(classes) and counts.min() >= 2 and min(n_test, len(y) - n_test) >= len(classes)
    strat = y if stratify and possible else None
    return train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=strat)


def _dataset(name: str, num_classes: int, xtr, xte, ytr, yte, label_values: tuple = ()) -> Dataset:
    def xt(a: np.ndarray) -> Tensor:
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a.astype(np.int64 if np.issubdtype(a.dtype, np.integer) else np.float32, copy=False))

    def yt(a: np.ndarray) -> Tensor:  # float targets (regression) stay float
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a.astype(np.float32 if np.issubdtype(a.dtype, np.floating) else np.int64, copy=False))

    return Dataset(xt(xtr), yt(ytr), xt(xte), yt(yte), name, int(num_classes), tuple(label_values))


PARTS = ("all", "train", "test")


def _rows_of(train: np.ndarray, test: np.ndarray, part: str, share: tuple[int, int] | None
             ) -> tuple[np.ndarray, np.ndarray, int]:
    """The training and test rows a partial load keeps, and the first kept training row's position in
    ``train``. ``share = (index, count)``: rows ``[n * index // count, n * (index + 1) // count)`` of the
    training split, as a static worker's slice is cut (``hmp.nodes.worker``)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    lo, hi = 0, len(train)
    if share is not None:
        index, count = share
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"share must be (index, count) with 0 <= index < count, got {share!r}")
        lo, hi = len(train) * index // count, len(train) * (index + 1) // count
    keep_train = train[lo:hi] if part != "test" else train[:0]
    keep_test = test if part != "train" else test[:0]
    return keep_train, keep_test, lo if part != "test" else 0


def _check_positive(**values: int) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
