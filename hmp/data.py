"""Datasets for training runs and benchmarks: bundled, synthetic or read from local files.

Nothing here downloads anything. Sources:

* ``digits``  scikit-learn's bundled 8x8 digits (1797 images, 10 classes).
* ``click``   synthetic click-through data with hashed categorical ids (``generate_click_data``).
* ``sparse``  synthetic sparse high-dimensional classification (``generate_sparse_classification``).
* ``synthetic`` synthetic dense classification from a hidden nonlinear teacher (``generate_dense_classification``).
* ``svmlight`` a local LIBSVM/svmlight text file (``load_svmlight``): dense, or (``sparse=True``) CSR rows.
* ``npz``     a local ``.npz`` with arrays ``x``, ``y`` and optionally ``x_test``, ``y_test`` (``load_npz``).

Every loader returns a :class:`Dataset`; :func:`load_dataset` picks one from a spec (or calls a user's
loader), optionally only a part of it (a worker's share of the training rows, or only the test set).
The file loaders refuse bad data with the file and the line (svmlight) or array (npz) in the message:
empty files, unparsable lines, missing arrays, x/y length mismatches, NaN or infinite features.
:func:`standardize` scales features by training-split statistics; :func:`scale_advice` says when raw
features likely need it. docs/data.md is the user's guide.
Workers take their part of the training set with :func:`shard`. Every shuffled example order
in hmp (a worker's batches, a Hogbatch work unit, a pipeline micro-batch, a Hogwild thread's
batches) comes from :class:`ShuffledBatches`: deterministic from a seed and the epoch, with a
batch size that may change between batches (the scheduler resizes batches while training runs).

Tensor conventions: features ``x`` are float32 ``[N, F]`` (or ``[N, ...]``, e.g. images ``[N, C, H, W]``)
or, for categorical data, int64 bucket ids ``[N, fields]``; labels ``y`` are int64 ``[N]`` in
``0..num_classes-1``. Sparse features are :class:`CSRRows` (never densified), whose batch ``x[idx]`` is a
:class:`CSRBatch` in the ``nn.EmbeddingBag`` convention (``indices``, ``offsets``, ``values``): what a
sparse-input model's ``forward`` takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class CSRBatch:
    """A batch of sparse rows as a sparse-input model receives it (``x[idx]`` of :class:`CSRRows`).

    The ``nn.EmbeddingBag`` convention: row ``b``'s features are ``indices[offsets[b]:offsets[b + 1]]``
    (the last row's run to the end) with weights ``values`` at the same positions, so that
    ``bag(batch.indices, batch.offsets, per_sample_weights=batch.values)`` with ``mode="sum"`` is the
    batch times the bag's weight. ``indices`` int64 ``[nnz]`` in ``[0, num_features)``, increasing within
    a row; ``offsets`` int64 ``[B]``; ``values`` float32 ``[nnz]``.
    """

    indices: Tensor
    offsets: Tensor
    values: Tensor
    num_features: int

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def shape(self) -> torch.Size:
        """``(B, num_features)``: the batch's shape as a dense matrix (for messages)."""
        return torch.Size((len(self.offsets), self.num_features))

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype (for messages)."""
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def to(self, device: str | torch.device, non_blocking: bool = False) -> CSRBatch:
        """The batch on ``device`` (tensors already there are not copied)."""
        return CSRBatch(self.indices.to(device, non_blocking=non_blocking),
                        self.offsets.to(device, non_blocking=non_blocking),
                        self.values.to(device, non_blocking=non_blocking), self.num_features)

    def to_dense(self) -> Tensor:
        """The batch as a dense float ``[B, num_features]`` matrix (tests and small checks; not the data path)."""
        lengths = torch.diff(self.offsets, append=self.offsets.new_tensor([len(self.indices)]))
        rows = torch.repeat_interleave(torch.arange(len(self.offsets), device=self.indices.device), lengths)
        out = torch.zeros(len(self.offsets), self.num_features, dtype=self.values.dtype, device=self.values.device)
        out[rows, self.indices] = self.values
        return out


class CSRRows:
    """Rows of a sparse matrix in CSR form: what ``Dataset.x_train`` / ``x_test`` hold for ``[data] sparse``.

    ``indptr`` int64 ``[M + 1]`` (from 0; row ``i`` of the matrix is ``indptr[i]:indptr[i + 1]`` of the
    others), ``indices`` int64 ``[nnz]`` (column numbers in ``[0, num_features)``, increasing within a
    row), ``values`` float32 ``[nnz]``. ``rows`` (int64 ``[N]``, optional): these rows are those rows of
    the matrix, in that order (a train or test split sharing the file's arrays: no copy); None: all
    ``M`` rows in order (compact). It answers what hmp asks of a feature tensor ``x``: ``len``, ``shape``
    ``(N, num_features)``, ``x[idx]`` with an int64 index tensor (a batch: a :class:`CSRBatch`, gathered
    without a per-row loop), ``x[a:b]`` (rows ``a..b-1`` as CSRRows, sharing the arrays), ``.to(device)``
    and ``.clone()`` (a compact copy). Nothing here densifies the rows except :meth:`to_dense`.
    """

    __slots__ = ("indptr", "indices", "values", "num_features", "rows")

    def __init__(self, indptr: Tensor, indices: Tensor, values: Tensor, num_features: int,
                 rows: Tensor | None = None) -> None:
        if indptr.dtype != torch.int64 or indices.dtype != torch.int64 or not values.is_floating_point():
            raise ValueError(f"CSRRows: expected int64 indptr and indices and float values, got {indptr.dtype}, "
                             f"{indices.dtype}, {values.dtype}")
        if indptr.dim() != 1 or len(indptr) < 1 or indices.dim() != 1 or values.shape != indices.shape:
            raise ValueError(f"CSRRows: expected indptr [M+1], indices [nnz] and values [nnz], got "
                             f"{list(indptr.shape)}, {list(indices.shape)}, {list(values.shape)}")
        if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1):
            raise ValueError(f"CSRRows: expected int64 rows [N], got {rows.dtype}{list(rows.shape)}")
        if not isinstance(num_features, (int, np.integer)) or num_features < 0:
            raise ValueError(f"CSRRows: num_features must be an int >= 0, got {num_features!r}")
        self.indptr, self.indices, self.values, self.num_features = indptr, indices, values, int(num_features)
        self.rows = rows

    @classmethod
    def from_scipy(cls, matrix: Any, rows: np.ndarray | Tensor | None = None) -> CSRRows:
        """A scipy CSR matrix's rows (``rows``: only those, in that order). ``values`` and (where scipy
        holds them as int64) ``indices`` share the matrix's arrays: no copy of the nonzeros."""
        import scipy.sparse as sp

        if not sp.issparse(matrix) or matrix.format != "csr":
            raise ValueError(f"CSRRows.from_scipy: expected a scipy CSR matrix, got {type(matrix).__name__}")
        if not matrix.has_canonical_format:
            matrix = matrix.copy()
            matrix.sum_duplicates()  # sorts the indices too
        if rows is not None:
            rows = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        return cls(torch.from_numpy(np.asarray(matrix.indptr, dtype=np.int64)),
                   torch.from_numpy(np.asarray(matrix.indices, dtype=np.int64)),
                   torch.from_numpy(np.asarray(matrix.data, dtype=np.float32)), matrix.shape[1], rows)

    @classmethod
    def from_dense(cls, x: Tensor) -> CSRRows:
        """The nonzeros of a dense float ``[N, F]`` matrix (tests and small data)."""
        if x.dim() != 2:
            raise ValueError(f"CSRRows.from_dense: expected [N, F], got {list(x.shape)}")
        rows, cols = torch.nonzero(x, as_tuple=True)
        indptr = torch.zeros(len(x) + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=len(x)), 0)
        return cls(indptr, cols.to(torch.int64), x[rows, cols].to(torch.float32), x.shape[1])

    def __len__(self) -> int:
        return len(self.indptr) - 1 if self.rows is None else len(self.rows)

    def __repr__(self) -> str:
        return f"CSRRows({len(self)} x {self.num_features}, nnz={self.nnz}, {self.values.dtype}, {self.device})"

    @property
    def shape(self) -> torch.Size:
        """``(N, num_features)``: the rows' shape as a dense matrix."""
        return torch.Size((len(self), self.num_features))

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype."""
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def compact(self) -> bool:
        """Whether the arrays hold exactly these rows, in order (no ``rows``)."""
        return self.rows is None

    @property
    def nnz(self) -> int:
        """Stored values (nonzeros) in these rows."""
        if self.rows is None:
            return int(self.indptr[-1] - self.indptr[0])
        return int((self.indptr[self.rows + 1] - self.indptr[self.rows]).sum())

    @property
    def nbytes(self) -> int:
        """Memory the arrays hold (all of them: a split shares its file's arrays with the other split)."""
        held = (self.indptr, self.indices, self.values) + (() if self.rows is None else (self.rows,))
        return sum(t.numel() * t.element_size() for t in held)

    def dim(self) -> int:
        return 2

    def __getitem__(self, key: Any) -> CSRRows | CSRBatch:
        """``x[a:b]``: those rows as CSRRows (sharing the arrays); ``x[idx]`` (a 1-D int64 tensor, or anything
        ``torch.as_tensor`` makes one of): those rows, in that order, as a CSRBatch."""
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError(f"CSRRows: slices must be contiguous (step 1), got step {step}")
            stop = max(start, stop)
            if self.rows is not None:
                return CSRRows(self.indptr, self.indices, self.values, self.num_features, self.rows[start:stop])
            base = self.indptr[start]
            lo, hi = int(base), int(self.indptr[stop])
            return CSRRows(self.indptr[start:stop + 1] - base, self.indices[lo:hi], self.values[lo:hi],
                           self.num_features)
        offsets, positions = self._gather(key)
        return CSRBatch(self.indices[positions], offsets, self.values[positions], self.num_features)

    def take(self, rows: Any) -> CSRRows:
        """Rows ``rows`` (in that order) as new compact CSRRows: a copy of their indices and values."""
        offsets, positions = self._gather(rows)
        indptr = torch.cat([offsets, offsets.new_tensor([len(positions)])])
        return CSRRows(indptr, self.indices[positions], self.values[positions], self.num_features)

    def _gather(self, rows: Any) -> tuple[Tensor, Tensor]:
        """For rows ``rows``: each one's start in the gathered arrays (``offsets``), and the positions in
        ``indices``/``values`` to gather, vectorised: every row's run ``indptr[r]..indptr[r + 1]`` is the
        arange of the batch's nonzeros shifted by (its start there - its start here)."""
        idx = rows if isinstance(rows, Tensor) else torch.as_tensor(np.asarray(rows))
        if idx.dim() != 1 or (idx.dtype not in (torch.int64, torch.int32) and idx.numel()):
            raise IndexError(f"CSRRows: index rows with a slice or a 1-D integer tensor, got "
                             f"{idx.dtype}{list(idx.shape)}")
        idx = idx.to(device=self.indptr.device, dtype=torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"CSRRows: row index out of range [0, {len(self)}): {int(idx.min())}..{int(idx.max())}")
        if self.rows is not None:
            idx = self.rows[idx]
        starts = self.indptr[idx]
        lengths = self.indptr[idx + 1] - starts
        ends = torch.cumsum(lengths, 0)
        offsets = ends - lengths
        total = int(ends[-1]) if len(ends) else 0
        shift = torch.repeat_interleave(starts - offsets, lengths, output_size=total)
        return offsets, shift + torch.arange(total, device=idx.device)

    def as_batch(self) -> CSRBatch:
        """All the rows as one CSRBatch: views when compact, else gathered (e.g. a slice of the test set for
        evaluation)."""
        if self.rows is not None:
            return self[torch.arange(len(self), device=self.indptr.device)]
        return CSRBatch(self.indices, self.indptr[:-1] - self.indptr[0], self.values, self.num_features)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> CSRRows:
        """The rows on ``device``."""
        return CSRRows(self.indptr.to(device, non_blocking=non_blocking),
                       self.indices.to(device, non_blocking=non_blocking),
                       self.values.to(device, non_blocking=non_blocking), self.num_features,
                       None if self.rows is None else self.rows.to(device, non_blocking=non_blocking))

    def clone(self) -> CSRRows:
        """A compact copy that owns its memory (a slice's clone no longer holds the whole set alive)."""
        if self.rows is not None:
            return self.take(torch.arange(len(self), device=self.indptr.device))
        return CSRRows(self.indptr.clone(), self.indices.clone(), self.values.clone(), self.num_features)

    def to_dense(self) -> Tensor:
        """The rows as a dense float ``[N, num_features]`` matrix (tests and small checks; not the data path)."""
        return self.as_batch().to_dense()

    def fault(self) -> str | None:
        """Why these arrays are not CSR rows (None: they are): indptr from 0 to nnz, never decreasing; columns
        in ``[0, num_features)``, increasing within each row; finite values; ``rows`` in range. Linear in nnz."""
        p, nnz = self.indptr, len(self.values)
        if int(p[0]) != 0 or int(p[-1]) != nnz:
            return f"indptr runs from {int(p[0])} to {int(p[-1])}; expected 0 to nnz={nnz}"
        if len(p) > 1 and bool((p[1:] < p[:-1]).any()):
            return "indptr decreases"
        rows = self.rows
        if rows is not None and len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(p) - 1):
            return f"rows span {int(self.rows.min())}..{int(self.rows.max())}; expected [0, {len(p) - 1})"
        if nnz:
            if int(self.indices.min()) < 0 or int(self.indices.max()) >= self.num_features:
                return (f"column indices span {int(self.indices.min())}..{int(self.indices.max())}; expected "
                        f"[0, {self.num_features})")
            step = self.indices[1:] - self.indices[:-1]
            row_start = torch.zeros(nnz, dtype=torch.bool, device=step.device)
            row_start[p[:-1][p[:-1] < nnz]] = True
            if bool(((step <= 0) & ~row_start[1:]).any()):
                return "column indices do not increase within a row"
            if not bool(torch.isfinite(self.values).all()):
                return "values hold NaN or infinity"
        return None


