"""A job: its config checked by every subsystem, its dataset, and its model laid out over the shards.

The one module that knows all the subsystems a job is made of (models, data, HFTA sweeps, batch
policies, the layer planner, pipelines), so that the daemons, the launcher and the API come here
rather than each assembling them, and the subsystems know nothing of each other. :func:`load`
checks a config (every error naming file and key), :func:`dataset` loads ``[data]`` or a part of
it, and :func:`sharded_model` builds the model and lays it out over the shards, identically on
every node.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hmp import config as config_mod
from hmp import data as data_mod
from hmp import models
from hmp.batching import adapter as batching_adapter
from hmp.config import Config
from hmp.config import overrides as overrides_mod
from hmp.errors import ConfigError
from hmp.flat import Chunk, FlatLayout, persistent_buffers
from hmp.hfta.array import FusedArray
from hmp.hfta.optim import check_settings
from hmp.pipeline.chunks import layer_aligned_layout
from hmp.placement import spec as placement_spec
from hmp.ps.sharding import ShardedModel, assign_chunks
from hmp.train import task as task_mod


def check(cfg: Config, *, data: bool = False) -> None:
    """Every subsystem's own check of its section (after :func:`hmp.config.validate`); with ``data``, then
    :func:`check_data` (advice, such as raw features that want standardizing, as a
    :class:`hmp.data.DataWarning`)."""
    check_data_config(cfg)
    models.check_config(cfg)
    task_mod.check_config(cfg)
    if cfg.sweep.members:
        try:
            check_settings(cfg.sweep.optimizer, cfg.sweep.members)
        except (TypeError, ValueError) as exc:
            raise ConfigError(cfg.path, "sweep.members", str(exc)) from None
    batching_adapter.check_config(cfg)
    placement_spec.check_config(cfg)
    check_pipeline_buffers(cfg)
    check_writable_dirs(cfg)
    check_shard_share(cfg)
    if data:
        for advice in check_data(cfg):
            warnings.warn(advice, data_mod.DataWarning, stacklevel=3)


def check_data_config(cfg: Config) -> None:
    """``[data] sparse`` only where it means something: svmlight files (CSR rows from file to batch), without
    ``standardize`` (centring fills in every zero), and in jobs whose code takes sparse batches."""
    d = cfg.data
    if not d.sparse:
        return
    if d.kind != "svmlight":
        raise ConfigError(cfg.path, "data.sparse", f"false for [data] kind = {d.kind!r}: only svmlight files are read "
                                                   "as sparse rows (CSR); a loader of your own may return CSRRows")
    if d.standardize:
        raise ConfigError(cfg.path, "data.sparse", "sparse = true without standardize = true: standardizing subtracts "
                                                   "each feature's mean, which makes every zero nonzero (the data "
                                                   "dense); scale the values in the file instead")
    if cfg.sweep.members:
        raise ConfigError(cfg.path, "data.sparse", "false in an HFTA sweep ([sweep] members): fused models take dense "
                                                   "batches")
    if cfg.placement.enabled:
        raise ConfigError(cfg.path, "data.sparse", "false in a pipeline job ([placement] enabled): its profiler and "
                                                   "stages pass dense activations from the first layer on")


def check_pipeline_buffers(cfg: Config) -> None:
    """A pipeline job's model may have no persistent module buffers: its stages would update BatchNorm statistics
    each in its own replica while the shards, the evaluation and ``model.pt`` kept the initial ones
    (docs/buffers.md)."""
    if not cfg.placement.enabled:
        return
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = models.build_model(cfg.model.name, relative_to=models.config_dir(cfg), **cfg.model.args)
    except Exception:  # noqa: BLE001 (a user's factory may raise anything; its own checks report it)
        return
    names = [n for n, _ in persistent_buffers(model)]
    if names:
        raise ConfigError(cfg.path, "placement.enabled", (
            f"false for a model with buffers ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): "
            "pipeline stages do not carry module buffers such as BatchNorm running statistics to the PS "
            "shards yet, so the evaluation and model.pt would use their initial values; use a model without "
            "them (e.g. LayerNorm instead of BatchNorm) or train it without [placement]"))


def checkpoint_dir(cfg: Config) -> Path:
    """Where the PS shards write their checkpoints: ``[ps] checkpoint_dir``, or ``<report_dir>/checkpoints``."""
    return Path(cfg.ps.checkpoint_dir) if cfg.ps.checkpoint_dir else cfg.report_dir / "checkpoints"


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be written (or made, with its parents); None when it can."""
    probe = folder.absolute()
    while not probe.exists():  # the nearest existing ancestor decides whether the rest can be made
        if probe.is_symlink():
            return f"{probe} is a dangling symbolic link"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory" if probe == folder.absolute() else \
            f"{probe} is a file, so {folder} cannot be made"
    if not os.access(probe, os.W_OK | os.X_OK):  # also false on a read-only file system, for root too
        what = "" if probe == folder.absolute() else f" (to make {folder})"
        return f"{probe} is not writable{what}"
    return None


