"""The placement problem and its answer, as frozen dataclasses.

A *problem* is a sequence of profiled layers, the resource types they may run on, and the
training demand (batch size, samples to train, a minimum throughput, the link bandwidth).
A *plan* maps every layer to one resource type; the cost model (``cost_model.evaluate``) turns an
assignment into a :class:`Plan` with its stages, workers, throughput and monetary cost.

Units everywhere: seconds, bytes, samples, dollars, dollars per worker-hour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

#: The label every report prints next to a resource type whose times were not measured on its
#: hardware here (scaled from the CPU reference, or measured elsewhere and given in config).
NOT_MEASURED = "NOT_MEASURED"


def _positive(value: float, what: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ResourceType:
    """One kind of worker (a CPU process, a GPU of some model) that a stage can run on.

    Attributes:
        name: unique key, used in ``LayerProfile.time_s`` and in reports.
        price_per_hour: dollars per worker-hour.
        count: workers of this type available now (0 is allowed: the type exists but none is free).
        speed_scale: how many times faster than the CPU reference this type runs a layer, either one
            number or a mapping ``{layer kind: factor}`` (kinds: ``sparse``, ``dense``,
            ``elementwise``; a missing kind uses the ``"default"`` key, else 1.0). Used only when the
            type is not measured on this machine.
        measured: True when the per-layer times come from running on this type's hardware here;
            False when they are scaled (or measured elsewhere) figures. Reports label the latter
            ``"scaled, not measured"``.
        device: the torch device a measured type is profiled on (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        overhead_s: fixed seconds per layer per batch (fwd+bwd) added to scaled times, e.g. kernel
            launches on a GPU, which scaling a CPU time cannot produce.
        source: for a type that is not measured, where its figures come from (e.g. ``"scaled from
            cpu"``, ``"times from config"``); printed after the ``NOT_MEASURED`` label.
    """

    name: str
    price_per_hour: float
    count: int
    speed_scale: float | Mapping[str, float] = 1.0
    measured: bool = True
    device: str = "cpu"
    overhead_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"resource name must be a non-empty string, got {self.name!r}")
        if not (math.isfinite(self.price_per_hour) and self.price_per_hour >= 0):
            raise ValueError(f"resource {self.name!r}: price_per_hour must be >= 0, got {self.price_per_hour!r}")
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 0:
            raise ValueError(f"resource {self.name!r}: count must be an int >= 0, got {self.count!r}")
        scales = self.speed_scale.values() if isinstance(self.speed_scale, Mapping) else [self.speed_scale]
        for s in scales:
            _positive(s, f"resource {self.name!r}: speed_scale")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ValueError(f"resource {self.name!r}: overhead_s must be >= 0, got {self.overhead_s!r}")

    def scale_for(self, kind: str) -> float:
        """The speed-up over the CPU reference for a layer of ``kind``."""
        if isinstance(self.speed_scale, Mapping):
            return float(self.speed_scale.get(kind, self.speed_scale.get("default", 1.0)))
        return float(self.speed_scale)

    @property
    def provenance(self) -> str:
        """``"measured"`` (``"measured (<source>)"`` once calibrated on the running workers) or
        ``"NOT_MEASURED (<source>)"``: the label reports print next to the type."""
        if self.measured:
            return f"measured ({self.source})" if self.source else "measured"
        return f"{NOT_MEASURED} ({self.source or 'scaled'})"


@dataclass(frozen=True)
class LayerProfile:
    """One layer's profile.

    Attributes:
        name: e.g. ``"2:Linear"``.
        kind: ``"sparse"`` (embedding lookups), ``"dense"`` (has dense parameters) or
            ``"elementwise"`` (no parameters).
        time_s: seconds per batch, forward + backward, on one worker of each resource type
            (keyed by ``ResourceType.name``), at the problem's batch size.
        out_bytes: bytes of this layer's output for one batch; the same number of gradient bytes
            flows back, so a stage boundary after this layer moves ``2 * out_bytes`` per batch.
        param_bytes: bytes of this layer's parameters (a feature for the planners; not in the cost).
    """

    name: str
    kind: str
    time_s: Mapping[str, float]
    out_bytes: int
    param_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.time_s:
            raise ValueError(f"layer {self.name!r}: time_s is empty; expected seconds per batch per resource type")
        for r, t in self.time_s.items():
            _positive(t, f"layer {self.name!r}: time_s[{r!r}]")
        if self.out_bytes < 0 or self.param_bytes < 0:
            raise ValueError(f"layer {self.name!r}: out_bytes and param_bytes must be >= 0")


@dataclass(frozen=True)
class PlacementProblem:
    """Layers, resource types and the training demand.

    Attributes:
        layers: the model's layers in forward order.
        resources: the resource types a layer may be placed on; a plan refers to them by index.
        batch_size: samples per batch (the batch the layers were profiled at).
        samples_to_train: samples the job must process; the time to train is this over throughput.
        min_throughput: samples per second the pipeline must sustain.
        bandwidth_bytes_per_s: link bandwidth between stages, bytes per second.
        name: a label for reports.
        message_overhead_s: fixed seconds per message crossing a stage boundary, whatever its size
            (encode, send, receive, decode, dispatch on the two ends); 0 (the default here) is a
            pure bandwidth link. A config (``spec.parse_spec``) defaults it to the figure measured
            on this runtime, :data:`hmp.placement.spec.DEFAULT_MESSAGE_OVERHEAD_S`.
        messages_per_batch: messages each way per boundary per batch: the runtime's micro-batches
            (each micro-batch's activations go forward in one message, its gradient back in one).
    """

    layers: tuple[LayerProfile, ...]
    resources: tuple[ResourceType, ...]
    batch_size: int
    samples_to_train: float
    min_throughput: float
    bandwidth_bytes_per_s: float
    name: str = ""
    message_overhead_s: float = 0.0
    messages_per_batch: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "resources", tuple(self.resources))
        if not self.layers:
            raise ValueError("a placement problem needs at least one layer")
        if not self.resources:
            raise ValueError("a placement problem needs at least one resource type")
        names = [r.name for r in self.resources]
        if len(set(names)) != len(names):
            raise ValueError(f"resource names must be unique, got {names}")
        for layer in self.layers:
            missing = [n for n in names if n not in layer.time_s]
            if missing:
                raise ValueError(f"layer {layer.name!r} has no time for resource types {missing}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        _positive(self.samples_to_train, "samples_to_train")
        _positive(self.min_throughput, "min_throughput (samples/s)")
        _positive(self.bandwidth_bytes_per_s, "bandwidth_bytes_per_s")
        if not (isinstance(self.message_overhead_s, (int, float)) and math.isfinite(self.message_overhead_s)
                and self.message_overhead_s >= 0):
            raise ValueError(f"message_overhead_s must be a finite number >= 0, got {self.message_overhead_s!r}")
        if not isinstance(self.messages_per_batch, int) or isinstance(self.messages_per_batch, bool) or self.messages_per_batch < 1:
            raise ValueError(f"messages_per_batch must be an int >= 1, got {self.messages_per_batch!r}")

    # Arrays for the vectorised cost model; computed once per (immutable) problem.
    @cached_property
    def times(self) -> np.ndarray:
        """``[L, R]`` float64: seconds per batch (fwd+bwd) of layer i on one worker of type r."""
        return np.array([[layer.time_s[r.name] for r in self.resources] for layer in self.layers], dtype=np.float64)

    @cached_property
    def out_bytes(self) -> np.ndarray:
        """``[L]`` float64: output bytes per batch of each layer."""
        return np.array([layer.out_bytes for layer in self.layers], dtype=np.float64)

    @cached_property
    def boundary_s(self) -> np.ndarray:
        """``[L]`` float64: seconds per batch a stage boundary right after layer i adds to *each* of
        the two stages it separates: ``2 * out_bytes[i] / bandwidth`` (activations forward, gradients
        back) plus ``2 * messages_per_batch * message_overhead_s`` (one message each way per
        micro-batch)."""
        return 2.0 * self.out_bytes / self.bandwidth_bytes_per_s + 2.0 * self.messages_per_batch * self.message_overhead_s

    @cached_property
    def param_bytes(self) -> np.ndarray:
        """``[L]`` float64: parameter bytes of each layer."""
        return np.array([layer.param_bytes for layer in self.layers], dtype=np.float64)

    @cached_property
    def prices(self) -> np.ndarray:
        """``[R]`` float64: dollars per worker-hour."""
        return np.array([r.price_per_hour for r in self.resources], dtype=np.float64)

    @cached_property
    def counts(self) -> np.ndarray:
        """``[R]`` int64: workers available per type."""
        return np.array([r.count for r in self.resources], dtype=np.int64)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_resources(self) -> int:
        return len(self.resources)

    @property
    def batch_time_budget_s(self) -> float:
        """Seconds per batch each stage may take so the pipeline meets ``min_throughput``."""
        return self.batch_size / self.min_throughput

    @property
    def plan_space_size(self) -> int:
        """Number of distinct assignments, ``R ** L``."""
        return self.n_resources**self.n_layers

    @property
    def all_measured(self) -> bool:
        return all(r.measured for r in self.resources)

    def describe_resources(self) -> list[str]:
        """One line per resource type with its price, count and provenance (measured or not)."""
        return [f"{r.name}: ${r.price_per_hour:g}/h x{r.count}, {r.provenance}" for r in self.resources]

    def with_counts(self, counts: Mapping[str, int] | Sequence[int]) -> PlacementProblem:
        """The same problem with new worker counts (workers joined or left).

        ``counts`` is either one int per resource type (in order) or a mapping from type name to
        count; types a mapping leaves out keep their count.
        """
        if isinstance(counts, Mapping):
            unknown = set(counts) - {r.name for r in self.resources}
            if unknown:
                raise ValueError(f"unknown resource types {sorted(unknown)}; expected {[r.name for r in self.resources]}")
            new = [replace(r, count=int(counts.get(r.name, r.count))) for r in self.resources]
        else:
            counts = list(counts)
            if len(counts) != self.n_resources:
                raise ValueError(f"expected {self.n_resources} counts (one per resource type), got {len(counts)}")
            new = [replace(r, count=int(c)) for r, c in zip(self.resources, counts)]
        return replace(self, resources=tuple(new))


@dataclass(frozen=True)
class Stage:
    """Consecutive layers ``[start, stop)`` on one resource type, run data-parallel by ``workers``.

    ``model[start:stop]`` is the stage's slice of an ``nn.Sequential``.

    Attributes:
        compute_s: seconds per batch of the stage's layers on one worker (sum of layer times).
        transfer_s: seconds per batch moving the boundary tensors (activations forward and
            gradients back, in and out) at the problem's bandwidth, plus the per-message overhead
            of every micro-batch crossing (``PlacementProblem.boundary_s``).
        time_s: ``compute_s / workers + transfer_s``, seconds per batch.
        throughput: ``batch_size / time_s``, samples per second.
        transfer_bound: the transfer alone exceeds the time budget; no worker count helps.
    """

    start: int
    stop: int
    resource: int
    resource_name: str
    workers: int
    compute_s: float
    transfer_s: float
    time_s: float
    throughput: float
    transfer_bound: bool = False


@dataclass(frozen=True)
class Plan:
    """An assignment of layers to resource types and what the cost model says of it.

    Attributes:
        assignment: resource index per layer.
        stages: maximal runs of consecutive layers on one type, in order.
        throughput: samples per second of the pipeline (its slowest stage).
        cost: dollars to train ``samples_to_train`` samples; ``inf`` when infeasible.
        feasible: every stage meets the throughput constraint within the available workers.
        time_to_train_s: ``samples_to_train / throughput``.
        workers_by_type: workers the plan uses per resource type.
        shortfall: 0 when feasible, else how far from feasible (see docs/placement.md); lets
            search methods prefer nearly feasible plans.
        reason: why the plan is infeasible ("" when feasible).
        planner: which planner produced it ("" when built by hand).
    """

    assignment: tuple[int, ...]
    stages: tuple[Stage, ...]
    throughput: float
    cost: float
    feasible: bool
    time_to_train_s: float
    workers_by_type: tuple[int, ...]
    shortfall: float = 0.0
    reason: str = ""
    planner: str = field(default="", compare=False)

    def describe(self, problem: PlacementProblem) -> str:
        """A few readable lines: one per stage, labelling types whose times were not measured."""
        head = (
            f"{self.planner or 'plan'}: cost ${self.cost:,.2f}, {self.throughput:,.0f} samples/s, "
            f"{'feasible' if self.feasible else 'INFEASIBLE: ' + self.reason}"
        )
        lines = [head]
        for s in self.stages:
            r = problem.resources[s.resource]
            label = "" if r.measured else f" [{r.provenance}]"
            lines.append(
                f"  layers {s.start}-{s.stop - 1} on {s.resource_name}{label} x{s.workers}: "
                f"{s.time_s * 1e3:.3f} ms/batch ({s.compute_s * 1e3:.3f} compute, {s.transfer_s * 1e3:.3f} transfer)"
            )
        return "\n".join(lines)
