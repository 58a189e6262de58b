"""Model factories shared by the runtime, the planner and the benchmarks.

Every model is an ``nn.Sequential`` so that its layers can be profiled one by one
and cut into pipeline stages (HeterPS) without special cases.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


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


def build_model(name: str, **kwargs) -> nn.Sequential:
    """Build a model by registry name; unknown names list the known ones."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}") from None
    return factory(**kwargs)
