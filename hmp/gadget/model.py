"""The cluster and cost model: a ring-all-reduce job's seconds per iteration as a function of its placement.

The model (docs/gadget.md, "Cost model"), for a ring of ``w`` workers of model type ``m`` placed with
``placement[h]`` workers on host ``h``::

    iteration_s = compute_s(m) + transfer_s + latency_s
    transfer_s  = 2 (w - 1) / w * grad_bytes(m) / bottleneck_bytes_s
    latency_s   = 2 (w - 1) * hop_latency_s
    bottleneck_bytes_s = min over the ring's hops of the hop's bandwidth:
        a hop inside a host:            intra_host_bytes_s
        a hop from host a to host b:    min(share(a), share(b)),
        share(h) = link_efficiency * link_bytes_s(h) / (rings crossing h's link, this one included)

A ring spanning k >= 2 hosts is embedded with each host's workers contiguous, so it crosses each spanned
host's link once in each direction (hosts hang off one switch: ``interface.ClusterSpec``). One worker: no
communication. The 2(w-1)/w factor is the bandwidth-optimal ring all-reduce (reduce-scatter then
all-gather, each worker sends 2(w-1)/w of the gradient); 2(w-1) is its number of sequential steps.
Intra-host bandwidth is not shared between rings (each ring's hops use their own GPU pairs).

``calibrate`` fits the constants (per-model compute, intra-host bandwidth, link efficiency, hop latency) to
measured ``(placement, iteration_s)`` samples by non-negative least squares on relative error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

from .interface import ClusterSpec, Placement


@dataclasses.dataclass(frozen=True)
class ModelType:
    """A kind of training job: what one iteration of one worker costs."""

    name: str
    grad_bytes: float      # bytes all-reduced per iteration (the gradient)
    compute_s: float       # seconds of forward + backward + optimizer per iteration at local_bsz, one worker
    local_bsz: int         # samples per worker per iteration

    def __post_init__(self) -> None:
        if not (self.grad_bytes >= 0 and self.compute_s > 0 and self.local_bsz >= 1):
            raise ValueError(f"model type {self.name!r}: need grad_bytes >= 0, compute_s > 0, local_bsz >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class NetworkConstants:
    """The cluster-wide constants of the cost model (host link bandwidths are in ``ClusterSpec``)."""

    intra_host_bytes_s: float        # a hop between two workers of one host
    hop_latency_s: float = 0.0       # per sequential ring step (2(w-1) steps per all-reduce)
    link_efficiency: float = 1.0     # fraction of a host link's nominal bytes/s one ring achieves alone

    def __post_init__(self) -> None:
        if not (self.intra_host_bytes_s > 0 and self.hop_latency_s >= 0 and self.link_efficiency > 0):
            raise ValueError(f"need intra_host_bytes_s > 0, hop_latency_s >= 0, link_efficiency > 0, got {self}")


@dataclasses.dataclass(frozen=True)
class IterationBreakdown:
    compute_s: float
    transfer_s: float
    latency_s: float
    bottleneck_bytes_s: float    # inf for a single worker (no hop)
    hosts_spanned: int

    @property
    def total_s(self) -> float:
        return self.compute_s + self.transfer_s + self.latency_s


def ring_factor(workers: int) -> float:
    """Fraction of the gradient each worker sends in a ring all-reduce: 2(w-1)/w."""
    return 2.0 * (workers - 1) / workers


class RingCostModel:
    """Implements ``interface.CostModel`` for one cluster, a set of model types and network constants."""

    def __init__(self, cluster: ClusterSpec, models: Iterable[ModelType], network: NetworkConstants) -> None:
        self.cluster = cluster
        self.network = network
        self.models: dict[str, ModelType] = {}
        for m in models:
            if m.name in self.models:
                raise ValueError(f"model type {m.name!r} given twice")
            self.models[m.name] = m
        self._link_bytes_s = tuple(h.link_bytes_s for h in cluster.hosts)
        if any(b <= 0 for b in self._link_bytes_s):
            raise ValueError("every host link needs bytes/s > 0")

    def with_models(self, models: Iterable[ModelType]) -> RingCostModel:
        """The same cluster and network with these model types added (or replaced by name)."""
        merged = dict(self.models)
        merged.update({m.name: m for m in models})
        return RingCostModel(self.cluster, merged.values(), self.network)

    def with_network(self, network: NetworkConstants) -> RingCostModel:
        return RingCostModel(self.cluster, self.models.values(), network)

    def with_cluster(self, cluster: ClusterSpec) -> RingCostModel:
        return RingCostModel(cluster, self.models.values(), self.network)

    def model_type(self, name: str) -> ModelType:
        try:
            return self.models[name]
        except KeyError:
            raise KeyError(f"unknown model type {name!r}; known: {sorted(self.models)}") from None

    # --- link load -------------------------------------------------------------------------------------

    def link_rings(self, placements: Iterable[Placement]) -> list[int]:
        """Rings crossing each host's link among ``placements`` (a ring on one host crosses none)."""
        counts = [0] * len(self.cluster.hosts)
        for p in placements:
            if sum(1 for c in p if c) >= 2:
                for h, c in enumerate(p):
                    if c:
                        counts[h] += 1
        return counts

    # --- iteration time --------------------------------------------------------------------------------

    def breakdown_loaded(self, model: str, placement: Placement, link_rings: Sequence[int], *,
                         counted: bool = False, extra: Placement | None = None) -> IterationBreakdown:
        """Like :meth:`breakdown`, given the rings crossing each host link as counts: the *other* rings,
        or (``counted=True``) all rings including this one; ``extra``: one more ring about to start."""
        mt = self.model_type(model)
        if len(placement) != len(self._link_bytes_s):
            raise ValueError(f"placement {placement} has {len(placement)} hosts, the cluster {len(self._link_bytes_s)}")
        workers = 0
        spanned: list[int] = []
        intra_hop = False
        for h, c in enumerate(placement):  # one pass: placements are long and mostly zeros
            if c:
                workers += c
                spanned.append(h)
                if c >= 2:
                    intra_hop = True
        if workers < 1 or any(placement[h] < 0 for h in spanned):
            raise ValueError(f"placement {placement}: counts must be >= 0 with at least one worker")
        if workers == 1:
            return IterationBreakdown(mt.compute_s, 0.0, 0.0, math.inf, 1)
        bottleneck = self.network.intra_host_bytes_s if intra_hop else math.inf
        if len(spanned) >= 2:
            eff = self.network.link_efficiency
            own = 0 if counted else 1
            extra_hosts = extra is not None and sum(1 for c in extra if c) >= 2
            for h in spanned:
                n = link_rings[h] + own + (1 if extra_hosts and extra[h] else 0)  # type: ignore[index]
                bottleneck = min(bottleneck, eff * self._link_bytes_s[h] / n)
        transfer = ring_factor(workers) * mt.grad_bytes / bottleneck
        latency = 2 * (workers - 1) * self.network.hop_latency_s
        return IterationBreakdown(mt.compute_s, transfer, latency, bottleneck, len(spanned))

    def breakdown(self, model: str, placement: Placement,
                  others: Sequence[tuple[str, Placement]] = ()) -> IterationBreakdown:
        return self.breakdown_loaded(model, placement, self.link_rings(p for _, p in others))

    def iteration_s(self, model: str, placement: Placement, others: Sequence[tuple[str, Placement]] = ()) -> float:
        return self.breakdown(model, placement, others).total_s

    def iteration_s_loaded(self, model: str, placement: Placement, link_rings: Sequence[int], *,
                           counted: bool = False, extra: Placement | None = None) -> float:
        """Fast path for schedulers and the simulator: ``link_rings`` counts the other rings per host link
        (with ``counted=True``: all rings, this one included); ``extra``: a ring about to start."""
        return self.breakdown_loaded(model, placement, link_rings, counted=counted, extra=extra).total_s

    def samples_per_iteration(self, model: str, workers: int) -> float:
        return float(workers * self.model_type(model).local_bsz)

    def throughput(self, model: str, placement: Placement, others: Sequence[tuple[str, Placement]] = ()) -> float:
        """Samples per second."""
        return self.samples_per_iteration(model, sum(placement)) / self.iteration_s(model, placement, others)

    def compact_placement(self, workers: int) -> Placement:
        """The placement a job gets alone on an empty cluster: fill the largest hosts first, fewest hosts."""
        if not 1 <= workers <= self.cluster.total_slots:
            raise ValueError(f"{workers} workers do not fit a cluster of {self.cluster.total_slots} slots")
        order = sorted(range(len(self.cluster.hosts)), key=lambda h: (-self.cluster.hosts[h].slots, h))
        counts = [0] * len(self.cluster.hosts)
        left = workers
        for h in order:
            take = min(left, self.cluster.hosts[h].slots)
            counts[h], left = take, left - take
            if left == 0:
                break
        return tuple(counts)