def check_writable_dirs(cfg: Config) -> None:
    """The report folder and (with PS shards) the checkpoint folder exist and can be written, or can
    be made: found at load rather than by the scheduler's report or a shard's first checkpoint."""
    folders = [("job.report_dir", cfg.report_dir)]
    if cfg.shards:
        folders.append(("ps.checkpoint_dir" if cfg.ps.checkpoint_dir else "job.report_dir", checkpoint_dir(cfg)))
    for key, folder in folders:
        why = _unwritable(folder)
        if why is not None:
            raise ConfigError(cfg.path, key, f"a folder this user can write or make; {why}")


def _shard_chunks(cfg: Config) -> tuple[Chunk, ...]:
    """The job's chunks, as :func:`sharded_model` cuts them, from a model built on the meta device (no
    memory, no initialisation). A sweep's fused parameters are its members' side by side: the same bytes
    per dtype times the member count, and a flat layout's chunks depend only on those totals."""
    m = cfg.model
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.build_model(m.name, relative_to=models.config_dir(cfg), **m.args)
    if cfg.placement.enabled:
        return layer_aligned_layout(model, cfg.ps.chunk_bytes).chunks
    if not cfg.sweep.members:  # (a sweep has no row-sparse tables: refused at load)
        layout = FlatLayout.from_model(model, cfg.ps.chunk_bytes, cfg.ps.table_chunk_bytes, buffers=True)
        return layout.chunks + layout.buffer_chunks
    named = [(n, p) for n, p in model.named_parameters()]
    if cfg.sweep.members:
        members = len(cfg.sweep.members)
        named = [(n, torch.empty(p.numel() * members, dtype=p.dtype, device="meta", requires_grad=p.requires_grad))
                 for n, p in named]
    return FlatLayout.from_named_parameters(named, cfg.ps.chunk_bytes).chunks


def check_shard_share(cfg: Config) -> None:
    """Each PS shard's chunks fit in one message: a pull reply carries all of a shard's chunks, so a share
    over ``[limits] max_message_bytes`` (or ``max_frames``) would fail every pull at run time."""
    if not cfg.shards:
        return
    try:
        chunks = _shard_chunks(cfg)
    except Exception:  # noqa: BLE001 (a user's factory may raise anything)
        return  # not buildable on the meta device: the subsystems' own checks speak for the model
    by_key = {c.key: c for c in chunks}
    limits = cfg.limits
    worst_bytes = worst_frames = 0
    for keys in assign_chunks(chunks, len(cfg.shards)).values():
        worst_bytes = max(worst_bytes, sum(by_key[k].nbytes for k in keys))
        worst_frames = max(worst_frames, sum(math.ceil(by_key[k].nbytes / limits.frame_bytes) for k in keys))
    shards = len(cfg.shards)
    if worst_bytes > limits.max_message_bytes:
        raise ConfigError(cfg.path, "limits.max_message_bytes", (
            f"at least {worst_bytes} (got {limits.max_message_bytes}): the largest of the {shards} PS shards' "
            f"shares of the model is {worst_bytes} bytes and a pull reply carries all of it; raise "
            f"limits.max_message_bytes to at least {worst_bytes} or add PS shards"))
    if worst_frames > limits.max_frames:
        raise ConfigError(cfg.path, "limits.max_frames", (
            f"at least {worst_frames} (got {limits.max_frames}): the largest of the {shards} PS shards' shares "
            f"is {worst_frames} frames (chunks of ps.chunk_bytes cut into limits.frame_bytes) and a pull reply "
            f"carries all of them; raise limits.max_frames to at least {worst_frames}, raise ps.chunk_bytes or "
            "add PS shards"))


