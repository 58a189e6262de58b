"""The layer profiler: per-layer forward+backward seconds per batch, and boundary tensor sizes.

A model is an ordered list of layers (:func:`split_layers`), the one definition of a layer that the
plan's indices, the pipeline's stage modules (:func:`stage_module`) and its parameter chunks
(:func:`param_layers`) share. Each layer is timed on every type measured here (the median of
``reps`` passes, since a shared machine produces outliers, never speed-ups); other types are scaled
or taken from the config and labelled ``NOT_MEASURED``. See docs/placement.md, "Profiler".
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hmp.models import FieldEmbedding
from hmp.placement.problem import LayerProfile, PlacementProblem
from hmp.placement.spec import PlacementSpec, parse_spec

_SPARSE = (nn.Embedding, nn.EmbeddingBag, FieldEmbedding)


@dataclass(frozen=True)
class Layer:
    """One layer of a model cut into a sequence: ``name`` like ``"2:Linear"``, its kind and module."""

    name: str
    kind: str
    module: nn.Module


def layer_kind(module: nn.Module) -> str:
    """``"sparse"`` for embedding lookups, ``"dense"`` for other layers with parameters, else ``"elementwise"``."""
    if isinstance(module, _SPARSE):
        return "sparse"
    return "dense" if any(True for _ in module.parameters()) else "elementwise"


def split_layers(model: nn.Module) -> list[Layer]:
    """The model's layers in forward order; nested ``nn.Sequential``s are flattened.

    Only a (nested) ``nn.Sequential`` has a well-defined layer order; any other module is one layer.
    """
    modules: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if isinstance(m, nn.Sequential):
            for child in m:
                walk(child)
        else:
            modules.append(m)

    walk(model)
    if not modules:
        raise ValueError("the model has no layers (an empty nn.Sequential)")
    return [Layer(f"{i}:{type(m).__name__}", layer_kind(m), m) for i, m in enumerate(modules)]


def stage_module(model: nn.Module, start: int, stop: int) -> nn.Sequential:
    """Layers ``[start, stop)`` of :func:`split_layers` as one ``nn.Sequential`` sharing the model's modules
    (and so its parameters): what a pipeline stage running those plan layers computes."""
    layers = split_layers(model)
    if not 0 <= start < stop <= len(layers):
        raise ValueError(f"stage layers [{start}, {stop}) outside the model's {len(layers)} layers")
    return nn.Sequential(*(layer.module for layer in layers[start:stop]))


def param_layers(model: nn.Module) -> dict[str, int]:
    """Parameter name (as ``model.named_parameters()`` gives it) -> index of its layer in :func:`split_layers`.

    A parameter shared by two layers belongs to the first; a stage split between them is refused by
    the runtime's layout (the chunk would straddle two stages).
    """
    owner: dict[int, int] = {}
    for i, layer in enumerate(split_layers(model)):
        for p in layer.module.parameters():
            owner.setdefault(id(p), i)
    return {name: owner[id(p)] for name, p in model.named_parameters()}


def example_input(model: nn.Module, batch_size: int, seed: int = 0) -> torch.Tensor:
    """A batch the model accepts, built from its first layer (ids for embeddings, normal floats for Linear)."""
    first = split_layers(model)[0].module
    g = torch.Generator().manual_seed(seed)
    if isinstance(first, FieldEmbedding):
        return torch.randint(0, first.buckets, (batch_size, first.fields), generator=g)
    if isinstance(first, (nn.Embedding, nn.EmbeddingBag)):
        return torch.randint(0, first.num_embeddings, (batch_size, 1), generator=g)
    if isinstance(first, nn.Linear):
        return torch.randn(batch_size, first.in_features, generator=g)
    raise ValueError(f"cannot build an input for a model starting with {type(first).__name__}; pass example_input")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads (None: leave the setting), restoring it afterwards.

    The setting is process-wide: this is for standalone use (benchmarks, tests). The runtime passes
    None: a daemon sets its thread count once at start (``hmp.nodes.main``) and profiles and plans on
    a worker thread, where changing it would race the daemon's other torch work."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class LayerTiming:
    """Seconds per batch (forward+backward, median of the timed passes) and the output's bytes."""

    time_s: float
    out_bytes: int
    param_bytes: int