def is_sparse(x: Any) -> bool:
    """Whether ``x`` (a dataset's features, or a batch of them) is sparse rows (:class:`CSRRows`, :class:`CSRBatch`)."""
    return isinstance(x, (CSRRows, CSRBatch))


def take_rows(x: Tensor | CSRRows, rows: Tensor) -> Tensor | CSRRows:
    """Rows ``rows`` of ``x`` as the same kind of thing (``x[rows]`` for a tensor; CSRRows for CSR rows, whose
    ``x[rows]`` is a model's batch instead): for a part of the data that is batched again (a Hogwild unit)."""
    return x.take(rows) if isinstance(x, CSRRows) else x[rows]


def whole_batch(x: Tensor | CSRRows) -> Tensor | CSRBatch:
    """``x`` as a model takes it: a dense tensor as it is, CSR rows as one :class:`CSRBatch` (views, no copy).
    For code that hands a model a slice ``x[a:b]`` of a dataset's features (evaluation, warm-up passes)."""
    return x.as_batch() if isinstance(x, CSRRows) else x


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split. ``label_values[c]`` is the original label of class ``c`` (when remapped).

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
            if isinstance(xs, CSRRows):
                if ys.dim() != 1 or len(xs) != ys.shape[0] or ys.dtype != torch.int64:
                    raise ValueError(f"dataset {self.name!r} {part}: expected int64 y [N] for {len(xs)} CSR rows, got "
                                     f"{ys.dtype}{list(ys.shape)}")
                if xs.dtype != torch.float32:
                    raise ValueError(f"dataset {self.name!r} {part}: expected float32 CSR values, got {xs.dtype}")
                continue
            if xs.dim() < 2 or ys.dim() != 1 or xs.shape[0] != ys.shape[0]:
                raise ValueError(
                    f"dataset {self.name!r} {part}: expected x [N, F] (or [N, ...]) and y [N], got {list(xs.shape)} "
                    f"and {list(ys.shape)}")
            if xs.dtype not in (torch.float32, torch.int64) or ys.dtype != torch.int64:
                raise ValueError(f"dataset {self.name!r} {part}: expected x float32/int64 and y int64, got {xs.dtype}, {ys.dtype}")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(f"dataset {self.name!r}: train rows are {list(self.x_train.shape[1:])}, test rows "
                             f"{list(self.x_test.shape[1:])}")

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