def loads(text: str, path: str = "<string>", *, data: bool = False, overrides: Sequence[str] = (),
          free_port: Callable[[str], int] | None = None) -> Config:
    """Parse TOML text into a :class:`Config` checked by the config and by every subsystem (``data``: and
    its data loaded and checked against the model, :func:`check_data`; ``overrides``: ``KEY=VALUE`` from the
    command line, :mod:`hmp.config.overrides`; ``free_port``: picks a ``[cluster]`` scheduler_port of 0)."""
    cfg = config_mod.loads(text, path, overrides, free_port=free_port)
    _check_blamed(cfg, data)
    return cfg


def load(path: str | os.PathLike, *, data: bool = False, overrides: Sequence[str] = (),
         free_port: Callable[[str], int] | None = None) -> Config:
    """Load a TOML config file, checked by the config and by every subsystem (``data``: and its data
    loaded and checked against the model, :func:`check_data`: what the launcher asks for, once, before
    any daemon starts; the daemons check what they load themselves; ``overrides``, ``free_port``: as in
    :func:`loads`)."""
    cfg = config_mod.load(path, overrides, free_port=free_port)
    _check_blamed(cfg, data)
    return cfg


def _check_blamed(cfg: Config, data: bool) -> None:
    """:func:`check`, an error an override caused naming it (as :func:`hmp.config.loads` does for its checks)."""
    try:
        check(cfg, data=data)
    except ConfigError as exc:
        raise blamed(exc, cfg) from None


def blamed(exc: ConfigError, cfg: Config) -> ConfigError:
    """``exc``, found in ``cfg``, naming the command-line overrides it may come from (:func:`hmp.config.overrides.blame`)."""
    return overrides_mod.blame(exc, [overrides_mod.parse(o) for o in cfg.overrides]) if cfg.overrides else exc


def check_devices(cfg: Config, *, cuda_available: bool | None = None, cuda_devices: int | None = None) -> None:
    """Every worker's device exists on this machine: a ``cuda`` device (a gpu_worker's default) needs
    ``torch.cuda.is_available()`` and, for ``cuda:N``, more than N devices. For the launcher of daemons that run
    here, before any starts (a worker that cannot start would otherwise be waited for until
    ``join_timeout_s``). ``cuda_available`` / ``cuda_devices``: what torch says, unless given."""
    for i, n in enumerate(cfg.nodes):
        if n.role not in config_mod.WORKER_ROLES:
            continue
        device = n.device or ("cuda" if n.role == config_mod.Role.GPU_WORKER else "cpu")
        if not device.startswith("cuda"):
            continue
        made = " (made from [cluster] gpu_device)" if cfg.nodes_from_counts else ""
        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            raise ConfigError(cfg.path, f"nodes[{i}].device", (
                f"a device this machine has: {n.role} {n.id!r} is on {device!r}{made}, but torch.cuda.is_available() "
                f"is false here (no CUDA device, or a CPU-only torch {torch.__version__}); set device = \"cpu\" to "
                f"run it on the CPU{', e.g. cluster.gpu_device=cpu' if made else ''}, or run where CUDA is"))
        index = device.partition(":")[2]
        if index:
            count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
            if int(index) >= count:
                raise ConfigError(cfg.path, f"nodes[{i}].device", (
                    f"a device this machine has: {n.role} {n.id!r} is on {device!r}{made}, but it has {count} CUDA "
                    f"device(s): cuda:0 to cuda:{count - 1}"))


def with_env(cfg: Config, environ: Mapping[str, str] | None = None) -> Config:
    """The HMP_* environment overrides applied (:data:`hmp.config.ENV_OVERRIDES`), checked again (the data
    not again: no override touches ``[data]`` or ``[model]``)."""
    out = config_mod.env_overrides(cfg, environ)
    if out is not cfg:
        check(out, data=False)
    return out


def _data_key(cfg: Config) -> str:
    """The key a data error is reported under: the file's, or the generator's arguments."""
    return "data.path" if cfg.data.path else "data.args"


