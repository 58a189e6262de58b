"""A job: its config checked by every subsystem, its dataset, and its model laid out over the shards.

The one module that knows all the subsystems a job is made of (models, data, HFTA sweeps, batch
policies, the layer planner, pipelines): the daemons, the launcher and the API come here rather
than each assembling them. Below it, the subsystems know nothing of each other.

* :func:`load` / :func:`loads`: :mod:`hmp.config`'s own checks, then each subsystem's
  ``check_config`` (what only its code can judge), every error naming file and key.
* :func:`dataset`: ``[data]`` loaded (digits and click are built in; svmlight and npz read the
  user's files).
* :func:`sharded_model`: the model built from ``[model]`` with its seed, laid out in flat buffers
  (layer-aligned chunks for a pipeline job), fused into one array for a sweep job, and its chunks
  assigned to the shards; identical on every node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from hmp import config as config_mod
from hmp import data, models
from hmp.batching import adapter as batching_adapter
from hmp.config import Config
from hmp.errors import ConfigError
from hmp.flat import FlatLayout
from hmp.hfta.array import FusedArray
from hmp.hfta.optim import check_settings
from hmp.pipeline.chunks import layer_aligned_layout
from hmp.placement import spec as placement_spec
from hmp.ps.sharding import ShardedModel


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