class LoaderArgumentsError(ValueError):
    """A loader's keyword arguments (a spec's options) that its signature refuses."""


class NotADataset(TypeError):
    """A loader returned something else than a :class:`Dataset`."""


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

    def yt(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).astype(np.int64, copy=False))

    return Dataset(xt(xtr), yt(ytr), xt(xte), yt(yte), name, int(num_classes), tuple(label_values))


# ---------------------------------------------------------------------------- digits


def load_digits_dataset(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled digits: x float32 ``[N, 64]`` in [0, 1] (pixel / 16), 10 classes.

    Stratified split, seeded: 1437 train / 360 test rows at the default fraction.
    """
    cached = _digits_cache(test_fraction, seed)
    if cached is not None:
        try:
            with np.load(cached) as z:
                return _dataset("digits", 10, z["xtr"], z["xte"], z["ytr"], z["yte"])
        except (OSError, ValueError, KeyError):
            pass  # missing or torn: build it again
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = _split(x, d.target.astype(np.int64), test_fraction, seed)
    if cached is not None:
        _write_cache(cached, xtr=xtr, xte=xte, ytr=ytr, yte=yte)
    return _dataset("digits", 10, xtr, xte, ytr, yte)


def _digits_cache(test_fraction: float, seed: int) -> Path | None:
    """Where the digits split is cached: importing scikit-learn's datasets and splitter costs every
    daemon ~1.5 s of CPU at start, the cached arrays a millisecond. Keyed by scikit-learn's version
    and the split's arguments, so a different split is never read back. ``HMP_CACHE_DIR`` moves it
    (default ``$XDG_CACHE_HOME/hmp`` or ``~/.cache/hmp``); ``HMP_CACHE_DIR=off`` turns it off."""
    import importlib.metadata
    import os

    root = os.environ.get("HMP_CACHE_DIR") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hmp")
    if root == "off":
        return None
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(root) / f"digits-sklearn{version}-test{test_fraction!r}-seed{seed}.npz"


def _write_cache(path: Path, **arrays: np.ndarray) -> None:
    """Write ``arrays`` to ``path`` atomically (a unique temporary file, then rename); best effort."""
    import os
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        pass  # a read-only home: no cache, nothing lost


# ---------------------------------------------------------------------------- click


def generate_click_data(
    n: int,
    fields: int = 8,
    buckets: int = 1000,
    seed: int = 0,
    *,
    test_fraction: float = 0.2,
    popularity: float = 1.2,
    latent_dim: int = 4,
    interaction: float = 0.5,
    sharpness: float = 4.0,
    positive_rate: float = 0.5,
) -> Dataset:
    """Synthetic click-through data: x int64 ids ``[n, fields]`` in ``[0, buckets)``, y 0/1.

    Each field's bucket is drawn from a Zipf-like popularity law (``P(rank r) ~ r^-popularity``,
    a different random bucket order per field), as hashed categorical features are in
    real logs. The label comes from a hidden model over the hashed ids::

        z = std(sum_f w[f, id_f]) + interaction * std(sum_{f<g} <v[f, id_f], v[g, id_g]>)
        P(click) = sigmoid(sharpness * (std(z) - shift))

    with ``w ~ N(0, 1)``, ``v ~ N(0, 1/latent_dim)`` per (field, bucket), ``std`` meaning
    standardised over the sample, and ``shift`` chosen so that about ``positive_rate`` of
    the rows are clicks. Clicks are sampled, so even the hidden model is not always right.

    Measured (n=50000, defaults, ``hmp.models.click_model()`` with Adam lr 3e-3, batch 256,
    one thread): test accuracy 0.78 and AUC 0.86 after 1-2 epochs against a majority
    baseline of 0.50; the hidden model itself (Bayes) reaches accuracy 0.87, AUC 0.95.
    SGD (lr 0.1, momentum 0.9) reaches the same after ~5 epochs; at n=20000 the model
    peaks at ~0.75 / 0.84 and then overfits (rare buckets).
    """
    _check_positive(n=n, fields=fields, buckets=buckets, latent_dim=latent_dim)
    if not 0.0 < positive_rate < 1.0:
        raise ValueError(f"positive_rate must be in (0, 1), got {positive_rate!r}")
    rng = np.random.default_rng(seed)
    pop = np.arange(1, buckets + 1, dtype=np.float64) ** -popularity
    pop /= pop.sum()
    order = np.stack([rng.permutation(buckets) for _ in range(fields)])  # rank -> bucket, per field
    w = rng.normal(size=(fields, buckets))
    v = rng.normal(size=(fields, buckets, latent_dim)) / np.sqrt(latent_dim)
    rows = np.arange(fields)
    ids = order[rows, rng.choice(buckets, size=(n, fields), p=pop)]
    linear = w[rows, ids].sum(axis=1)
    emb = v[rows, ids]  # [n, fields, latent_dim]
    s = emb.sum(axis=1)
    pairwise = 0.5 * ((s * s).sum(axis=1) - (emb * emb).sum(axis=(1, 2)))  # sum over f<g of <v_f, v_g>
    z = _standardise(_standardise(linear) + interaction * _standardise(pairwise))
    shift = np.quantile(z, 1.0 - positive_rate)
    p = 1.0 / (1.0 + np.exp(-sharpness * (z - shift)))
    y = (rng.random(n) < p).astype(np.int64)
    xtr, xte, ytr, yte = _split(ids.astype(np.int64), y, test_fraction, seed)
    return _dataset(f"click-{fields}x{buckets}", 2, xtr, xte, ytr, yte)


def _standardise(a: np.ndarray) -> np.ndarray:
    sd = a.std()
    return (a - a.mean()) / (sd if sd > 0 else 1.0)


# ---------------------------------------------------------------------------- sparse


def generate_sparse_classification(
    n: int,
    n_features: int,
    density: float,
    seed: int = 0,
    *,
    num_classes: int = 2,
    test_fraction: float = 0.2,
    label_noise: float = 0.0,
) -> Dataset:
    """Sparse, high-dimensional data, learnable by a linear model: x float32 ``[n, n_features]``.

    Each row has ``max(1, round(density * n_features))`` non-zeros at features drawn from
    a power law (a few common features, a long tail, as with bag-of-words), values in
    [0.5, 1.5), rows scaled to unit L2 norm. The label is the argmax over ``num_classes``
    hidden linear scores ``x @ W`` (``W ~ N(0, 1)`` times (feature frequency / top
    frequency)^0.25, so common features carry more of the signal; class scores centred so
    classes are about balanced); ``label_noise`` of the labels are then replaced by random
    classes. Stored dense (the Hogbatch benchmark wants dense rows): ``4 * n * n_features``
    bytes.

    Measured (binary, no label noise; scikit-learn LogisticRegression C=10, 80/20 split):
    test accuracy 0.90 at n=4000, n_features=1000, density=0.02; 0.83 at 4000 x 5000,
    0.005; 0.85 at 10000 x 20000, 0.002 (generation ~8 s); majority baseline ~0.50.
    """
    _check_positive(n=n, n_features=n_features, num_classes=num_classes)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"label_noise must be in [0, 1], got {label_noise!r}")
    rng = np.random.default_rng(seed)
    nnz = max(1, round(density * n_features))
    freq = 1.0 / np.arange(1, n_features + 1) ** 0.8  # power law over a shuffled feature order
    freq = freq[rng.permutation(n_features)]
    freq /= freq.sum()
    x = np.zeros((n, n_features), dtype=np.float32)
    # Sampling each row's columns without replacement keeps nnz exact; the Gumbel top-k
    # trick does a block of rows at once (blocks bound the float64 temporaries to ~32 MiB).
    logf = np.log(freq)
    block = max(1, (1 << 22) // n_features)
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        keys = logf[None, :] - np.log(-np.log(rng.random((hi - lo, n_features))))
        cols = np.argpartition(-keys, nnz - 1, axis=1)[:, :nnz]
        x[np.arange(lo, hi)[:, None], cols] = rng.uniform(0.5, 1.5, size=(hi - lo, nnz))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    scores = x @ (rng.normal(size=(n_features, num_classes)) * (freq / freq.max())[:, None] ** 0.25).astype(np.float32)
    scores -= np.median(scores, axis=0)  # about balanced classes
    y = scores.argmax(axis=1).astype(np.int64)
    flip = rng.random(n) < label_noise
    y[flip] = rng.integers(0, num_classes, size=int(flip.sum()))
    xtr, xte, ytr, yte = _split(x, y, test_fraction, seed)
    return _dataset(f"sparse-{n_features}", num_classes, xtr, xte, ytr, yte)


# ---------------------------------------------------------------------------- synthetic (dense)


def generate_dense_classification(
    n: int = 20000,
    n_features: int = 1024,
    num_classes: int = 10,
    seed: int = 0,
    *,
    latent_dim: int = 16,
    hidden: int = 64,
    noise: float = 1.0,
    label_noise: float = 0.0,
    test_fraction: float = 0.2,
) -> Dataset:
    """Dense synthetic classification with a learnable nonlinear structure: x float32 ``[n, n_features]``.

    Each row comes from a hidden ``latent_dim``-dimensional point ``z ~ N(0, I)``::

        x = z @ A + noise * e              A ~ N(0, 1/latent_dim) [latent_dim, n_features], e ~ N(0, I)
        y = argmax(tanh(z @ W1) @ W2 - c)  W1 ~ N(0, 1/latent_dim) [latent_dim, hidden], W2 ~ N(0, 1)

    a random one-hidden-layer teacher on the latent point, ``c`` per-class offsets that make the
    classes about balanced; ``label_noise`` of the labels are then replaced by random classes.
    Every feature has variance about ``1 + noise**2``; the labels are a nonlinear function of a
    low-dimensional projection of ``x``. Rows are independent draws, so the last
    ``ceil(test_fraction * n)`` are the test set (no shuffle, no copy).

    Deterministic from ``seed`` (numpy's PCG64). Generation takes about 0.5 s at the default
    20000 x 1024 (one core); memory ``4 * n * n_features`` bytes.

    Measured (defaults, 10 classes, majority baseline 0.10): scikit-learn LogisticRegression on
    8000 rows reaches test accuracy 0.67; at n=10000, test_fraction=0.1, ``deep_mlp(1024, 2048,
    4, 10)`` after one epoch (SGD lr 0.03, momentum 0.9, 2 x batch 64, ``bench/train.py``) 0.72,
    test loss 0.79 (from 2.30).
    """
    _check_positive(n=n, n_features=n_features, num_classes=num_classes, latent_dim=latent_dim, hidden=hidden)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if not (isinstance(noise, (int, float)) and not isinstance(noise, bool) and 0.0 <= noise < float("inf")):
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    if not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"label_noise must be in [0, 1], got {label_noise!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    n_test = int(np.ceil(test_fraction * n))
    if n_test >= n:
        raise ValueError(f"test_fraction={test_fraction!r} of n={n} rows leaves no training rows")
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, latent_dim), dtype=np.float32)
    a = rng.standard_normal((latent_dim, n_features), dtype=np.float32) / np.float32(np.sqrt(latent_dim))
    w1 = rng.standard_normal((latent_dim, hidden), dtype=np.float32) / np.float32(np.sqrt(latent_dim))
    w2 = rng.standard_normal((hidden, num_classes), dtype=np.float32)
    x = rng.standard_normal((n, n_features), dtype=np.float32)
    x *= np.float32(noise)
    x += z @ a
    scores = np.tanh(z @ w1) @ w2
    scores -= np.median(scores, axis=0)
    step = 0.5 * float(scores.std())
    for _ in range(30):  # nudge the class offsets towards balanced classes
        share = np.bincount(scores.argmax(axis=1), minlength=num_classes) / n
        scores -= step * (share * num_classes - 1.0)
        step *= 0.85
    y = scores.argmax(axis=1).astype(np.int64)
    flip = rng.random(n) < label_noise
    y[flip] = rng.integers(0, num_classes, size=int(flip.sum()))
    return _dataset(f"synthetic-{n_features}", num_classes, x[:-n_test], x[-n_test:], y[:-n_test], y[-n_test:])


# ---------------------------------------------------------------------------- files


SVMLIGHT_LINE = "'LABEL INDEX:VALUE INDEX:VALUE ...' (indices increasing, an optional '# comment')"


def _svmlight_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, content)`` of each line that holds an example (comments and blank lines skipped,
    as scikit-learn's parser does): the i-th one is row i of the matrix."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            content = raw.split(b"#", 1)[0].strip()
            if content:
                yield number, content


def _svmlight_line_fault(content: bytes) -> str | None:
    """Why one line is not svmlight data (None: it is)."""
    tokens = content.split()
    try:
        label = float(tokens[0])
    except ValueError:
        return f"the label {tokens[0].decode(errors='replace')!r} is not a number"
    if not math.isfinite(label):
        return f"the label is {tokens[0].decode()}"
    last = -1
    for tok in tokens[1:]:
        index, sep, value = tok.partition(b":")
        if not sep:
            return f"{tok.decode(errors='replace')!r} is not INDEX:VALUE"
        if index == b"qid":
            continue
        try:
            i, v = int(index), float(value)
        except ValueError:
            return f"{tok.decode(errors='replace')!r} is not INDEX:VALUE with an integer index and a number"
        if i < 0 or i <= last:
            return f"feature index {i} {'is negative' if i < 0 else f'follows {last}'}; indices must increase"
        if not math.isfinite(v):
            return f"feature {i} is {value.decode()} (NaN and infinity cannot be trained on)"
        last = i
    return None


def _svmlight_fault(path: str | Path, row: int | None = None) -> str:
    """Where and why ``path`` is not svmlight data: the first bad line, or (``row``) the line of that row."""
    for i, (number, content) in enumerate(_svmlight_lines(path)):
        why = _svmlight_line_fault(content)
        if why is not None or i == row:
            shown = content[:60].decode(errors="replace") + ("..." if len(content) > 60 else "")
            return f"{path} line {number}: {why or 'refused'}; expected {SVMLIGHT_LINE}, got {shown!r}"
    return f"{path}: not valid svmlight/LIBSVM data; expected {SVMLIGHT_LINE} on every line"


def _read_svmlight(paths: list[str | Path], n_features: int | None) -> list:
    """Read svmlight files together (one index base and feature count for all): ``[x0, y0, x1, y1, ...]``.

    An empty file, a line that does not parse and a NaN or infinite value are errors naming the file
    and the line number.
    """
    from sklearn.datasets import load_svmlight_files

    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"{p}: no such svmlight file")
        if Path(p).stat().st_size == 0:
            raise ValueError(f"{p}: empty file (0 bytes); expected svmlight lines {SVMLIGHT_LINE}")
    try:
        out = load_svmlight_files([str(p) for p in paths], n_features=n_features, dtype=np.float32)
    except ValueError as exc:
        # scikit-learn's parser does not say where: find the first line it would refuse ourselves.
        for p in paths:
            fault = _svmlight_fault(p)
            if " line " in fault:
                raise ValueError(fault) from None
        raise ValueError(f"{', '.join(map(str, paths))}: not valid svmlight/LIBSVM data: {exc}") from None
    for p, x, y in zip(paths, out[0::2], out[1::2]):
        if x.shape[0] == 0:
            raise ValueError(f"{p}: no examples (only blank or comment lines); expected svmlight lines {SVMLIGHT_LINE}")
        if not np.isfinite(x.data).all() or not np.isfinite(y).all():
            bad_x = np.flatnonzero(~np.isfinite(x.data))
            row = int(np.searchsorted(x.indptr, bad_x[0], side="right") - 1) if len(bad_x) else \
                int(np.flatnonzero(~np.isfinite(y))[0])
            raise ValueError(_svmlight_fault(p, row))
    return out


def _label_classes(path: str | Path, *ys: np.ndarray) -> tuple[list[np.ndarray], tuple[float, ...]]:
    """Map the labels of ``ys`` jointly to 0..C-1 by sorted value; return them and the values."""
    allv = np.concatenate([np.asarray(a, dtype=np.float64) for a in ys])
    if not np.all(np.isfinite(allv)) or not np.all(allv == np.round(allv)):
        raise ValueError(f"{path}: labels must be integer class labels (e.g. -1/+1 or 0..C-1); found non-integer values")
    values = np.unique(allv)
    mapped = [np.searchsorted(values, np.asarray(a, dtype=np.float64)).astype(np.int64) for a in ys]
    return mapped, tuple(int(v) for v in values)


@dataclass(frozen=True, eq=False)
class _SvmlightIndex:
    """Where a file's examples are, from a pass that reads every line but parses only its label and its first and
    last feature index (indices increase within a line): byte ``offsets`` and ``lengths``, line ``numbers``,
    ``labels``, and the file's lowest and highest feature index."""

    offsets: np.ndarray
    lengths: np.ndarray
    numbers: np.ndarray
    labels: np.ndarray
    lowest: int
    highest: int


def _svmlight_index(path: str | Path) -> _SvmlightIndex | None:
    """The examples of an svmlight file (see :class:`_SvmlightIndex`); None for anything the quick pass does not
    read with certainty (a malformed line, multi-label targets, no feature at all): the caller then parses the
    file whole, which finds and names the fault."""
    import array

    # array.array, not lists: 8 bytes an entry rather than a Python object each.
    offsets, lengths, numbers, labels = array.array("q"), array.array("q"), array.array("q"), array.array("d")
    lowest, highest, pos = None, -1, 0
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                content = raw.split(b"#", 1)[0]
                head = content.split(None, 2)
                if head:
                    label = float(head[0])
                    first = head[1] if len(head) > 1 and not head[1].startswith(b"qid:") else (
                        head[2].split(None, 1)[0] if len(head) > 2 else None)
                    if first is not None:  # else a row without features
                        low, high = int(first.split(b":", 1)[0]), int(content.rsplit(None, 1)[-1].split(b":", 1)[0])
                        lowest = low if lowest is None else min(lowest, low)
                        highest = max(highest, high)
                    offsets.append(pos)
                    lengths.append(len(raw))
                    numbers.append(number)
                    labels.append(label)
                pos += len(raw)
    except (ValueError, IndexError, OSError):
        return None
    if not offsets or lowest is None or lowest < 0:
        return None
    return _SvmlightIndex(np.frombuffer(offsets, dtype=np.int64), np.frombuffer(lengths, dtype=np.int64),
                          np.frombuffer(numbers, dtype=np.int64), np.frombuffer(labels, dtype=np.float64), lowest,
                          highest)


#: A part of an svmlight file is parsed in pieces of about this many bytes of text, so that the text of the part
#: is never in memory at once (the text is several times the size of the CSR arrays it parses to).
_SVMLIGHT_PIECE_BYTES = 8 << 20


def _svmlight_rows(path: str | Path, index: _SvmlightIndex, rows: np.ndarray, n_features: int, zero_based: bool):
    """Examples ``rows`` (in that order) of an indexed file, and only they, parsed by scikit-learn from their byte
    ranges, a piece of :data:`_SVMLIGHT_PIECE_BYTES` at a time: scipy CSR float32. A line that does not parse or
    holds NaN/infinity is named by its line number."""
    import io

    import scipy.sparse as sp
    from sklearn.datasets import load_svmlight_file

    if len(rows) == 0:
        return sp.csr_matrix((0, n_features), dtype=np.float32)
    ends = np.cumsum(index.lengths[rows])  # bytes of text up to the end of each row's line
    pieces = []
    with open(path, "rb") as f:
        start = 0
        while start < len(rows):
            done = int(ends[start - 1]) if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, done + _SVMLIGHT_PIECE_BYTES, side="right")))
            part = rows[start:stop]
            text = io.BytesIO()
            for r in part:
                f.seek(int(index.offsets[r]))
                text.write(f.read(int(index.lengths[r])).rstrip(b"\r\n") + b"\n")
            text.seek(0)
            try:
                x, _ = load_svmlight_file(text, n_features=n_features, dtype=np.float32, zero_based=zero_based)
            except ValueError as exc:
                raise ValueError(_svmlight_piece_fault(path, index, part, text, exc)) from None
            if x.shape[0] != len(part):
                raise ValueError(f"{path}: {x.shape[0]} examples parsed from {len(part)} lines; expected one per line")
            if not np.isfinite(x.data).all():
                row = int(np.searchsorted(x.indptr, int(np.flatnonzero(~np.isfinite(x.data))[0]), side="right") - 1)
                content = text.getvalue().split(b"\n")[row].split(b"#", 1)[0].strip()
                why = _svmlight_line_fault(content) or "a value overflows float32"
                raise ValueError(f"{path} line {int(index.numbers[part[row]])}: {why}; expected {SVMLIGHT_LINE}")
            del text
            pieces.append(x)
            start = stop
    return pieces[0] if len(pieces) == 1 else sp.vstack(pieces, format="csr")