def _loader(cfg: Config) -> Any:
    """``[data] kind``'s loader when it is an import path (relative file paths from the config), else None."""
    kind = cfg.data.kind
    if not models.is_import_path(kind):
        return None
    try:
        return models.import_object(kind, models.config_dir(cfg))
    except models.ModelNotFound as exc:
        raise ConfigError(cfg.path, "data.kind", f"a loader function ({exc})") from None


def _load(cfg: Config, part: str, share: tuple[int, int] | None) -> data_mod.Dataset:
    """``[data]`` as :func:`hmp.data.load_dataset` loads it (no scaling); every failure a ConfigError."""
    d = cfg.data
    spec: dict[str, Any] = {"kind": d.kind, "seed": d.seed, "test_fraction": d.test_fraction, **d.args}
    if d.kind == "click":
        spec.setdefault("n", d.samples)
    if d.sparse:
        spec["sparse"] = True
    if d.kind in ("svmlight", "npz"):
        spec["targets"] = task_mod.targets_of(cfg)
    if d.path:
        spec["path"] = str(cfg.resolve(d.path))
    if d.test_path:
        spec["test_path"] = str(cfg.resolve(d.test_path))
    loader = _loader(cfg)
    try:
        return data_mod.load_dataset(spec, loader=loader, part=part, share=share)
    except data_mod.LoaderArgumentsError as exc:
        raise ConfigError(cfg.path, "data.args", str(exc)) from None
    except data_mod.NotADataset as exc:
        raise ConfigError(cfg.path, "data.kind", f"a loader that returns hmp.data.Dataset; {exc}") from None
    except (ValueError, TypeError, FileNotFoundError) as exc:
        if loader is None:  # our loaders' messages name the file, and the line or array
            raise ConfigError(cfg.path, _data_key(cfg), str(exc)) from None
        raise ConfigError(cfg.path, "data.kind", f"a loader that loads the data; {d.kind}() raised "
                                                 f"{exc.__class__.__name__}: {exc}") from None
    except Exception as exc:  # a user's loader may raise anything
        if loader is None:
            raise
        raise ConfigError(cfg.path, "data.kind", f"a loader that loads the data; {d.kind}() raised "
                                                 f"{exc.__class__.__name__}: {exc}") from None


#: A partial load's training statistics for ``standardize`` are summed over this many slices of the
#: training split, one at a time: an uncompressed npz then never holds more than a slice in memory.
_STATS_SLICES = 8


def _train_stats(cfg: Config, loaded: data_mod.Dataset) -> data_mod.FeatureStats:
    """The whole training split's feature statistics (``loaded`` may be a part of it)."""
    if loaded.train_total is None or len(loaded.y_train) == loaded.train_total:  # the whole training split is here
        return data_mod.FeatureStats.of(loaded.x_train)
    slices = _STATS_SLICES if cfg.data.kind == "npz" else 1
    total = sq = None
    n = 0
    for k in range(slices):
        x = _load(cfg, "train", (k, slices) if slices > 1 else None).x_train
        if not x.is_floating_point():
            raise ConfigError(cfg.path, "data.standardize", f"false for integer features (categorical ids), "
                                                            f"got x of {x.dtype}")
        block = x.double()
        total = block.sum(0) if total is None else total + block.sum(0)
        sq = (block * block).sum(0) if sq is None else sq + (block * block).sum(0)
        n += len(x)
        del x, block
    if not n:
        raise ConfigError(cfg.path, _data_key(cfg), "training rows to take the standardize statistics from; none")
    mean = total / n
    std = (sq / n - mean * mean).clamp_min(0).sqrt()
    std[std < 1e-12] = 1.0
    return data_mod.FeatureStats(mean.float(), std.float())


