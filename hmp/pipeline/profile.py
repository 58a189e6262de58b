"""Profile a sequential model layer by layer on this CPU and build the placement problem.

This is the one place the runtime turns a model and the ``[placement]`` config into a
:class:`~hmp.sched.placement.problem.PlacementProblem` (swap it for the planner package's own
profiler once that exists). Per layer: forward + backward seconds per batch at the job's batch
size (median of ``repeats`` timed runs after one warm-up), output bytes, parameter bytes and a
kind (``sparse``: embedding lookups, ``dense``: other layers with parameters, ``elementwise``).
A resource type marked ``measured`` runs as a process like the one profiled here, so its times
are the profile's; any other type's times are the profile divided by its ``speed_scale`` for the
layer's kind, and reports label it "scaled, not measured".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hmp.sched.placement.problem import LayerProfile, PlacementProblem, ResourceType

#: Times below this are clamped (a planner needs times > 0; a timer tick is about this).
MIN_LAYER_S = 1e-6


@dataclass(frozen=True)
class LayerTiming:
    name: str
    kind: str
    seconds: float  # forward + backward per batch, this CPU
    out_bytes: int
    param_bytes: int


def layer_kind(layer: nn.Module) -> str:
    if any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in layer.modules()):
        return "sparse"
    return "dense" if any(True for _ in layer.parameters()) else "elementwise"


def profile_layers(model: nn.Sequential, batch: torch.Tensor, repeats: int = 5) -> list[LayerTiming]:
    """Time every layer of ``model`` on ``batch`` (its input), forward and backward, one by one."""
    out: list[LayerTiming] = []
    x = batch
    for i, layer in enumerate(model):
        times = []
        for r in range(repeats + 1):
            inp = x.detach().requires_grad_() if x.is_floating_point() else x
            t0 = time.perf_counter()
            y = layer(inp)
            y.backward(torch.ones_like(y))
            if r:  # the first run warms caches and allocators
                times.append(time.perf_counter() - t0)
        layer.zero_grad(set_to_none=True)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        out.append(LayerTiming(f"{i}:{layer.__class__.__name__}", layer_kind(layer),
                               max(MIN_LAYER_S, statistics.median(times)), y.numel() * y.element_size(), params))
        x = y.detach()
    return out


def resource_types(resources: Sequence[Mapping[str, Any]], counts: Mapping[str, int]) -> tuple[ResourceType, ...]:
    """``[placement] resources`` tables as resource types with the given worker counts."""
    return tuple(ResourceType(name=r["name"], price_per_hour=float(r.get("price_per_hour", 0.0)),
                              count=int(counts.get(r["name"], 0)), speed_scale=r.get("speed_scale", 1.0),
                              measured=bool(r.get("measured", True))) for r in resources)


def build_problem(timings: Sequence[LayerTiming], resources: Sequence[ResourceType], *, batch_size: int,
                  samples_to_train: float, min_throughput: float, bandwidth_bytes_per_s: float,
                  name: str = "") -> PlacementProblem:
    """The placement problem of profiled layers on ``resources`` (see the module docstring)."""
    layers = []
    for t in timings:
        time_s = {r.name: t.seconds if r.measured else t.seconds / r.scale_for(t.kind) + r.overhead_s
                  for r in resources}
        layers.append(LayerProfile(name=t.name, kind=t.kind, time_s=time_s, out_bytes=t.out_bytes,
                                   param_bytes=t.param_bytes))
    return PlacementProblem(layers=tuple(layers), resources=tuple(resources), batch_size=batch_size,
                            samples_to_train=samples_to_train, min_throughput=min_throughput,
                            bandwidth_bytes_per_s=bandwidth_bytes_per_s, name=name)