def _svmlight_piece_fault(path: str | Path, index: _SvmlightIndex, part: np.ndarray, text: Any, exc: Exception) -> str:
    """Where and why a piece of a file's lines (``part``, their ``text``) does not parse."""
    for r, line in zip(part, text.getvalue().split(b"\n")):
        content = line.split(b"#", 1)[0].strip()
        why = _svmlight_line_fault(content)
        if why is not None:
            shown = content[:60].decode(errors="replace") + ("..." if len(content) > 60 else "")
            return f"{path} line {int(index.numbers[r])}: {why}; expected {SVMLIGHT_LINE}, got {shown!r}"
    return f"{path}: not valid svmlight/LIBSVM data: {exc}"


def _load_svmlight_part(path: str | Path, n_features: int | None, test_path: str | Path | None,
                        test_fraction: float, seed: int, part: str, share: tuple[int, int] | None):
    """A part of an svmlight dataset, parsing only its lines (see :func:`load_svmlight`): ``(x_train, y_train,
    x_test, y_test, label_values, offset, n_train)`` with scipy CSR features, or None when the quick index pass
    cannot be trusted with the files (the caller parses them whole)."""
    index = _svmlight_index(path)
    test_index = _svmlight_index(test_path) if test_path is not None and index is not None else None
    if index is None or (test_path is not None and test_index is None):
        return None
    indexes = [index] + ([test_index] if test_index is not None else [])
    zero_based = min(i.lowest for i in indexes) == 0  # scikit-learn's rule: one-based unless an index 0 appears
    inferred = max(i.highest for i in indexes) + (1 if zero_based else 0)
    if n_features is not None and n_features < inferred:
        return None  # the whole parse names the conflict
    if test_index is not None:
        (ytr, yte), values = _label_classes(path, index.labels, test_index.labels)
        tr, te = np.arange(len(ytr)), np.arange(len(yte))
    else:
        (ytr,), values = _label_classes(path, index.labels)
        tr, te, _, _ = _split(np.arange(len(ytr)), ytr, test_fraction, seed)
        yte = ytr
    keep_tr, keep_te, offset = _rows_of(tr, te, part, share)
    features = n_features if n_features is not None else inferred
    x_tr = _svmlight_rows(path, index, keep_tr, features, zero_based)
    x_te = _svmlight_rows(test_path if test_index is not None else path, test_index or index, keep_te, features,
                          zero_based)
    return x_tr, ytr[keep_tr], x_te, yte[keep_te], values, offset, len(tr)