def dataset(cfg: Config, part: str = "all", share: tuple[int, int] | None = None, *,
            stats: data_mod.FeatureStats | None = None) -> data_mod.Dataset:
    """Load ``[data]``: digits and click are built in; svmlight and npz read the user's files; an import
    path calls the user's loader. ``[data] standardize``: features scaled by the whole training split's
    statistics (also when only a part is loaded; ``stats``: those statistics, when the caller has them from an
    earlier load's ``Dataset.stats``, so that they are not taken again). ``part`` / ``share``: only the test
    set ("test", the scheduler's evaluation), only the training rows ("train"), and of those only worker
    ``index`` of ``count``'s slice (``share = (index, count)``), read alone where the format allows
    (uncompressed npz, svmlight; docs/data.md, "Loading a part"). Bad data is a ConfigError naming the config file, the
    key, and the data file's line or array."""
    ds = _load(cfg, part, share)
    if cfg.data.standardize:
        if ds.sparse or (not ds.x_train.is_floating_point() and not ds.x_test.is_floating_point()):
            raise ConfigError(cfg.path, "data.standardize", f"false for integer features (categorical ids) and sparse "
                                                            f"rows, got x of {ds.x_train.dtype}")
        stats = stats or _train_stats(cfg, ds)
        data_mod.standardize(ds, stats)
        ds = dataclasses.replace(ds, stats=stats)
    return ds


