"""Model factories shared by the runtime, the planner and the benchmarks, and the user's own models.

``[model] name`` is a factory of :data:`MODELS` or an import path to the user's own factory. The
shipped factories build ``nn.Sequential`` models so that their layers can be profiled and cut into
pipeline stages without special cases; those with row-sparse tables say which rows a batch reads
(``rows_touched``, :class:`RowSparseSequential`). Factories and their arguments: docs/data.md.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hmp.config import Config
from hmp.errors import ConfigError


class FieldEmbedding(nn.Module):
    """Hashed categorical features to one dense vector per example.

    Input ``[N, F]`` int64 bucket ids (one per field, already hashed into
    ``buckets``); output ``[N, F * dim]``: each field looked up in its own table,
    concatenated. The tables are one ``nn.Embedding`` of ``F * buckets`` rows so the
    PS sees a single large (sparse-ish) parameter; with ``sparse`` it is a row-sparse table.
    """

    def __init__(self, fields: int, buckets: int, dim: int, sparse: bool = False) -> None:
        super().__init__()
        self.fields, self.buckets, self.dim = fields, buckets, dim
        self.table = nn.Embedding(fields * buckets, dim, sparse=sparse)
        nn.init.normal_(self.table.weight, std=0.05)
        self.register_buffer("offsets", torch.arange(fields, dtype=torch.int64) * buckets, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids + self.offsets).flatten(1)

    def rows_touched(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"table.weight": the sorted unique table rows ids [N, F] read}``."""
        return {"table.weight": torch.unique(ids + self.offsets)}


class SparseFeatureBag(nn.EmbeddingBag):
    """A sparse linear first layer: sparse feature rows (a ``CSRBatch``: ``indices``, ``offsets``,
    ``values``, the ``nn.EmbeddingBag`` convention, hmp.data) to ``[B, dim]``, row ``b`` being the sum of
    the table rows of its features weighted by their values (the batch times the ``[num_features, dim]``
    table). A row-sparse table (``sparse=True``): a batch reads and updates only its features' rows."""

    def __init__(self, num_features: int, dim: int, sparse: bool = True) -> None:
        super().__init__(num_features, dim, mode="sum", sparse=sparse)
        nn.init.normal_(self.weight, std=0.05)

    def forward(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch.indices, batch.offsets, per_sample_weights=batch.values)

    def rows_touched(self, batch: Any) -> dict[str, torch.Tensor]:
        """``{"weight": the sorted unique feature ids of the batch}``."""
        return {"weight": torch.unique(batch.indices)}


class RowSparseSequential(nn.Sequential):
    """An ``nn.Sequential`` whose first layer holds a row-sparse table and says which rows a batch reads:
    :meth:`rows_touched`, the method hmp's workers look for to pull only those rows."""

    def rows_touched(self, batch: Any) -> dict[str, torch.Tensor]:
        """``{parameter name (as in named_parameters()): sorted unique int64 row ids}`` that a forward
        pass of ``batch`` reads from the model's row-sparse tables."""
        return {f"0.{name}": rows for name, rows in self[0].rows_touched(batch).items()}


def mlp(in_features: int, hidden: Sequence[int], out_features: int) -> nn.Sequential:
    """A ReLU MLP as a flat ``nn.Sequential`` (Linear, ReLU, ..., Linear).

    ``in_features``: input width; ``hidden``: the hidden layers' widths, in order (empty: one Linear);
    ``out_features``: output width (logits).
    """
    layers: list[nn.Module] = []
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


def digits_mlp(hidden: Sequence[int] = (128, 64)) -> nn.Sequential:
    """MLP for scikit-learn's digits: ``[N, 64]`` float32 in, ``[N, 10]`` logits out.

    ``hidden``: the hidden layers' widths (default ``[128, 64]``).
    """
    return mlp(64, hidden, 10)


def click_model(fields: int = 8, buckets: int = 1000, dim: int = 16, hidden: Sequence[int] = (64, 32),
                sparse: bool = False) -> nn.Sequential:
    """Sparse click-through model: ``[N, fields]`` int64 ids in, ``[N, 2]`` logits out.

    ``fields``: categorical fields per example (columns of x); ``buckets``: hashed ids per field (each
    id in ``[0, buckets)``); ``dim``: embedding width per field; ``hidden``: the MLP's hidden widths over
    the ``fields * dim`` concatenated embeddings; ``sparse``: the embedding table is row-sparse (only the
    rows a batch reads are pushed, pulled and updated on the parameter server; PS jobs only).
    """
    if sparse:
        return RowSparseSequential(FieldEmbedding(fields, buckets, dim, sparse=True), *mlp(fields * dim, hidden, 2))
    return nn.Sequential(FieldEmbedding(fields, buckets, dim), *mlp(fields * dim, hidden, 2))


