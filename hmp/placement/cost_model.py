"""The cost model: the single source of truth for what a placement costs.

Every planner, the gymnasium environment and the reports score assignments here: stages are runs
of layers on one type, each staffed with the fewest workers that meet the required throughput
(infeasible when transfers alone exceed the budget or a type runs out), and a plan costs its
workers' price over the training time (docs/placement.md, "Cost model"). :func:`score` is
vectorised over many assignments so searches evaluate plans in bulk; :func:`evaluate` packages one
as a :class:`Plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hmp.placement.problem import PlacementProblem, Plan, Stage

#: Relative tolerance when testing ``t(w) <= tau``: a worker count whose time exceeds the budget by
#: less than this (float rounding of ``C / (tau - X)``) counts as meeting it.
REL_TOL = 1e-9
#: Worker counts are clipped here so absurd requirements (tiny slack) stay finite integers.
MAX_WORKERS = 1 << 40
#: Default penalty of the reward: an infeasible plan gets ``-(penalty + log1p(shortfall))``; a
#: feasible one ``-log1p(cost / lower_bound)`` clipped at ``-penalty``.
INFEASIBLE_PENALTY = 20.0


@dataclass(frozen=True)
class Scores:
    """Cost-model figures for a batch of N assignments (all arrays ``[N]``).

    ``cost`` is ``inf`` where infeasible; ``throughput`` is computed with the workers the stages
    would need (so it meets the constraint even for plans that exceed a type's count).
    """

    cost: np.ndarray
    feasible: np.ndarray
    shortfall: np.ndarray
    throughput: np.ndarray


@dataclass(frozen=True)
class _Detail:
    """Per-stage arrays ``[N, L]`` (stage slots past the last stage of a row are unused)."""

    exists: np.ndarray
    resource: np.ndarray
    start: np.ndarray
    compute: np.ndarray
    transfer: np.ndarray
    workers: np.ndarray
    time: np.ndarray
    transfer_bound: np.ndarray
    used: np.ndarray  # [N, R] workers per type
    scores: Scores
    time_to_train: np.ndarray  # [N]


def _as_batch(problem: PlacementProblem, assignments: np.ndarray | Sequence) -> np.ndarray:
    a = np.asarray(assignments)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] != problem.n_layers:
        raise ValueError(f"expected assignments of shape [N, {problem.n_layers}] (one resource index per layer), got {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"assignments must be integer resource indices, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= problem.n_resources):
        raise ValueError(f"resource indices must lie in [0, {problem.n_resources}), got range [{a.min()}, {a.max()}]")
    return a.astype(np.int64, copy=False)


def _detail(problem: PlacementProblem, a: np.ndarray) -> _Detail:
    n, L = a.shape
    R = problem.n_resources
    tau = problem.batch_time_budget_s
    rows = np.arange(n)[:, None]

    layer_t = problem.times[np.arange(L)[None, :], a]  # [N, L] seconds per batch of layer i on its type
    new_stage = np.ones((n, L), dtype=bool)
    new_stage[:, 1:] = a[:, 1:] != a[:, :-1]
    sid = np.cumsum(new_stage, axis=1) - 1  # stage index of each layer within its row
    flat = (rows * L + sid).ravel()

    compute = np.bincount(flat, weights=layer_t.ravel(), minlength=n * L).reshape(n, L)

    # A boundary after layer i costs boundary_s[i] (bytes and messages); it belongs to the stage on each side.
    boundary = new_stage[:, 1:]  # [N, L-1]: a boundary between layer i and i+1
    transfer = np.zeros(n * L)
    if L > 1 and boundary.any():
        b_s = np.broadcast_to(problem.boundary_s[None, :-1], boundary.shape)[boundary]
        left = (rows * L + sid[:, :-1])[boundary]
        right = (rows * L + sid[:, 1:])[boundary]
        transfer += np.bincount(left, weights=b_s, minlength=n * L)
        transfer += np.bincount(right, weights=b_s, minlength=n * L)
    transfer = transfer.reshape(n, L)

    resource = np.full((n, L), -1, dtype=np.int64)
    start = np.zeros((n, L), dtype=np.int64)
    ri, ci = np.nonzero(new_stage)
    resource[ri, sid[ri, ci]] = a[ri, ci]
    start[ri, sid[ri, ci]] = ci
    exists = resource >= 0

    slack = tau - transfer
    transfer_bound = exists & (slack <= 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.ceil(compute / np.where(slack > 0, slack, 1.0) - REL_TOL * 10)
    need = np.clip(np.nan_to_num(need, nan=1.0, posinf=MAX_WORKERS), 1, MAX_WORKERS)
    workers = np.where(exists & ~transfer_bound, need, np.where(exists, 1, 0)).astype(np.int64)
    # Fewest workers: step down while one fewer still meets the budget (guards the ceil above).
    for _ in range(2):
        fewer = np.maximum(workers - 1, 1)
        ok = exists & ~transfer_bound & (workers > 1) & (compute / fewer + transfer <= tau * (1 + REL_TOL))
        workers = np.where(ok, fewer, workers)
        more = exists & ~transfer_bound & (compute / np.maximum(workers, 1) + transfer > tau * (1 + REL_TOL))
        workers = np.where(more, workers + 1, workers)

    with np.errstate(divide="ignore"):
        time = np.where(exists, compute / np.maximum(workers, 1) + transfer, 0.0)
        stage_thr = np.where(exists, problem.batch_size / time, np.inf)
    throughput = stage_thr.min(axis=1)

    used_flat = np.bincount((rows * R + np.maximum(resource, 0))[exists], weights=workers[exists].astype(np.float64), minlength=n * R)
    used = used_flat.reshape(n, R).astype(np.int64)
    over = np.maximum(used - problem.counts[None, :], 0)
    feasible = ~transfer_bound.any(axis=1) & (over == 0).all(axis=1)
    shortfall = (over / np.maximum(problem.counts, 1)[None, :]).sum(axis=1) + np.where(transfer_bound, transfer / tau, 0.0).sum(axis=1)

    with np.errstate(divide="ignore"):
        time_to_train = problem.samples_to_train / throughput
    dollars_per_hour = np.where(exists, workers * problem.prices[np.maximum(resource, 0)], 0.0).sum(axis=1)
    cost = np.where(feasible, dollars_per_hour * time_to_train / 3600.0, np.inf)
    scores = Scores(cost=cost, feasible=feasible, shortfall=shortfall, throughput=throughput)
    return _Detail(exists, resource, start, compute, transfer, workers, time, transfer_bound, used, scores, time_to_train)


def score(problem: PlacementProblem, assignments: np.ndarray | Sequence) -> Scores:
    """Score a batch of assignments, ``[N, L]`` ints (or one ``[L]``), with the cost model."""
    return _detail(problem, _as_batch(problem, assignments)).scores


def evaluate(problem: PlacementProblem, assignment: Sequence[int]) -> Plan:
    """The cost model's verdict on one assignment (resource index per layer) as a :class:`Plan`."""
    a = _as_batch(problem, assignment)
    if a.shape[0] != 1:
        raise ValueError(f"evaluate takes one assignment of length {problem.n_layers}; use score() for a batch")
    d = _detail(problem, a)
    tau = problem.batch_time_budget_s
    stages = []
    reasons = []
    n_stages = int(d.exists[0].sum())
    for k in range(n_stages):
        start = int(d.start[0, k])
        stop = int(d.start[0, k + 1]) if k + 1 < n_stages else problem.n_layers
        r = int(d.resource[0, k])
        st = Stage(
            start=start,
            stop=stop,
            resource=r,
            resource_name=problem.resources[r].name,
            workers=int(d.workers[0, k]),
            compute_s=float(d.compute[0, k]),
            transfer_s=float(d.transfer[0, k]),
            time_s=float(d.time[0, k]),
            throughput=float(problem.batch_size / d.time[0, k]),
            transfer_bound=bool(d.transfer_bound[0, k]),
        )
        stages.append(st)
        if st.transfer_bound:
            reasons.append(
                f"stage {k} (layers {start}-{stop - 1} on {st.resource_name}) is transfer-bound: "
                f"{st.transfer_s * 1e3:.3f} ms of boundary transfer per batch, budget {tau * 1e3:.3f} ms"
            )
    for r, res in enumerate(problem.resources):
        if d.used[0, r] > res.count:
            reasons.append(f"needs {int(d.used[0, r])} {res.name} workers, {res.count} available")
    sc = d.scores
    return Plan(
        assignment=tuple(int(x) for x in a[0]),
        stages=tuple(stages),
        throughput=float(sc.throughput[0]),
        cost=float(sc.cost[0]),
        feasible=bool(sc.feasible[0]),
        time_to_train_s=float(d.time_to_train[0]),
        workers_by_type=tuple(int(x) for x in d.used[0]),
        shortfall=float(sc.shortfall[0]),
        reason="; ".join(reasons),
    )


def lower_bound_cost(problem: PlacementProblem) -> float:
    """Dollars no plan can beat: every layer on its cheapest type per batch, no idle time, no transfer.

    ``samples_to_train / batch_size * sum_i min_r(T[i, r] * price_r) / 3600``. It holds because a
    stage's workers are billed for at least ``C / w`` seconds of every batch interval.
    """
    per_batch = (problem.times * problem.prices[None, :]).min(axis=1).sum()
    return float(problem.samples_to_train / problem.batch_size * per_batch / 3600.0)


def reward(problem: PlacementProblem, scores: Scores, penalty: float = INFEASIBLE_PENALTY) -> np.ndarray:
    """Episode reward ``[N]``: the negative cost on a log scale, or a penalty when infeasible.

    Feasible: ``-min(log1p(cost / lower_bound_cost), penalty)`` (monotone in cost; one scale for
    problems whose costs differ by orders of magnitude). Infeasible:
    ``-(penalty + log1p(shortfall))``: never above a feasible reward, and higher for nearly
    feasible plans.
    """
    if not (np.isfinite(penalty) and penalty > 0):
        raise ValueError(f"penalty must be a finite number > 0, got {penalty!r}")
    lb = lower_bound_cost(problem)
    scale = lb if lb > 0 else 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        feasible_r = -np.minimum(np.log1p(np.where(scores.feasible, scores.cost, 0.0) / scale), penalty)
    return np.where(scores.feasible, feasible_r, -(penalty + np.log1p(scores.shortfall)))


def best_index(scores: Scores) -> int:
    """Index of the best assignment: the cheapest feasible one, else the one with least shortfall."""
    if scores.feasible.any():
        return int(np.argmin(np.where(scores.feasible, scores.cost, np.inf)))
    return int(np.argmin(scores.shortfall))


def is_better(a: Plan, b: Plan | None) -> bool:
    """Plan ``a`` beats ``b``: feasible over infeasible, then lower cost, then lower shortfall."""
    if b is None:
        return True
    if a.feasible != b.feasible:
        return a.feasible
    if a.feasible:
        return a.cost < b.cost
    return a.shortfall < b.shortfall


def homogeneous_plans(problem: PlacementProblem) -> list[Plan]:
    """The R plans that put every layer on one type (each a single stage)."""
    return [evaluate(problem, [r] * problem.n_layers) for r in range(problem.n_resources)]