def _first_layer(model: torch.nn.Module) -> tuple[str, str] | None:
    """What the model's first weighted layer expects of one example, and the layer: for the error message."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            return f"rows of {module.in_features} features", repr(module)
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            dims = {torch.nn.Conv1d: "L", torch.nn.Conv2d: "H, W", torch.nn.Conv3d: "D, H, W"}[type(module)]
            return f"rows of [{module.in_channels}, {dims}] ({module.in_channels} channels)", repr(module)
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            return f"int64 ids in [0, {module.num_embeddings})", repr(module)
    return None


#: models with at most this many parameters are checked on the CPU (:func:`check_model_fits`), larger ones on the
#: meta device
REAL_CHECK_MAX_PARAMETERS = 1_000_000


def check_model_fits(cfg: Config, ds: data_mod.Dataset) -> None:
    """One forward pass of two real rows of ``ds`` through ``[model]``: a model that does not fit the data, or
    whose outputs cannot score its labels, is a ConfigError naming both shapes (before any daemon trains,
    rather than a traceback from a worker mid-training). On the meta device first (no memory, no
    initialisation) unless it is small (:data:`REAL_CHECK_MAX_PARAMETERS`); a model that cannot run there (e.g. it
    reads a value) is built for real."""
    x = data_mod.whole_batch(ds.x_train[:2] if len(ds.x_train) else ds.x_test[:2])  # sparse rows: a CSRBatch
    if not len(x):
        return
    where = str(cfg.resolve(cfg.data.path)) if cfg.data.path else f"[data] kind = {cfg.data.kind!r}"
    m = cfg.model
    key = "model.args" if not models.is_import_path(m.name) else "model.name"
    real = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                model = models.from_config(cfg)
            # A small model runs for real: quicker than a first forward on the meta device, which imports
            # torch's symbolic-shape machinery (sympy, dynamo; seconds of CPU at every launch).
            real = sum(p.numel() for p in model.parameters()) <= REAL_CHECK_MAX_PARAMETERS
            if not real:
                with torch.no_grad():
                    out = model(x.to("meta"))
    except Exception:  # noqa: BLE001 (whatever the model raises is reported below, from a real run)
        real = True
    if real:
        model = models.from_config(cfg, seed=m.seed)
        try:
            with torch.no_grad():
                out = model(x)
        except Exception as exc:  # noqa: BLE001
            first = _first_layer(model)
            expects = f"{first[0]} (its first layer: {first[1]})" if first else "other input"
            raise ConfigError(cfg.path, key, (
                f"a model that fits the data: model {m.name!r} expects {expects}, data has rows of shape "
                f"{list(ds.feature_shape)} ({x.dtype}, {where}); a forward pass of x {list(x.shape)} raised "
                f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")) from None
    if ds.sparse:
        # Column indices are ids into the model's first table: the meta device does not check their range, and two
        # real rows may not reach the highest column, so the table's size is compared with the data's columns.
        bag = next((mod for mod in model.modules() if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag))),
                   None)
        if bag is not None and bag.num_embeddings < ds.num_features:
            raise ConfigError(cfg.path, key, (
                f"a model that fits the data: model {m.name!r} takes column indices in [0, {bag.num_embeddings}) "
                f"(its first table: {bag!r}), but the sparse data has {ds.num_features} columns ({where}); give "
                f"the table at least {ds.num_features} rows"))
    task = task_mod.task_of(cfg)
    if ds.regression and task.name == "classification":
        raise ConfigError(cfg.path, "train.task", f"\"regression\" (or a task of your own) for float targets: the "
                                                  f"data ({where}) has float32 targets, classification needs integer "
                                                  "class labels")
    if not task.builtin:
        _check_user_task(cfg, ds, x)
        return
    if task.name == "regression":
        if ds.num_classes and not ds.regression:
            raise ConfigError(cfg.path, "train.task", f"\"classification\" for class labels ({where}); regression "
                                                      f"needs float targets (data.targets = \"values\")")
        per_row = int(math.prod(ds.y_train.shape[1:]))
        if not isinstance(out, torch.Tensor) or out.shape[0] != len(x) or out[0].numel() != per_row:
            shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(cfg.path, key, f"a model with one output per target value: model {m.name!r} gives "
                                             f"{shape} for x {list(x.shape)}, the targets have {per_row} value(s) "
                                             f"per row ({where})")
        return
    labels = [t for t in (ds.y_train, ds.y_test) if len(t)]
    top = max(int(t.max()) for t in labels) if labels else -1
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != len(x):
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(cfg.path, key, f"a model that outputs logits [N, classes]; model {m.name!r} gives "
                                         f"{shape} for x {list(x.shape)} ({where})")
    if out.shape[1] <= top:
        raise ConfigError(cfg.path, key, (
            f"a model with an output per class: model {m.name!r} outputs {out.shape[1]} logits per row but the "
            f"labels go up to {top} ({top + 1} classes, {where}); give the model at least {top + 1} outputs"))


def _check_user_task(cfg: Config, ds: data_mod.Dataset, x: Any) -> None:
    """One loss (and score) of a task of your own on two real rows: a function that does not fit the model's
    outputs or the data's targets is a ConfigError naming ``train.task`` (or ``task_score``) and what it raised."""
    task = task_mod.task_of(cfg)
    y = ds.y_train[:2] if len(ds.y_train) else ds.y_test[:2]
    model = models.from_config(cfg, seed=cfg.model.seed)
    try:
        task.loss(model, x, y).backward()
    except Exception as exc:  # noqa: BLE001 (a user's function may raise anything)
        raise ConfigError(cfg.path, "train.task", f"a {cfg.train.task_kind} function that trains this model on "
                                                  f"this data; on two rows (x {list(x.shape)}, y {y.dtype}"
                                                  f"{list(y.shape)}) it raised {exc.__class__.__name__}: "
                                                  f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if task.score_fn is not None:
        try:
            task.score(model, x, y, torch.device("cpu"))
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(cfg.path, "train.task_score", f"a scorer (model, (x, y)) -> dict of metrics; on two "
                                                            f"rows it raised {exc.__class__.__name__}: {exc}") from None


def check_data(cfg: Config) -> list[str]:
    """Load ``[data]`` once, as a daemon would (every row checked: files, lines, arrays, NaN/inf), and run
    :func:`check_model_fits` on it. Returns advice for the user (one line each; e.g. features whose
    scales differ wildly while ``[data] standardize`` is off). Errors are ConfigErrors."""
    ds = dataset(cfg)
    check_model_fits(cfg, ds)
    advice = []
    if not cfg.data.standardize:
        line = data_mod.scale_advice(ds)
        if line:
            advice.append(line)
    return advice


def sharded_model(cfg: Config, device: str | torch.device = "cpu") -> ShardedModel:
    """The job's model from ``[model]`` (seeded, the global RNG untouched), over the shards' chunks."""
    m = cfg.model
    array = None
    if cfg.sweep.members:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(m.seed)
            array = FusedArray(lambda: models.from_config(cfg), cfg.sweep.members,
                               cfg.sweep.optimizer, device)
        model = array.model
    else:
        model = models.from_config(cfg, seed=m.seed)
    if cfg.placement.enabled:
        # Pipeline stages push their own layers' chunks: no chunk may straddle two layers.
        layout = layer_aligned_layout(model, cfg.ps.chunk_bytes)
    else:  # module buffers (BatchNorm statistics) travel with the parameters (docs/buffers.md)
        layout = FlatLayout.from_model(model, cfg.ps.chunk_bytes, cfg.ps.table_chunk_bytes, buffers=True)
    model.to(device)
    return ShardedModel.of(model, layout, len(cfg.shards), array)