# --- calibration -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IterationSample:
    """One measurement: a ring of ``model`` on ``placement`` took ``iteration_s`` while ``others`` ran."""

    model: str
    placement: Placement
    iteration_s: float
    others: tuple[tuple[str, Placement], ...] = ()


@dataclasses.dataclass(frozen=True)
class Calibration:
    cost: RingCostModel                 # the fitted model
    relative_errors: tuple[float, ...]  # |predicted - measured| / measured, one per sample, in input order
    median_relative_error: float
    p90_relative_error: float
    fitted: tuple[str, ...]             # which constants were fitted (the others kept their prior value)


def relative_error_summary(errors: Sequence[float]) -> tuple[float, float]:
    """(median, p90) of relative errors."""
    arr = np.asarray(errors, dtype=float)
    return float(np.median(arr)), float(np.percentile(arr, 90))


def calibrate(prior: RingCostModel, samples: Sequence[IterationSample], *, fit_compute: bool = True) -> Calibration:
    """Fit the cost model's constants to measured iteration times; ``prior`` gives the cluster, the model
    types (their ``grad_bytes`` and ``local_bsz`` are kept: they are known, not measured) and the starting
    constants.

    The model is linear in (compute_s per model, 1/intra_host_bytes_s, 1/link_efficiency, hop_latency_s),
    so the fit is one non-negative least-squares solve, each row divided by its measured time so that the
    fit minimises squared *relative* error. A constant no sample informs (e.g. the intra-host bandwidth
    when no sample has two workers on one host) keeps its prior value.
    """
    if not samples:
        raise ValueError("calibrate needs at least one sample")
    for i, s in enumerate(samples):
        if not s.iteration_s > 0:
            raise ValueError(f"sample {i}: iteration_s must be > 0, got {s.iteration_s}")
    # Which hop is a ring's bottleneck (intra-host or a shared link) depends on the constants being
    # fitted: classify with the current constants, fit, re-classify with the fit; stop when stable.
    current = prior
    classes: list[bool] | None = None
    result: Calibration | None = None
    for _ in range(8):
        new_classes = [_link_bound(current, s) for s in samples]
        if new_classes == classes:
            break
        classes = new_classes
        result = _fit_once(prior, samples, classes, fit_compute)
        current = result.cost
    assert result is not None
    return result


