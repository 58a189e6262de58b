"""The cluster and cost model: a ring-all-reduce job's seconds per iteration as a function of its placement.

The scheduler simulations need to time a placement without running it: the model charges compute,
the ring's transfer at its bottleneck hop (a host's link shared by the rings crossing it) and the
per-hop latency, optionally with shared compute pools and partial link sharing. ``calibrate`` fits
its constants to measured ``(placement, iteration_s)`` samples. The formulas and the fit are in
docs/gadget.md, "Cost model".
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
    # n rings on a link: each gets link_efficiency * bw / (1 + link_sharing * (n - 1)); 1 = the fair share bw / n
    link_sharing: float = 1.0
    # the cores a compute pool's workers get: core_efficiency * ClusterSpec.pool_cores (no pools: unused)
    core_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if not (self.intra_host_bytes_s > 0 and self.hop_latency_s >= 0 and self.link_efficiency > 0
                and 0 <= self.link_sharing and self.core_efficiency > 0):
            raise ValueError(f"need intra_host_bytes_s > 0, hop_latency_s >= 0, link_efficiency > 0, "
                             f"link_sharing >= 0, core_efficiency > 0, got {self}")


@dataclasses.dataclass(frozen=True)
class IterationBreakdown:
    compute_s: float
    transfer_s: float
    latency_s: float
    bottleneck_bytes_s: float    # inf for a single worker (no hop)
    hosts_spanned: int
    cpu_stretch: float = 1.0     # compute_s is the model's compute times this (shared compute pools; 1: none)

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
        # compute pools: index per host (-1: none), member hosts and cores per pool
        names = [name for name, _ in cluster.pool_cores]
        self.pool_of: tuple[int, ...] = tuple(names.index(h.pool) if h.pool is not None else -1 for h in cluster.hosts)
        self.pool_hosts: tuple[tuple[int, ...], ...] = tuple(
            tuple(h for h, p in enumerate(self.pool_of) if p == i) for i in range(len(names)))
        self._pool_cores = tuple(c for _, c in cluster.pool_cores)
        self._cpu_share: dict[tuple[str, Placement], float] = {}

    @property
    def shares_compute(self) -> bool:
        """Whether some hosts share a compute pool (then a ring's speed depends on every ring in its pools)."""
        return any(p >= 0 for p in self.pool_of)

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

    def cpu_share(self, model: str, placement: Placement) -> float:
        """The fraction of an iteration a worker of this ring computes, the ring alone (no other ring, no
        compute stretch): ``compute_s / (compute_s + transfer_s + latency_s)``; 1 for a single worker."""
        key = (model, placement)
        u = self._cpu_share.get(key)
        if u is None:
            c = self.model_type(model).compute_s
            b = self._breakdown(model, placement, [0] * len(self._link_bytes_s), False, None, 1.0)
            u = self._cpu_share[key] = c / (c + b.transfer_s + b.latency_s)
        return u

    def cpu_demand(self, rings: Iterable[tuple[str, Placement]]) -> list[float]:
        """CPU demand per host of ``rings`` (model, placement): each worker counts its ring's :meth:`cpu_share`."""
        demand = [0.0] * len(self.cluster.hosts)
        for m, p in rings:
            u = self.cpu_share(m, p)
            for h, c in enumerate(p):
                if c:
                    demand[h] += u * c
        return demand

    def cpu_stretch(self, model: str, placement: Placement, busy: Sequence[float] | None = None,
                    extra: Placement | None = None, extra_model: str | None = None) -> float:
        """How much a ring of ``model`` on ``placement`` has its compute stretched: over the pools it uses,
        the largest ``max(1, demand on the pool / (core_efficiency * cores))``, the demand being this ring's,
        the other rings' (``busy``, per host, e.g. :meth:`cpu_demand`) and ``extra``'s (its workers count
        ``extra_model``'s CPU share, or 1 each if not given). 1 on hosts in no pool."""
        stretch = 1.0
        seen: set[int] = set()
        u = u_extra = 0.0
        for h, c in enumerate(placement):
            pool = self.pool_of[h] if c else -1
            if pool < 0 or pool in seen:
                continue
            if not seen:
                u = self.cpu_share(model, placement)
                if extra is not None:
                    u_extra = self.cpu_share(extra_model, extra) if extra_model is not None else 1.0
            seen.add(pool)
            load = 0.0
            for g in self.pool_hosts[pool]:
                load += u * placement[g] + (busy[g] if busy is not None else 0.0) \
                    + (u_extra * extra[g] if extra is not None else 0.0)
            stretch = max(stretch, load / (self.network.core_efficiency * self._pool_cores[pool]))
        return stretch

    # --- iteration time --------------------------------------------------------------------------------

    def breakdown_loaded(self, model: str, placement: Placement, link_rings: Sequence[int], *,
                         counted: bool = False, extra: Placement | None = None,
                         busy: Sequence[float] | None = None, extra_model: str | None = None) -> IterationBreakdown:
        """Like :meth:`breakdown`, given the rings crossing each host link as counts: the *other* rings,
        or (``counted=True``) all rings including this one; ``extra``: one more ring about to start (of
        ``extra_model``, if known); ``busy``: the other rings' CPU demand per host (:meth:`cpu_demand`;
        shared compute pools only; None: none counted)."""
        stretch = 1.0
        if self.shares_compute and len(placement) == len(self._link_bytes_s):  # (a bad length: _breakdown says so)
            stretch = self.cpu_stretch(model, placement, busy, extra, extra_model)
        return self._breakdown(model, placement, link_rings, counted, extra, stretch)

    def _breakdown(self, model: str, placement: Placement, link_rings: Sequence[int], counted: bool,
                   extra: Placement | None, stretch: float) -> IterationBreakdown:
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
        compute = mt.compute_s * stretch
        if workers == 1:
            return IterationBreakdown(compute, 0.0, 0.0, math.inf, 1, stretch)
        bottleneck = self.network.intra_host_bytes_s if intra_hop else math.inf
        if len(spanned) >= 2:
            eff = self.network.link_efficiency
            beta = self.network.link_sharing
            own = 0 if counted else 1
            extra_hosts = extra is not None and sum(1 for c in extra if c) >= 2
            for h in spanned:
                n = link_rings[h] + own + (1 if extra_hosts and extra[h] else 0)  # type: ignore[index]
                share = n if beta == 1.0 else 1.0 + beta * (n - 1)
                bottleneck = min(bottleneck, eff * self._link_bytes_s[h] / share)
        transfer = ring_factor(workers) * mt.grad_bytes / bottleneck
        latency = 2 * (workers - 1) * self.network.hop_latency_s
        return IterationBreakdown(compute, transfer, latency, bottleneck, len(spanned), stretch)

    def breakdown(self, model: str, placement: Placement,
                  others: Sequence[tuple[str, Placement]] = ()) -> IterationBreakdown:
        busy = self.cpu_demand(others) if self.shares_compute else None
        return self.breakdown_loaded(model, placement, self.link_rings(p for _, p in others), busy=busy)

    def iteration_s(self, model: str, placement: Placement, others: Sequence[tuple[str, Placement]] = ()) -> float:
        return self.breakdown(model, placement, others).total_s

    def iteration_s_loaded(self, model: str, placement: Placement, link_rings: Sequence[int], *,
                           counted: bool = False, extra: Placement | None = None,
                           busy: Sequence[float] | None = None, extra_model: str | None = None) -> float:
        """Fast path for schedulers and the simulator: ``link_rings`` counts the other rings per host link
        (with ``counted=True``: all rings, this one included); ``extra``: a ring about to start (of
        ``extra_model``); ``busy``: the other rings' CPU demand per host (:meth:`cpu_demand`; matters only
        if hosts share compute pools)."""
        return self.breakdown_loaded(model, placement, link_rings, counted=counted, extra=extra, busy=busy,
                                     extra_model=extra_model).total_s

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

Others = tuple[tuple[str, Placement], ...]


@dataclasses.dataclass(frozen=True)
class IterationSample:
    """One measurement: a ring of ``model`` on ``placement`` took ``iteration_s`` while ``others`` ran.

    Added (default: none): ``segments``, the stretches of the ring's run as (seconds, the other rings running
    then); when given, the model's prediction for the sample is its iteration time averaged over them,
    weighted by their seconds (:func:`predict_sample`), and ``others`` is not used."""

    model: str
    placement: Placement
    iteration_s: float
    others: Others = ()
    segments: tuple[tuple[float, Others], ...] = ()

    def weighted_others(self) -> list[tuple[float, Others]]:
        """(weight, others) summing to 1: the segments, or ``others`` alone."""
        span = sum(d for d, _ in self.segments)
        if not self.segments or span <= 0:
            return [(1.0, self.others)]
        return [(d / span, o) for d, o in self.segments]


def predict_sample(cost: RingCostModel, s: IterationSample) -> float:
    """The model's iteration time for a sample: over its segments (weighted by seconds), else with ``others``."""
    return sum(w * cost.iteration_s(s.model, s.placement, o) for w, o in s.weighted_others())


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


#: calibrate's grid for NetworkConstants.core_efficiency (pools' effective cores = this x their cores)
CORE_EFFICIENCY_GRID = (0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
#: calibrate's grid for NetworkConstants.link_sharing (fit_link_sharing=True)
LINK_SHARING_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def calibrate(prior: RingCostModel, samples: Sequence[IterationSample], *, fit_compute: bool = True,
              fit_cores: bool = True, fit_link_sharing: bool = False, robust: bool = False) -> Calibration:
    """Fit the cost model's constants to measured iteration times; ``prior`` gives the cluster, the model
    types (their ``grad_bytes`` and ``local_bsz`` are kept: they are known, not measured) and the starting
    constants.

    The model is linear in (compute_s per model, 1/intra_host_bytes_s, 1/link_efficiency, hop_latency_s)
    once ``core_efficiency`` and ``link_sharing`` are fixed, so each fit is one non-negative least-squares
    solve, each row divided by its measured time so that the fit minimises squared *relative* error
    (``robust=True``: absolute relative error, by iteratively reweighted least squares, so that a few
    outliers do not drag the fit). A constant no sample informs (e.g. the intra-host bandwidth when no
    sample has two workers on one host) keeps its prior value. ``fit_cores`` (clusters with compute pools
    only) and ``fit_link_sharing``: those two constants by grid search (:data:`CORE_EFFICIENCY_GRID`,
    :data:`LINK_SHARING_GRID`), the point with the lowest loss kept (ties: the prior's value).
    """
    if not samples:
        raise ValueError("calibrate needs at least one sample")
    for i, s in enumerate(samples):
        if not s.iteration_s > 0:
            raise ValueError(f"sample {i}: iteration_s must be > 0, got {s.iteration_s}")
    net = prior.network
    cores_grid = [net.core_efficiency]
    if fit_cores and prior.shares_compute:
        cores_grid += [c for c in CORE_EFFICIENCY_GRID if c != net.core_efficiency]
    sharing_grid = [net.link_sharing]
    if fit_link_sharing:
        sharing_grid += [b for b in LINK_SHARING_GRID if b != net.link_sharing]
    best: tuple[float, Calibration] | None = None
    for ce in cores_grid:
        for beta in sharing_grid:
            start = prior.with_network(dataclasses.replace(net, core_efficiency=ce, link_sharing=beta))
            result, loss = _calibrate_fixed(start, samples, fit_compute, robust)
            if best is None or loss < best[0] - 1e-12:
                best = (loss, result)
    assert best is not None
    result = best[1]
    extra_names = (("core_efficiency",) if len(cores_grid) > 1 else ()) + (("link_sharing",) if len(sharing_grid) > 1 else ())
    return dataclasses.replace(result, fitted=result.fitted + extra_names)


def _calibrate_fixed(prior: RingCostModel, samples: Sequence[IterationSample], fit_compute: bool,
                     robust: bool) -> tuple[Calibration, float]:
    # Which hop is a ring's bottleneck (intra-host or a shared link) depends on the constants being
    # fitted: classify with the current constants, fit, re-classify with the fit; stop when stable.
    # The compute stretches (CPU shares) depend on them too: taken from the current constants likewise (at
    # least 3 passes when hosts share compute pools).
    current = prior
    classes: list[list[bool]] | None = None
    result: Calibration | None = None
    for k in range(8):
        new_classes = [[_link_bound(current, s.model, s.placement, o) for _, o in s.weighted_others()] for s in samples]
        if new_classes == classes and (k >= 3 or not prior.shares_compute):
            break
        classes = new_classes
        result = _fit_once(prior, samples, classes, fit_compute, robust, current)
        current = result.cost
    assert result is not None
    errors = np.asarray(result.relative_errors)
    loss = float(np.sum(errors)) if robust else float(np.sum(errors ** 2))
    return result, loss


def _link_bound(cost: RingCostModel, model: str, placement: Placement, others: Others) -> bool:
    b = cost.breakdown(model, placement, others)
    return b.hosts_spanned >= 2 and b.bottleneck_bytes_s <= cost.network.intra_host_bytes_s


def _fit_once(prior: RingCostModel, samples: Sequence[IterationSample], link_bound: Sequence[Sequence[bool]],
              fit_compute: bool, robust: bool = False, current: RingCostModel | None = None) -> Calibration:
    current = current if current is not None else prior   # the constants the compute stretches are taken from
    model_names = sorted({s.model for s in samples}) if fit_compute else []
    col_of = {name: i for i, name in enumerate(model_names)}
    n_model_cols = len(model_names)
    beta = prior.network.link_sharing
    # columns: compute per model | x_intra = 1/intra_bw | x_link = 1/link_efficiency | latency
    cols = n_model_cols + 3
    rows = np.zeros((len(samples), cols))
    target = np.zeros(len(samples))
    for i, s in enumerate(samples):
        mt = prior.model_type(s.model)
        y = s.iteration_s
        w = sum(s.placement)
        grad = ring_factor(w) * mt.grad_bytes
        for (weight, others), bound in zip(s.weighted_others(), link_bound[i]):
            stretch = current.cpu_stretch(s.model, s.placement, current.cpu_demand(others)) \
                if prior.shares_compute else 1.0
            if fit_compute:
                rows[i, col_of[s.model]] += weight * stretch
            else:
                y -= weight * mt.compute_s * stretch
            if w >= 2:
                if bound:
                    # bottleneck = eff * min_h(bw_h / share_h) -> transfer = grad * max_h(share_h / bw_h) * (1 / eff)
                    counts = prior.link_rings(p for _, p in others)
                    worst = max((1.0 + beta * counts[h]) / prior.cluster.hosts[h].link_bytes_s
                                for h, c in enumerate(s.placement) if c)
                    rows[i, n_model_cols + 1] += weight * grad * worst
                else:
                    rows[i, n_model_cols] += weight * grad
                rows[i, n_model_cols + 2] += weight * 2 * (w - 1)
        rows[i] /= s.iteration_s
        target[i] = y / s.iteration_s
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
    a = rows[:, informed]
    solution, _ = nnls(a, adjusted)
    if robust:
        # least absolute relative error by iteratively reweighted least squares (weights 1/sqrt|residual|,
        # floored at 2% so that exactly fitted rows do not dominate)
        for _ in range(20):
            weight = 1.0 / np.sqrt(np.maximum(np.abs(a @ solution - adjusted), 0.02))
            solution, _ = nnls(a * weight[:, None], adjusted * weight)
    values = prior_values.copy()
    values[informed] = solution
    names = [*(f"compute_s[{n}]" for n in model_names), "intra_host_bytes_s", "link_efficiency", "hop_latency_s"]
    tiny = 1e-18  # 1/x with x = 0 means "infinitely fast": keep it finite
    net = prior.network
    network = dataclasses.replace(
        net,
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
    errors = tuple(abs(predict_sample(fitted_cost, s) - s.iteration_s) / s.iteration_s for s in samples)
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
