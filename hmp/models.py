"""Model factories shared by the runtime, the planner and the benchmarks.

Every model is an ``nn.Sequential`` so that its layers can be profiled one by one
and cut into pipeline stages (HeterPS) without special cases.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from hmp.config import Config
from hmp.errors import ConfigError


class FieldEmbedding(nn.Module):
    """Hashed categorical features to one dense vector per example.

    Input ``[N, F]`` int64 bucket ids (one per field, already hashed into
    ``buckets``); output ``[N, F * dim]``: each field looked up in its own table,
    concatenated. The tables are one ``nn.Embedding`` of ``F * buckets`` rows so the
    PS sees a single large (sparse-ish) parameter.
    """

    def __init__(self, fields: int, buckets: int, dim: int) -> None:
        super().__init__()
        self.fields, self.buckets, self.dim = fields, buckets, dim
        self.table = nn.Embedding(fields * buckets, dim)
        nn.init.normal_(self.table.weight, std=0.05)
        self.register_buffer("offsets", torch.arange(fields, dtype=torch.int64) * buckets, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids + self.offsets).flatten(1)


def mlp(in_features: int, hidden: Sequence[int], out_features: int) -> nn.Sequential:
    """A ReLU MLP as a flat ``nn.Sequential`` (Linear, ReLU, ..., Linear)."""
    layers: list[nn.Module] = []
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


def digits_mlp(hidden: Sequence[int] = (128, 64)) -> nn.Sequential:
    """MLP for scikit-learn's digits: ``[N, 64]`` float32 in, ``[N, 10]`` logits out."""
    return mlp(64, hidden, 10)


def click_model(fields: int = 8, buckets: int = 1000, dim: int = 16, hidden: Sequence[int] = (64, 32)) -> nn.Sequential:
    """Sparse click-through model: ``[N, fields]`` int64 ids in, ``[N, 2]`` logits out."""
    return nn.Sequential(FieldEmbedding(fields, buckets, dim), *mlp(fields * dim, hidden, 2))


def deep_mlp(in_features: int = 256, width: int = 512, depth: int = 8, classes: int = 10) -> nn.Sequential:
    """A deeper dense MLP, the second placement workload."""
    return mlp(in_features, [width] * depth, classes)


MODELS = {"digits_mlp": digits_mlp, "click_model": click_model, "deep_mlp": deep_mlp}


def build_model(name: str, seed: int | None = None, **kwargs) -> nn.Sequential:
    """Build a model by registry name; unknown names list the known ones.

    With ``seed``, the initial parameters come from that seed (every node builds the same model)
    without touching the global torch RNG: the caller's random stream is left as it was.
    """
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}") from None
    if seed is None:
        return factory(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(**kwargs)


def check_config(cfg: Config) -> None:
    """``[model]``: the name is known and the factory accepts the arguments. The model is built on the
    meta device (no memory, no initialisation), so a bad value fails at load with file and key."""
    p, m = cfg.path, cfg.model
    factory = MODELS.get(m.name)
    if factory is None:
        raise ConfigError(p, "model.name", f"one of {sorted(MODELS)}, got {m.name!r}")
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. torch's warning about a zero-element init
            factory(**m.args)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise ConfigError(p, "model.args", f"arguments that {m.name}() accepts ({exc})") from None