def load_svmlight(
    path: str | Path,
    n_features: int | None = None,
    *,
    sparse: bool = False,
    test_path: str | Path | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    part: str = "all",
    share: tuple[int, int] | None = None,
) -> Dataset:
    """A LIBSVM/svmlight text file as a float32 dataset: dense ``[N, n_features]``, or with ``sparse``
    :class:`CSRRows` (never densified: a batch is a :class:`CSRBatch`).

    Labels are mapped to ``0..C-1`` in sorted order (``-1/+1 -> 0/1``, ``1..C -> 0..C-1``);
    ``Dataset.label_values`` records the original label of each class. Indices are read as
    one-based unless the file contains index 0. With ``test_path`` the test set is read
    from that file (same feature count and label mapping); otherwise ``test_fraction`` of
    the rows is split off, seeded (the same split, rows and order, dense or sparse). ``share`` or
    ``part="test"`` (see :func:`load_dataset`): a quick pass reads each line's label and first and last
    feature index only (the split, the index base and the feature count need every line's), then
    scikit-learn parses only the kept lines, from their byte ranges; only those lines are checked
    (a whole load, as the launcher's, checks every line). Where the quick pass cannot be sure of a
    file (multi-label targets, a malformed line), the file is parsed whole and cut. An empty file, a
    line that does not parse and a NaN or infinite value raise ValueError naming the file and the line
    number.
    """
    if share is not None or part == "test":
        got = _load_svmlight_part(path, n_features, test_path, test_fraction, seed, part, share)
        if got is not None:
            x_tr, y_tr, x_te, y_te, values, offset, n_train = got
            if sparse:
                out = Dataset(CSRRows.from_scipy(x_tr), torch.from_numpy(y_tr), CSRRows.from_scipy(x_te),
                              torch.from_numpy(y_te), Path(path).stem, len(values), values)
            else:
                out = _dataset(Path(path).stem, len(values), x_tr.toarray(), x_te.toarray(), y_tr, y_te, values)
            return dataclasses.replace(out, train_offset=offset, train_total=n_train)
    if test_path is not None:
        x, y, xt, yt = _read_svmlight([path, test_path], n_features)
        (ytr, yte), values = _label_classes(path, y, yt)
        tr, te = np.arange(len(ytr)), np.arange(len(yte))
    else:
        x, y = _read_svmlight([path], n_features)
        (ym,), values = _label_classes(path, y)
        del y
        tr, te, _, _ = _split(np.arange(len(ym)), ym, test_fraction, seed)  # the rows only: no copy of x yet
        xt, ytr, yte = x, ym, ym
    keep_tr, keep_te, offset = _rows_of(tr, te, part, share)
    if sparse:
        # The splits are row lists over the parsed file's arrays (no copy: a daemon holds the file's nonzeros
        # once, as scikit-learn's loader does); a share or the test set alone is copied out compact, so
        # that the rest of the file is freed.
        whole = part != "test" and share is None
        pool_tr = CSRRows.from_scipy(x)
        pool_te = pool_tr if xt is x else CSRRows.from_scipy(xt)
        del x, xt
        x_tr = _csr_rows(pool_tr, keep_tr, copy=not whole)
        x_te = _csr_rows(pool_te, keep_te, copy=part == "test")
        del pool_tr, pool_te
        out = Dataset(x_tr, torch.from_numpy(ytr[keep_tr]), x_te, torch.from_numpy(yte[keep_te]), Path(path).stem,
                      len(values), values)
    else:
        # Only the kept rows are made dense (a worker's share, not the whole file).
        x_tr, x_te = x[keep_tr], xt[keep_te]
        del x, xt
        out = _dataset(Path(path).stem, len(values), x_tr.toarray(), x_te.toarray(), ytr[keep_tr], yte[keep_te],
                       values)
    return out if part == "all" and share is None else dataclasses.replace(out, train_offset=offset,
                                                                           train_total=len(tr))


