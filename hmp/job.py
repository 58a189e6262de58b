"""A job: its config checked by every subsystem, its dataset, and its model laid out over the shards.

The one module that knows all the subsystems a job is made of (models, data, HFTA sweeps, batch
policies, the layer planner, pipelines): the daemons, the launcher and the API come here rather
than each assembling them. Below it, the subsystems know nothing of each other.

* :func:`load` / :func:`loads`: :mod:`hmp.config`'s own checks, then each subsystem's
  ``check_config`` (what only its code can judge), then what needs the whole job: the folders it
  writes (report, checkpoints) can be written, and each shard's share of the model fits in one
  message; every error naming file and key.
* :func:`dataset`: ``[data]`` loaded (digits and click are built in; svmlight and npz read the
  user's files).
* :func:`sharded_model`: the model built from ``[model]`` with its seed, laid out in flat buffers
  (layer-aligned chunks for a pipeline job), fused into one array for a sweep job, and its chunks
  assigned to the shards; identical on every node.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hmp import config as config_mod
from hmp import data, models
from hmp.batching import adapter as batching_adapter
from hmp.config import Config
from hmp.errors import ConfigError
from hmp.flat import Chunk, FlatLayout
from hmp.hfta.array import FusedArray
from hmp.hfta.optim import check_settings
from hmp.pipeline.chunks import layer_aligned_layout
from hmp.placement import spec as placement_spec
from hmp.ps.sharding import ShardedModel, assign_chunks


def check(cfg: Config) -> None:
    """Every subsystem's own check of its section (after :func:`hmp.config.validate`)."""
    models.check_config(cfg)
    if cfg.sweep.members:
        try:
            check_settings(cfg.sweep.optimizer, cfg.sweep.members)
        except (TypeError, ValueError) as exc:
            raise ConfigError(cfg.path, "sweep.members", str(exc)) from None
    batching_adapter.check_config(cfg)
    placement_spec.check_config(cfg)
    check_writable_dirs(cfg)
    check_shard_share(cfg)


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
        model = models.build_model(m.name, **m.args)
    if cfg.placement.enabled:
        return layer_aligned_layout(model, cfg.ps.chunk_bytes).chunks
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
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
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


def loads(text: str, path: str = "<string>") -> Config:
    """Parse TOML text into a :class:`Config` checked by the config and by every subsystem."""
    cfg = config_mod.loads(text, path)
    check(cfg)
    return cfg


def load(path: str | os.PathLike) -> Config:
    """Load a TOML config file, checked by the config and by every subsystem."""
    cfg = config_mod.load(path)
    check(cfg)
    return cfg


def with_env(cfg: Config, environ: Mapping[str, str] | None = None) -> Config:
    """The HMP_* environment overrides applied (:data:`hmp.config.ENV_OVERRIDES`), checked again."""
    out = config_mod.env_overrides(cfg, environ)
    if out is not cfg:
        check(out)
    return out


def dataset(cfg: Config) -> data.Dataset:
    """Load ``[data]``: digits and click are built in; svmlight and npz read the user's files."""
    d = cfg.data
    spec: dict[str, Any] = {"kind": d.kind, "seed": d.seed, "test_fraction": d.test_fraction, **d.args}
    if d.kind == "click":
        spec.setdefault("n", d.samples)
    if d.path:
        spec["path"] = str(cfg.resolve(d.path))
    if d.test_path:
        spec["test_path"] = str(cfg.resolve(d.test_path))
    try:
        return data.load_dataset(spec)
    except ValueError as exc:
        raise ConfigError(cfg.path, "data", str(exc)) from None


def sharded_model(cfg: Config, device: str | torch.device = "cpu") -> ShardedModel:
    """The job's model from ``[model]`` (seeded, the global RNG untouched), over the shards' chunks."""
    m = cfg.model
    array = None
    if cfg.sweep.members:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(m.seed)
            array = FusedArray(lambda: models.build_model(m.name, **m.args), cfg.sweep.members,
                               cfg.sweep.optimizer, device)
        model = array.model
    else:
        model = models.build_model(m.name, seed=m.seed, **m.args)
    if cfg.placement.enabled:
        # Pipeline stages push their own layers' chunks: no chunk may straddle two layers.
        layout = layer_aligned_layout(model, cfg.ps.chunk_bytes)
    else:
        layout = FlatLayout.from_model(model, cfg.ps.chunk_bytes)
    model.to(device)
    return ShardedModel.of(model, layout, len(cfg.shards), array)
