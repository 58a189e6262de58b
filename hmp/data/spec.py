"""Which dataset to load (:class:`DatasetSpec`, e.g. from a TOML table) and :func:`load_dataset`, which calls the
named loader (or a user's), checking its options against its signature, and keeps only the part asked for."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .dataset import Dataset, _rows_of
from .loaders import load_diabetes_dataset, load_digits_dataset, load_npz, load_svmlight
from .synthetic import generate_click_data, generate_dense_classification, generate_sparse_classification


class LoaderArgumentsError(ValueError):
    """A loader's keyword arguments (a spec's options) that its signature refuses."""


class NotADataset(TypeError):
    """A loader returned something else than a :class:`Dataset`."""


@dataclass(frozen=True)
class DatasetSpec:
    """Which dataset to load. ``kind``: digits | diabetes | click | sparse | synthetic | svmlight | npz (or any
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
    "diabetes": load_diabetes_dataset,
    "click": generate_click_data,
    "sparse": generate_sparse_classification,
    "synthetic": generate_dense_classification,
    "svmlight": load_svmlight,
    "npz": load_npz,
}
_FILE_KINDS = ("svmlight", "npz")


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