def _csr_rows(pool: CSRRows, rows: np.ndarray, copy: bool) -> CSRRows:
    """Rows ``rows`` of compact ``pool``: a compact copy (``copy``), else a view of its arrays (``pool`` itself
    when ``rows`` are all of its rows in order)."""
    if copy or len(rows) == 0:
        return pool.take(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)))
    if len(rows) == len(pool) and bool(np.all(rows == np.arange(len(pool)))):
        return pool
    return CSRRows(pool.indptr, pool.indices, pool.values, pool.num_features,
                   torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)))


def _npz_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz``: memory-mapped where stored uncompressed (``np.savez``), so that only the rows
    used are read; loaded where compressed (``np.savez_compressed``)."""
    import zipfile

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such npz file")
    if p.stat().st_size == 0:
        raise ValueError(f"{path}: empty file (0 bytes); expected an .npz (numpy.savez) with arrays 'x' and 'y'")
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(p) as zf, open(p, "rb") as raw:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                name = info.filename[:-4]
                if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
                    raw.seek(info.header_offset)
                    local = raw.read(30)  # the local file header: its name and extra field lengths at 26..30
                    skip = int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
                    raw.seek(info.header_offset + 30 + skip)
                    version = np.lib.format.read_magic(raw)
                    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, fortran, dtype = read_header(raw)
                    if dtype.hasobject:
                        raise ValueError(f"array {name!r} holds Python objects; expected numbers")
                    if math.prod(shape) == 0:
                        arrays[name] = np.empty(shape, dtype=dtype)
                    else:
                        # Copy-on-write ("c"): tensors over the map may be written (standardize scales in
                        # place) without touching the file; pages not written stay shared with the page cache.
                        arrays[name] = np.memmap(p, dtype=dtype, mode="c", offset=raw.tell(), shape=shape,
                                                 order="F" if fortran else "C")
                else:
                    with zf.open(info) as member:
                        arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable .npz file (numpy.savez): {exc}") from None
    return arrays


def _nonfinite_row(x: np.ndarray, rows: np.ndarray | None = None, block: int = 65536) -> int | None:
    """The first row (of ``rows``, default all) of float array ``x`` holding a NaN or an infinity, or None."""
    if not np.issubdtype(x.dtype, np.floating):
        return None
    order = np.arange(len(x)) if rows is None else rows
    for start in range(0, len(order), block):
        idx = order[start:start + block]
        part = x[idx] if rows is not None else x[start:start + block]
        bad = ~np.isfinite(part.reshape(len(part), -1)).all(axis=1)
        if bad.any():
            return int(idx[int(np.argmax(bad))])
    return None


def _rows_view(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]``: a view when ``rows`` are consecutive (of a memory-mapped array: its pages, read when touched and
    shared through the page cache by every process on the host that maps the file), else a gathered copy."""
    if len(rows) == 0:
        return a[:0]
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo == len(rows) and bool(np.all(np.diff(rows) == 1)):
        return a[lo:hi]
    return a[rows]