def measure_layers(layers: Sequence[Layer], x: torch.Tensor, device: str = "cpu", reps: int = 5, warmup: int = 2) -> list[LayerTiming]:
    """Time every layer's forward+backward on ``device`` for the batch ``x`` (the model's input).

    Each layer gets its predecessor's real output as input (detached; float inputs require grad
    so that the backward pass computes the input gradient a pipeline stage sends back). The
    layers' modules are copied to ``device``; the caller's model is not modified.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got {reps}, {warmup}")
    dev = torch.device(device)
    out: list[LayerTiming] = []
    h = x.to(dev)
    for layer in layers:
        module = copy.deepcopy(layer.module).to(dev)
        inp = h.detach()
        if inp.is_floating_point():
            inp.requires_grad_(True)
        y = module(inp)
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"layer {layer.name} returned {type(y).__name__}; the profiler handles one tensor per boundary")
        grad = torch.ones_like(y)
        times = []
        for k in range(warmup + reps):
            module.zero_grad(set_to_none=True)
            inp.grad = None
            _sync(dev)
            t0 = time.perf_counter()
            y = module(inp)
            if y.requires_grad:
                y.backward(grad)
            _sync(dev)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
        param_bytes = sum(_tensor_bytes(p) for p in module.parameters())
        # A timer tick can read 0 for a trivial layer; keep the time positive (the problem requires it).
        out.append(LayerTiming(max(statistics.median(times), 1e-9), _tensor_bytes(y), param_bytes))
        h = y.detach()
    return out


def profile(model: nn.Module, spec: PlacementSpec, batch: torch.Tensor | None = None, *, name: str = "") -> PlacementProblem:
    """Profile ``model`` on every measured type of ``spec`` and build the placement problem.

    Args:
        model: an ``nn.Sequential`` (see :func:`split_layers`).
        spec: resources and demand (:func:`~hmp.placement.spec.parse_spec`).
        batch: one input batch of ``spec.batch_size`` samples; default :func:`example_input`.
        name: a label for reports.
    """
    layers = split_layers(model)
    if batch is None:
        batch = example_input(model, spec.batch_size)
    if batch.shape[0] != spec.batch_size:
        raise ValueError(f"the input batch has {batch.shape[0]} samples, batch_size is {spec.batch_size}")
    measured: dict[str, list[LayerTiming]] = {}
    by_device: dict[torch.device, list[LayerTiming]] = {}  # types on one device share one measurement
    with torch_threads(spec.num_threads), torch.random.fork_rng(devices=[]):
        for r in spec.resources:
            if r.measured:
                dev = torch.device(r.device)
                if dev not in by_device:
                    by_device[dev] = measure_layers(layers, batch, r.device, spec.reps, spec.warmup)
                measured[r.name] = by_device[dev]
    if not measured:
        # Only config times: the sizes still come from a run here (on the CPU, untimed).
        measured["_sizes"] = measure_layers(layers, batch, "cpu", reps=1, warmup=0)
    reference = _cpu_reference(spec, measured)
    for r, times in spec.external_times_s.items():
        if len(times) != len(layers):
            raise ValueError(f"resource {r!r}: times_s has {len(times)} figures, the model has {len(layers)} layers")
    sizes = next(iter(measured.values()))
    profiles = []
    for i, layer in enumerate(layers):
        time_s: dict[str, float] = {}
        for r in spec.resources:
            if r.name in measured:
                time_s[r.name] = measured[r.name][i].time_s
            elif r.name in spec.external_times_s:
                time_s[r.name] = spec.external_times_s[r.name][i]
            else:
                time_s[r.name] = reference[i].time_s / r.scale_for(layer.kind) + r.overhead_s
        profiles.append(LayerProfile(layer.name, layer.kind, time_s, sizes[i].out_bytes, sizes[i].param_bytes))
    return PlacementProblem(
        layers=tuple(profiles),
        resources=spec.resources,
        batch_size=spec.batch_size,
        samples_to_train=spec.samples_to_train,
        min_throughput=spec.min_throughput,
        bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s,
        name=name,
        message_overhead_s=spec.message_overhead_s,
        messages_per_batch=spec.micro_batches,
    )


def reference_type(problem: PlacementProblem) -> str | None:
    """Name of the type scaled figures are scaled from (the first measured CPU type), if any."""
    for r in problem.resources:
        if r.measured and torch.device(r.device).type == "cpu":
            return r.name
    return None


def _cpu_reference(spec: PlacementSpec, measured: Mapping[str, list[LayerTiming]]) -> list[LayerTiming] | None:
    """The times scaled types are scaled from: the first measured type whose device is the CPU."""
    for r in spec.resources:
        if r.measured and torch.device(r.device).type == "cpu":
            return measured[r.name]
    return None


def problem_from_config(
    config: Mapping[str, object],
    model: nn.Module,
    batch: torch.Tensor | None = None,
    *,
    path: str | None = None,
    counts: Mapping[str, int] | None = None,
    name: str = "",
) -> PlacementProblem:
    """Validate a placement mapping (``spec.parse_spec``) and profile ``model`` under it.

    Errors in ``config`` raise ``ConfigError(path, key, expected)`` when ``path`` is given,
    ``ValueError`` naming the key otherwise. ``counts`` (workers per type name) overrides the
    config's counts.
    """
    spec = parse_spec(config, path=path, counts=counts)
    return profile(model, spec, batch, name=name)


def micro_batch_times(model: nn.Module, problem: PlacementProblem, batch: torch.Tensor, micro_batches: int, *,
                      reps: int = 5, warmup: int = 2) -> list[dict[str, float]]:
    """Per layer, seconds of forward+backward of one micro-batch (``batch_size / micro_batches``
    samples) on one worker of each type of ``problem``: what a pipeline stage runs per micro-batch
    (small batches compute less efficiently than ``1/m`` of a batch, so this is measured, not divided).

    Measured CPU types are timed on the first ``batch_size / micro_batches`` rows of ``batch``; a type
    measured on another device is timed there; a scaled type gets the CPU figure divided by its
    ``speed_scale`` plus ``overhead_s``; a type whose times came from the config gets them divided by
    ``micro_batches`` (the config gives batch times only)."""
    if micro_batches < 1 or problem.batch_size % micro_batches:
        raise ValueError(f"micro_batches must divide batch_size {problem.batch_size}, got {micro_batches!r}")
    layers = split_layers(model)
    if len(layers) != problem.n_layers:
        raise ValueError(f"the model has {len(layers)} layers, the problem {problem.n_layers}")
    x = batch[: problem.batch_size // micro_batches]
    by_device: dict[torch.device, list[LayerTiming]] = {}
    with torch.random.fork_rng(devices=[]):
        for r in problem.resources:
            if r.measured:
                dev = torch.device(r.device)
                if dev not in by_device:
                    by_device[dev] = measure_layers(layers, x, r.device, reps, warmup)
        cpu = by_device.get(torch.device("cpu"))
        ref = reference_type(problem)
        out: list[dict[str, float]] = [{} for _ in layers]
        for r in problem.resources:
            for i, layer in enumerate(layers):
                if r.measured:
                    t = by_device[torch.device(r.device)][i].time_s
                elif r.source.startswith("scaled") and ref is not None:
                    if cpu is None:  # the reference is measured on the CPU, so this was timed above
                        raise ValueError("a scaled type needs the CPU reference measured")
                    t = cpu[i].time_s / r.scale_for(layer.kind) + r.overhead_s
                else:
                    t = problem.layers[i].time_s[r.name] / micro_batches
                out[i][r.name] = t
    return out