def sparse_mlp(num_features: int, dim: int = 16, hidden: Sequence[int] = (64,), classes: int = 2,
               sparse: bool = True) -> nn.Sequential:
    """Sparse-input MLP for ``[data] sparse = true`` (svmlight rows kept as CSR): a batch of sparse rows
    (``CSRBatch``) in, ``[N, classes]`` logits out. The first layer is an ``nn.EmbeddingBag(num_features,
    dim, mode="sum", sparse=True)`` over the rows' features weighted by their values (a sparse linear
    layer, :class:`SparseFeatureBag`), a row-sparse table: only the rows of a batch's features are pushed,
    pulled and updated on the parameter server (PS jobs only).

    ``num_features``: input width (the data's feature count; feature ids in ``[0, num_features)``);
    ``dim``: the bag's output width; ``hidden``: the MLP's hidden widths over it (empty: one Linear);
    ``classes``: output width (logits); ``sparse``: false makes the bag's table dense (every push and pull
    carries all of it: the peer bench/sparse.py measures against).
    """
    return RowSparseSequential(SparseFeatureBag(num_features, dim, sparse), *mlp(dim, hidden, classes))


def deep_mlp(in_features: int = 256, width: int = 512, depth: int = 8, classes: int = 10) -> nn.Sequential:
    """A deeper dense MLP, the second placement workload: ``[N, in_features]`` float32 in, ``[N, classes]`` out.

    ``in_features``: input width; ``width``: every hidden layer's width; ``depth``: hidden layers;
    ``classes``: output width (logits).
    """
    return mlp(in_features, [width] * depth, classes)


MODELS = {"digits_mlp": digits_mlp, "click_model": click_model, "deep_mlp": deep_mlp, "sparse_mlp": sparse_mlp}


class ModelNotFound(ValueError):
    """``[model] name`` (or another import path) names nothing that can be called."""


def is_import_path(name: str) -> bool:
    """``package.module:function`` or ``path/to/file.py:function`` (a registry name has no colon)."""
    return ":" in name


_FILE_MODULES: dict[Path, Any] = {}  # file -> its module, executed once per process (classes stay one class)


