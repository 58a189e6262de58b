"""The model's parameter plan, identical on every node: layout, chunks and their shards.

Every node builds the model from the config with the same seed, lays its parameters out in flat
buffers and places the chunks with the same deterministic greedy placement, so no node needs to
be told where a chunk lives.
"""

from __future__ import annotations

import dataclasses
from typing import Any


import torch
from torch import nn

from hmp.config import Config
from hmp.models import build_model
from hmp.ps.layout import Chunk, FlatBuffers, FlatLayout, chunk_views, place_chunks, placement_report


@dataclasses.dataclass
class ModelPlan:
    model: nn.Module
    layout: FlatLayout
    flat: FlatBuffers  # the model's parameters and gradients live here
    placement: dict[int, list[int]]  # shard index -> chunk keys
    array: Any = None  # a FusedArray when the job is an HFTA sweep; ``model`` is then its fused model

    @classmethod
    def from_config(cls, cfg: Config, device: str | torch.device = "cpu") -> ModelPlan:
        torch.manual_seed(cfg.model.seed)
        array = None
        if cfg.sweep.members:
            from hmp.kernels.fused.array import FusedArray

            array = FusedArray(lambda: build_model(cfg.model.name, **cfg.model.args), cfg.sweep.members,
                               cfg.sweep.optimizer, device)
            model = array.model
        else:
            model = build_model(cfg.model.name, **cfg.model.args)
        if cfg.placement.enabled:
            # Pipeline stages push their own layers' chunks: no chunk may straddle two layers.
            from hmp.pipeline.layout import layer_aligned_layout

            layout = layer_aligned_layout(model, cfg.ps.chunk_bytes)
        else:
            layout = FlatLayout.from_model(model, cfg.ps.chunk_bytes)
        model.to(device)
        flat = layout.bind(model)
        placement = place_chunks(layout.chunks, len(cfg.shards))
        return cls(model, layout, flat, placement, array)

    @property
    def chunks(self) -> dict[int, Chunk]:
        return {c.key: c for c in self.layout.chunks}

    def initial_chunks(self, shard_index: int) -> dict[int, torch.Tensor]:
        views = self.param_views()
        return {k: views[k].detach().cpu() for k in self.placement[shard_index]}

    def param_views(self) -> dict[int, torch.Tensor]:
        """``{chunk key: 1-D view}`` into the flat parameter buffers (no copies)."""
        return chunk_views(self.flat.params, self.layout.chunks)

    def grad_views(self) -> dict[int, torch.Tensor]:
        """``{chunk key: 1-D view}`` into the flat gradient buffers (no copies)."""
        return chunk_views(self.flat.grads, self.layout.chunks)

    def report(self) -> Any:
        return placement_report(self.layout.chunks, self.placement)
