"""Sparse rows in CSR form: :class:`CSRRows` (a dataset's features, never densified) and :class:`CSRBatch` (a
batch ``x[idx]`` of them in the ``nn.EmbeddingBag`` convention ``indices``, ``offsets``, ``values``: what a
sparse-input model's ``forward`` takes)."""

from __future__ import annotations

from dataclasses import dataclass
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