def _link_bound(cost: RingCostModel, s: IterationSample) -> bool:
    b = cost.breakdown(s.model, s.placement, s.others)
    return b.hosts_spanned >= 2 and b.bottleneck_bytes_s <= cost.network.intra_host_bytes_s


def _fit_once(prior: RingCostModel, samples: Sequence[IterationSample], link_bound: Sequence[bool],
              fit_compute: bool) -> Calibration:
    model_names = sorted({s.model for s in samples}) if fit_compute else []
    col_of = {name: i for i, name in enumerate(model_names)}
    n_model_cols = len(model_names)
    # columns: compute per model | x_intra = 1/intra_bw | x_link = 1/link_efficiency | latency
    cols = n_model_cols + 3
    rows = np.zeros((len(samples), cols))
    target = np.zeros(len(samples))
    for i, s in enumerate(samples):
        mt = prior.model_type(s.model)
        y = s.iteration_s
        if fit_compute:
            rows[i, col_of[s.model]] = 1.0
        else:
            y -= mt.compute_s
        w = sum(s.placement)
        if w >= 2:
            grad = ring_factor(w) * mt.grad_bytes
            if link_bound[i]:
                # bottleneck = eff * min_h(bw_h / n_h)  ->  transfer = grad * max_h(n_h / bw_h) * (1 / eff)
                counts = prior.link_rings(p for _, p in s.others)
                worst = max((counts[h] + 1) / prior.cluster.hosts[h].link_bytes_s
                            for h, c in enumerate(s.placement) if c)
                rows[i, n_model_cols + 1] = grad * worst
            else:
                rows[i, n_model_cols] = grad
            rows[i, n_model_cols + 2] = 2 * (w - 1)
        weight = 1.0 / s.iteration_s
        rows[i] *= weight
        target[i] = y * weight
    informed = [j for j in range(cols) if np.any(rows[:, j] != 0)]
    # Constants no sample informs keep their prior: move their contribution to the target.
    prior_values = np.zeros(cols)
    for name, j in col_of.items():
        prior_values[j] = prior.model_type(name).compute_s
    prior_values[n_model_cols] = 1.0 / prior.network.intra_host_bytes_s
    prior_values[n_model_cols + 1] = 1.0 / prior.network.link_efficiency
    prior_values[n_model_cols + 2] = prior.network.hop_latency_s
    fixed = [j for j in range(cols) if j not in informed]
    adjusted = target - rows[:, fixed] @ prior_values[fixed] if fixed else target
    solution, _ = nnls(rows[:, informed], adjusted)
    values = prior_values.copy()
    values[informed] = solution
    names = [*(f"compute_s[{n}]" for n in model_names), "intra_host_bytes_s", "link_efficiency", "hop_latency_s"]
    tiny = 1e-18  # 1/x with x = 0 means "infinitely fast": keep it finite
    net = prior.network
    network = NetworkConstants(
        intra_host_bytes_s=float(1.0 / max(values[n_model_cols], tiny)) if n_model_cols in informed else net.intra_host_bytes_s,
        hop_latency_s=float(values[n_model_cols + 2]) if n_model_cols + 2 in informed else net.hop_latency_s,
        link_efficiency=float(1.0 / max(values[n_model_cols + 1], tiny)) if n_model_cols + 1 in informed else net.link_efficiency,
    )
    models = []
    for name, mt in prior.models.items():
        if name in col_of:
            mt = dataclasses.replace(mt, compute_s=max(float(values[col_of[name]]), 1e-9))
        models.append(mt)
    fitted_cost = RingCostModel(prior.cluster, models, network)
    errors = tuple(abs(fitted_cost.iteration_s(s.model, s.placement, s.others) - s.iteration_s) / s.iteration_s
                   for s in samples)
    med, p90 = relative_error_summary(errors)
    return Calibration(fitted_cost, errors, med, p90, tuple(names[j] for j in informed))


def uniform_cluster(hosts: int, slots: int, link_bytes_s: float, prefix: str = "h") -> ClusterSpec:
    """``hosts`` identical hosts of ``slots`` worker slots on one switch."""
    from .interface import HostSpec

    return ClusterSpec(tuple(HostSpec(f"{prefix}{i}", slots, link_bytes_s) for i in range(hosts)))


def placement_from_mapping(cluster: ClusterSpec, workers_by_host: Mapping[str, int]) -> Placement:
    """A placement from {host name: workers}; unknown host names raise."""
    index = {h.name: i for i, h in enumerate(cluster.hosts)}
    counts = [0] * len(cluster.hosts)
    for name, n in workers_by_host.items():
        if name not in index:
            raise KeyError(f"unknown host {name!r}; hosts: {list(index)}")
        counts[index[name]] = n
    return tuple(counts)