def load_npz(path: str | Path, *, test_fraction: float = 0.2, seed: int = 0, part: str = "all",
             share: tuple[int, int] | None = None) -> Dataset:
    """A ``.npz`` with ``x [N, ...]`` (float -> float32, integer -> int64 ids) and int labels ``y [N]``.

    ``x`` may have any shape per row: ``[N, F]`` features, ``[N, C, H, W]`` images (reaching a CNN as
    they are). Optional ``x_test``/``y_test`` (both or neither) give the test set; otherwise
    ``test_fraction`` of the rows is split off, seeded. Labels must already be ``0..C-1``; an
    optional scalar ``num_classes`` array overrides ``max(y) + 1``. Uncompressed files are
    memory-mapped: ``part`` and ``share`` (see :func:`load_dataset`) read only those rows. A 0-byte
    file, a missing array, x/y of different lengths and NaN or infinite features raise ValueError
    naming the file, the array and (for NaN) the row.
    """
    arrays = _npz_arrays(path)
    for key in ("x", "y"):
        if key not in arrays:
            raise ValueError(f"{path}: missing array {key!r}; expected 'x' and 'y' (found {sorted(arrays)})")
    has_test = ("x_test" in arrays, "y_test" in arrays)
    if has_test[0] != has_test[1]:
        missing = "y_test" if has_test[0] else "x_test"
        raise ValueError(f"{path}: missing array {missing!r}; 'x_test' and 'y_test' come together")
    for key in ("y", "y_test"):
        if key in arrays:
            a = arrays[key] = np.asarray(arrays[key])
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer) or (a.size and a.min() < 0):
                raise ValueError(f"{path}: array {key!r} must be 1-D non-negative integer labels, got {a.dtype}{list(a.shape)}")
    for xk, yk in (("x", "y"), ("x_test", "y_test")):
        if xk not in arrays:
            continue
        x = arrays[xk]
        if x.ndim < 2:
            raise ValueError(f"{path}: array {xk!r} must be [N, F] (or [N, ...], e.g. images [N, C, H, W]), got "
                             f"shape {list(x.shape)}")
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise ValueError(f"{path}: array {xk!r} must hold numbers (float features or integer ids), got {x.dtype}")
        if len(x) != len(arrays[yk]):
            raise ValueError(f"{path}: arrays {xk!r} ({len(x)} rows) and {yk!r} ({len(arrays[yk])} labels) differ in "
                             "length; expected one label per row")
        if len(x) == 0:
            raise ValueError(f"{path}: array {xk!r} has no rows")
    if has_test[0] and arrays["x"].shape[1:] != arrays["x_test"].shape[1:]:
        raise ValueError(f"{path}: rows of 'x' are {list(arrays['x'].shape[1:])} but rows of 'x_test' "
                         f"{list(arrays['x_test'].shape[1:])}")
    y_all = arrays["y"].astype(np.int64)
    if has_test[0]:
        tr, te, y_test_all = np.arange(len(y_all)), np.arange(len(arrays["y_test"])), arrays["y_test"].astype(np.int64)
    else:  # the split's row numbers only: the same split as of the arrays themselves, no feature read yet
        tr, te, _, _ = _split(np.arange(len(y_all)), y_all, test_fraction, seed)
        y_test_all = y_all
    top = max(int(y_all.max(initial=-1)), int(y_test_all.max(initial=-1))) + 1
    num_classes = int(arrays["num_classes"]) if "num_classes" in arrays else top
    if num_classes < top:
        raise ValueError(f"{path}: num_classes={num_classes} but labels go up to {top - 1}")
    train_rows, test_rows, offset = _rows_of(tr, te, part, share)
    x_key, xt_key = "x", "x_test" if has_test[0] else "x"
    for key, rows in ((x_key, train_rows), (xt_key, test_rows)):
        bad = _nonfinite_row(arrays[key], np.sort(rows))
        if bad is not None:
            raise ValueError(f"{path}: array {key!r} row {bad} holds NaN or infinity; expected finite features")
    try:
        out = _dataset(Path(path).stem, num_classes, _rows_view(arrays[x_key], train_rows),
                       _rows_view(arrays[xt_key], test_rows), y_all[train_rows], y_test_all[test_rows])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return out if part == "all" and share is None else dataclasses.replace(out, train_offset=offset, train_total=len(tr))


# ---------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class DatasetSpec:
    """Which dataset to load. ``kind``: digits | click | sparse | synthetic | svmlight | npz (or any
    name when :func:`load_dataset` is given the loader itself, e.g. one from an import path).

    ``path`` is required for the file kinds; ``options`` are the loader's other keyword
    arguments (``n``, ``buckets``, ``test_path``, ...), checked against its signature.
    """

    kind: str
    path: str | None = None
    seed: int = 0
    test_fraction: float = 0.2
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> DatasetSpec:
        """``{"kind": ..., "path"?: ..., "seed"?: ..., <loader options>}`` -> spec (e.g. a TOML table)."""
        if "kind" not in spec:
            raise ValueError(f"dataset spec needs a 'kind' ({'|'.join(LOADERS)}); got keys {sorted(spec)}")
        own = {f.name for f in fields(cls)} - {"options"}
        options = dict(spec.get("options", {}))
        options.update({k: v for k, v in spec.items() if k not in own and k != "options"})
        return cls(**{k: v for k, v in spec.items() if k in own}, options=options)


LOADERS = {
    "digits": load_digits_dataset,
    "click": generate_click_data,
    "sparse": generate_sparse_classification,
    "synthetic": generate_dense_classification,
    "svmlight": load_svmlight,
    "npz": load_npz,
}
_FILE_KINDS = ("svmlight", "npz")
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