def import_object(ref: str, relative_to: str | Path | None = None) -> Any:
    """The object an import path names: ``package.module:attr`` or ``path/to/file.py:attr`` (``attr`` may be
    dotted, ``Class.method``). A file path is taken relative to ``relative_to`` (a folder; default: the
    working directory). Raises :class:`ModelNotFound` saying what is missing (hmp.job also resolves
    ``[data] kind`` loaders with it)."""
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr:
        raise ModelNotFound(f"{ref!r} is not an import path; expected 'package.module:function' or "
                            "'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser()
        if not path.is_absolute() and relative_to is not None:
            path = Path(relative_to) / path
        path = path.resolve()
        if not path.is_file():
            raise ModelNotFound(f"{ref!r}: no such file {path}")
        module = _FILE_MODULES.get(path)
        if module is None:
            # A name of its own per file, so two files called models.py do not replace each other.
            name = f"hmp_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ModelNotFound(f"{ref!r}: {path} cannot be imported as Python source")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before executing: dataclasses and pickling look themselves up there
            try:
                spec.loader.exec_module(module)
            except BaseException as exc:
                sys.modules.pop(name, None)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise ModelNotFound(f"{ref!r}: importing {path} raised {exc.__class__.__name__}: {exc}") from None
            _FILE_MODULES[path] = module
        source = str(path)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise ModelNotFound(f"{ref!r}: no module {exc.name!r} (install it or put it on PYTHONPATH; a file "
                                "is named by its path, e.g. 'models.py:build', relative to the config)") from None
        except Exception as exc:
            raise ModelNotFound(f"{ref!r}: importing {where} raised {exc.__class__.__name__}: {exc}") from None
        source = getattr(module, "__file__", None) or where
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelNotFound(f"{ref!r}: {source} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ModelNotFound(f"{ref!r}: {attr} in {source} is a {type(obj).__name__}, not a function or class")
    return obj


def factory_of(name: str, relative_to: str | Path | None = None) -> Callable[..., nn.Module]:
    """The factory ``[model] name`` names: a :data:`MODELS` entry or an import path (see :func:`import_object`)."""
    if is_import_path(name):
        return import_object(name, relative_to)
    try:
        return MODELS[name]
    except KeyError:
        raise ModelNotFound(f"unknown model {name!r}; expected one of {sorted(MODELS)} or an import path "
                            "('package.module:function' or 'path/to/file.py:function')") from None


def build_model(name: str, seed: int | None = None, *, relative_to: str | Path | None = None,
                **kwargs) -> nn.Module:
    """Build a model by registry name or import path (relative file paths from ``relative_to``); an unknown
    name lists the known ones, a factory that returns something else than a module is a TypeError.

    With ``seed``, the initial parameters come from that seed (every node builds the same model)
    without touching the global torch RNG: the caller's random stream is left as it was.
    """
    factory = factory_of(name, relative_to)
    if seed is None:
        model = factory(**kwargs)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {name!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def config_dir(cfg: Config) -> Path:
    """The folder relative paths of ``cfg`` start from (its file's)."""
    return Path(cfg.path).resolve().parent


def from_config(cfg: Config, seed: int | None = None) -> nn.Module:
    """``[model]``'s model (import paths relative to the config file's folder)."""
    return build_model(cfg.model.name, seed, relative_to=config_dir(cfg), **cfg.model.args)


def _build_for_check(cfg: Config) -> nn.Module:
    """The model, built on the meta device (no memory, no initialisation) where its factory allows; a user's
    factory that does not (e.g. it reads a tensor's value while building) is built for real."""
    m = cfg.model
    factory = factory_of(m.name, config_dir(cfg))
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torch's warning about a zero-element init
            return factory(**m.args)
    except TypeError:
        raise  # the arguments: no device helps
    except Exception:
        if not is_import_path(m.name):
            raise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(**m.args)


def _refuses_arguments(factory: Callable[..., Any], args: dict) -> bool:
    """Whether ``factory``'s signature refuses ``args`` (a factory whose signature cannot be read: no)."""
    try:
        inspect.signature(factory).bind(**args)
    except TypeError:
        return True
    except ValueError:
        return False
    return False


def check_config(cfg: Config) -> None:
    """``[model]``: the name is known (or imports), the factory accepts the arguments and returns a module,
    and jobs that cut the model into layers get an ``nn.Sequential``. The model is built on the meta device
    (no memory, no initialisation), so a bad value fails at load with file and key."""
    p, m = cfg.path, cfg.model
    try:
        factory_of(m.name, config_dir(cfg))
    except ModelNotFound as exc:
        raise ConfigError(p, "model.name", str(exc) if is_import_path(m.name) else
                          f"one of {sorted(MODELS)} or an import path ('package.module:function' or "
                          f"'path/to/file.py:function', relative to the config file), got {m.name!r}") from None
    user = is_import_path(m.name)
    try:
        model = _build_for_check(cfg)
    except Exception as exc:  # a user's factory may raise anything
        if not user and not isinstance(exc, (TypeError, ValueError, RuntimeError, NotImplementedError)):
            raise
        if not user or _refuses_arguments(factory_of(m.name, config_dir(cfg)), m.args):
            raise ConfigError(p, "model.args", f"arguments that {m.name}() accepts ({exc})") from None
        raise ConfigError(p, "model.name", f"a factory that builds the model; {m.name}(**model.args) raised "
                                           f"{exc.__class__.__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(p, "model.name", f"a factory returning a torch.nn.Module; {m.name}() returned a "
                                           f"{type(model).__name__}")
    _check_row_sparse(cfg, model)
    needs = "a [sweep] job (HFTA fuses an nn.Sequential layer by layer)" if cfg.sweep.members else \
        "a [placement] job (the pipeline cuts an nn.Sequential into stages)" if cfg.placement.enabled else None
    if needs and not isinstance(model, nn.Sequential):
        raise ConfigError(p, "model.name", f"a factory returning an nn.Sequential for {needs}; {m.name}() "
                                           f"returned a {type(model).__name__}")


def _check_row_sparse(cfg: Config, model: nn.Module) -> None:
    """A model with row-sparse tables (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``) trains only
    where its sparse gradients reach the parameter server: PS jobs of single-threaded workers. The others
    would drop them (their code sums dense flat gradient buffers), so they are refused at load."""
    from hmp.config import Consistency
    from hmp.flat import row_sparse_tables

    tables = row_sparse_tables(model)
    if not tables:
        return
    what = (f"a model without row-sparse tables (nn.Embedding/nn.EmbeddingBag with sparse=True: "
            f"{', '.join(tables)}; e.g. click_model's sparse = false)")
    if cfg.train.consistency == Consistency.ALLREDUCE:
        raise ConfigError(cfg.path, "model.args", f"{what} for train.consistency = \"allreduce\" (the ring sums dense "
                                                  "gradient buffers); row-sparse tables need a parameter server")
    if cfg.sweep.members:
        raise ConfigError(cfg.path, "model.args", f"{what} for a [sweep] job (HFTA fuses dense layers)")
    if cfg.placement.enabled:
        raise ConfigError(cfg.path, "model.args", f"{what} for a [placement] job (pipeline stages push dense "
                                                  "gradient buffers)")
    for i, n in enumerate(cfg.nodes):
        if n.hogwild_threads > 1:
            raise ConfigError(cfg.path, f"nodes[{i}].hogwild_threads",
                              f"1 for a model with row-sparse tables ({', '.join(tables)}): Hogwild threads sum "
                              "dense gradients on the worker (or make the tables dense: sparse = false)")
