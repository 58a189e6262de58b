"""Datasets read from local data, never downloaded: scikit-learn's bundled ``digits``, a LIBSVM/svmlight text
file (dense, or CSR rows) and an ``.npz``. The file loaders read only the rows a partial load keeps where they can,
and refuse bad data with the file and the line (svmlight) or array (npz) in the message."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .csr import CSRRows
from .dataset import Dataset, _dataset, _rows_of, _split


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


def load_diabetes_dataset(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled diabetes (regression): x float32 ``[N, 10]`` (scikit-learn's scaled features),
    y float32 ``[N]``, a disease progression measure one year on (25 to 346), in its own units.

    Seeded split, not stratified: 353 train / 89 test rows at the default fraction. Cached as digits is.
    """
    cached = _digits_cache(test_fraction, seed, name="diabetes")
    if cached is not None:
        try:
            with np.load(cached) as z:
                return _dataset("diabetes", 0, z["xtr"], z["xte"], z["ytr"], z["yte"])
        except (OSError, ValueError, KeyError):
            pass  # missing or torn: build it again
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    xtr, xte, ytr, yte = _split(d.data.astype(np.float32), d.target.astype(np.float32), test_fraction, seed,
                                stratify=False)
    if cached is not None:
        _write_cache(cached, xtr=xtr, xte=xte, ytr=ytr, yte=yte)
    return _dataset("diabetes", 0, xtr, xte, ytr, yte)


def _digits_cache(test_fraction: float, seed: int, name: str = "digits") -> Path | None:
    """Where the digits (or another bundled set's, ``name``) split is cached: importing scikit-learn's datasets and splitter costs every
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
    return Path(root) / f"{name}-sklearn{version}-test{test_fraction!r}-seed{seed}.npz"


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


TARGETS = ("classes", "values")


def _labels(path: str | Path, targets: str, *ys: np.ndarray) -> tuple[list[np.ndarray], tuple[float, ...]]:
    """``targets = "classes"``: :func:`_label_classes`; ``"values"``: the labels as float32 target values."""
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    if targets == "classes":
        return _label_classes(path, *ys)
    return [np.asarray(a, dtype=np.float32) for a in ys], ()


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
                        test_fraction: float, seed: int, part: str, share: tuple[int, int] | None,
                        targets: str = "classes"):
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
        (ytr, yte), values = _labels(path, targets, index.labels, test_index.labels)
        tr, te = np.arange(len(ytr)), np.arange(len(yte))
    else:
        (ytr,), values = _labels(path, targets, index.labels)
        tr, te, _, _ = _split(np.arange(len(ytr)), ytr, test_fraction, seed, stratify=targets == "classes")
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
    targets: str = "classes",
) -> Dataset:
    """A LIBSVM/svmlight text file as a float32 dataset: dense ``[N, n_features]``, or with ``sparse``
    :class:`CSRRows` (never densified: a batch is a :class:`CSRBatch`).

    Labels are mapped to ``0..C-1`` in sorted order (``-1/+1 -> 0/1``, ``1..C -> 0..C-1``);
    ``Dataset.label_values`` records the original label of each class. ``targets = "values"``: the labels
    are float32 target values as they are (regression; the split is then not stratified). Indices are read as
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
        got = _load_svmlight_part(path, n_features, test_path, test_fraction, seed, part, share, targets)
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
        (ytr, yte), values = _labels(path, targets, y, yt)
        tr, te = np.arange(len(ytr)), np.arange(len(yte))
    else:
        x, y = _read_svmlight([path], n_features)
        (ym,), values = _labels(path, targets, y)
        del y
        # the rows only: no copy of x yet
        tr, te, _, _ = _split(np.arange(len(ym)), ym, test_fraction, seed, stratify=targets == "classes")
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
             share: tuple[int, int] | None = None, targets: str = "classes") -> Dataset:
    """A ``.npz`` with ``x [N, ...]`` (float -> float32, integer -> int64 ids) and int labels ``y [N]``
    (``targets = "values"``: float32 target values ``y [N]`` or ``[N, k]``, for regression; not stratified).

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
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    for key in ("y", "y_test"):
        if key in arrays and targets == "values":
            a = arrays[key] = np.asarray(arrays[key])
            if a.ndim not in (1, 2) or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
                raise ValueError(f"{path}: array {key!r} must be float target values [N] or [N, k], got "
                                 f"{a.dtype}{list(a.shape)}")
            bad = _nonfinite_row(a.reshape(len(a), -1))
            if bad is not None:
                raise ValueError(f"{path}: array {key!r} row {bad} holds NaN or infinity; expected finite targets")
        elif key in arrays:
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
    ytype = np.int64 if targets == "classes" else np.float32
    y_all = arrays["y"].astype(ytype)
    if has_test[0]:
        tr, te, y_test_all = np.arange(len(y_all)), np.arange(len(arrays["y_test"])), arrays["y_test"].astype(ytype)
        if y_all.shape[1:] != y_test_all.shape[1:]:
            raise ValueError(f"{path}: 'y' has {list(y_all.shape[1:])} values per row but 'y_test' "
                             f"{list(y_test_all.shape[1:])}")
    else:  # the split's row numbers only: the same split as of the arrays themselves, no feature read yet
        tr, te, _, _ = _split(np.arange(len(y_all)), y_all, test_fraction, seed, stratify=targets == "classes")
        y_test_all = y_all
    top = max(int(y_all.max(initial=-1)), int(y_test_all.max(initial=-1))) + 1 if targets == "classes" else 0
    num_classes = int(arrays["num_classes"]) if "num_classes" in arrays and targets == "classes" else top
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