def select(ds: Dataset, part: str = "all", share: tuple[int, int] | None = None) -> Dataset:
    """Only ``part`` ("all", "train": no test rows, "test": no training rows) and of the training rows
    only ``share = (index, count)`` (see :func:`load_dataset`); the rows kept are copied out, so that the
    whole set can be freed. ``ds`` itself when nothing is dropped."""
    if part == "all" and share is None:
        return ds
    train_rows, test_rows, offset = _rows_of(np.arange(len(ds.y_train)), np.arange(len(ds.y_test)), part, share)
    lo, hi = offset, offset + len(train_rows)
    keep_test = len(test_rows) == len(ds.y_test)
    # Copies on purpose: views would keep the whole set alive in every worker.
    return dataclasses.replace(
        ds, x_train=ds.x_train[lo:hi].clone(), y_train=ds.y_train[lo:hi].clone(),
        x_test=ds.x_test if keep_test else ds.x_test[:0].clone(),
        y_test=ds.y_test if keep_test else ds.y_test[:0].clone(),
        train_offset=ds.train_offset + offset, train_total=ds.n_train)


def load_dataset(spec: DatasetSpec | Mapping[str, Any], *, loader: Any = None, part: str = "all",
                 share: tuple[int, int] | None = None) -> Dataset:
    """Load the dataset a spec (or mapping, see :meth:`DatasetSpec.from_mapping`) names.

    ``loader``: the function to call instead of ``LOADERS[kind]`` (a user's loader: it gets the spec's
    options as keyword arguments, plus ``path``, ``seed`` and ``test_fraction`` where its signature has
    them, and returns a :class:`Dataset`). ``part``: "all", "train" (no test rows) or "test" (no
    training rows; ``Dataset.n_train`` still counts them); ``share = (index, count)``: of the training
    split only rows ``[n * index // count, n * (index + 1) // count)``. An uncompressed npz and an svmlight
    file read only those rows; other sources are loaded whole and cut (see :func:`select`).
    """
    if not isinstance(spec, DatasetSpec):
        spec = DatasetSpec.from_mapping(spec)
    own_loader = loader is not None
    if loader is None:
        loader = LOADERS.get(spec.kind)
    if loader is None:
        raise ValueError(f"unknown dataset kind {spec.kind!r}; expected one of {sorted(LOADERS)} or an import path")
    params = inspect.signature(loader).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    accepted = set(params)
    kwargs: dict[str, Any] = dict(spec.options)
    unknown = sorted(set(kwargs) - accepted)
    if unknown and not takes_any:
        raise LoaderArgumentsError(f"unknown option(s) {unknown} for dataset kind {spec.kind!r}; accepted: "
                                   f"{sorted(accepted)}")
    if own_loader:
        if spec.path:
            kwargs["path"] = spec.path
        for key, value in (("seed", spec.seed), ("test_fraction", spec.test_fraction)):
            if key in accepted or takes_any:
                kwargs.setdefault(key, value)
    else:
        if spec.kind in _FILE_KINDS:
            if not spec.path:
                raise ValueError(f"dataset kind {spec.kind!r} needs a 'path'")
            kwargs["path"] = spec.path
        elif spec.path:
            raise ValueError(f"dataset kind {spec.kind!r} reads no file, but path={spec.path!r} was given")
        kwargs.setdefault("seed", spec.seed)
        kwargs.setdefault("test_fraction", spec.test_fraction)
    cuts_itself = "part" in accepted and "share" in accepted and not own_loader
    if cuts_itself:
        kwargs.update(part=part, share=share)
    try:
        inspect.signature(loader).bind(**kwargs)
    except TypeError as exc:
        raise LoaderArgumentsError(f"dataset kind {spec.kind!r}: {exc}") from None
    ds = loader(**kwargs)
    if not isinstance(ds, Dataset):
        raise NotADataset(f"dataset loader {spec.kind!r} returned a {type(ds).__name__}; expected hmp.data.Dataset")
    if own_loader and ds.sparse:  # ours are built valid; a user's CSR arrays are checked once, here
        for part_name, x in (("x_train", ds.x_train), ("x_test", ds.x_test)):
            why = x.fault()
            if why is not None:
                raise ValueError(f"dataset {ds.name!r}: {part_name} is not valid CSR rows: {why}")
    return ds if cuts_itself else select(ds, part, share)


# ---------------------------------------------------------------------------- scaling


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


# ---------------------------------------------------------------------------- sharding and batches


def shard(x: Tensor, y: Tensor, index: int, count: int) -> tuple[Tensor, Tensor]:
    """Worker ``index`` of ``count``'s contiguous slice of ``(x, y)``: views, not copies.

    Sizes differ by at most one row (the first ``N % count`` shards get the extra row).
    The slice is contiguous, so shuffle before sharding if rows are ordered (every loader
    here returns a shuffled training set).
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"shard count must be a positive int, got {count!r}")
    if not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
    base, extra = divmod(len(x), count)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return x[start:stop], y[start:stop]


class ShuffledBatches:
    """Index batches over shuffled epochs of ``n`` examples: the one seeded example order of hmp.

    Epoch ``e`` visits ``range(n)`` once, in the order :meth:`order` ``(e)``: a permutation fixed by
    ``(seed, e)`` (numpy's SeedSequence mixes them into independent, platform-stable streams; ``seed``
    may be a tuple, e.g. ``(data_seed, worker_index)``), so every node and every restart derives the
    same order and no example ids need to travel. Iterating yields int64 index tensors of
    ``batch_size`` rows in that order (gather with ``x[idx]``); ``batch_size`` may be set between
    batches. The last batch of an epoch is shorter rather than spilling into the next. Iteration
    starts at ``epoch`` and stops after ``epochs`` epochs (None: never).
    """

    def __init__(self, n: int, batch_size: int = 1, seed: int | Sequence[int] = 0, *, epoch: int = 0,
                 epochs: int | None = None) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"cannot shuffle {n!r} examples; expected an int >= 1")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs!r}")
        self.n = n
        self.seed = (seed,) if isinstance(seed, (int, np.integer)) else tuple(seed)
        self.batch_size = batch_size
        self._epoch, self._end = epoch, None if epochs is None else epoch + epochs
        self._pos = 0
        self._cached: tuple[int, Tensor] | None = None

    @property
    def batch_size(self) -> int:
        """Rows in each following batch."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"batch_size must be a positive int, got {value!r}")
        self._batch_size = value

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def order(self, epoch: int) -> Tensor:
        """Epoch ``epoch``'s permutation of ``range(n)`` (int64; the last one asked for is cached)."""
        if self._cached is None or self._cached[0] != epoch:
            perm = np.random.default_rng([*self.seed, epoch]).permutation(self.n)
            self._cached = (epoch, torch.from_numpy(perm))
        return self._cached[1]

    def __iter__(self) -> Iterator[Tensor]:
        return self

    def __next__(self) -> Tensor:
        if self._pos >= self.n:
            self._epoch, self._pos = self._epoch + 1, 0
        if self._end is not None and self._epoch >= self._end:
            raise StopIteration
        idx = self.order(self._epoch)[self._pos:self._pos + self._batch_size]
        self._pos += len(idx)
        return idx

    def next_batch(self, batch_size: int | None = None) -> Tensor | None:
        """The next batch, first switching to ``batch_size`` if given; None once ``epochs`` are used up."""
        if batch_size is not None:
            self.batch_size = batch_size
        return next(self, None)


def _check_positive(**values: int) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
