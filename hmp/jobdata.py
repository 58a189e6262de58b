"""The job's dataset, from the config's ``[data]`` section (the loaders live in :mod:`hmp.data`)."""

from __future__ import annotations

from typing import Any

from hmp.config import Config
from hmp.errors import ConfigError


def load_dataset_from_config(cfg: Config):
    """Load ``[data]``: digits and click are built in; svmlight and npz read the user's files."""
    from hmp import data

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
