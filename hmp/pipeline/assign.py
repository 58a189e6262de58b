"""From a plan to workers: which joined worker runs which stage.

The cost model gives each stage the fewest workers that meet the throughput target. The runtime
takes that many workers of the stage's type (preferring those that ran the same layers before, so
a re-plan moves few parameters), then, when ``use_spare`` is set, hands every worker the plan left
idle to the stage of its type with the most compute per worker (data parallel within the stage).
A stage gets at most ``micro_batches`` workers: each handles at least one micro-batch per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hmp.placement import cost_model
from hmp.placement.problem import PlacementProblem, Plan


@dataclass(frozen=True)
class StageWorkers:
    """One stage as it runs: layers ``[start, stop)`` on ``resource``, by ``workers`` (node ids)."""

    start: int
    stop: int
    resource: str
    workers: tuple[str, ...]
    compute_s: float  # per batch on one worker (cost model)
    transfer_s: float  # per batch (cost model)
    batch_size: int

    @property
    def predicted_time_s(self) -> float:
        """Seconds per batch with the workers it really has (the cost model's formula)."""
        return self.compute_s / len(self.workers) + self.transfer_s

    @property
    def predicted_throughput(self) -> float:
        return self.batch_size / self.predicted_time_s


def runnable(plan: Plan, problem: PlacementProblem, live: Mapping[str, Sequence[str]]) -> Plan:
    """``plan`` if every stage's type has a live worker, else the best one-type plan that can run
    (the planner may return an infeasible plan on a type with no workers left)."""
    if all(live.get(s.resource_name) for s in plan.stages):
        return plan
    options = [p for p in cost_model.homogeneous_plans(problem) if live.get(p.stages[0].resource_name)]
    if not options:
        raise ValueError("no live workers of any resource type")
    best = max(options, key=lambda p: (p.feasible, -p.cost if p.feasible else p.throughput))
    return Plan(**{**best.__dict__, "planner": "fallback"})


def assign_workers(plan: Plan, problem: PlacementProblem, live: Mapping[str, Sequence[str]], *,
                   micro_batches: int, use_spare: bool = True,
                   previous: Mapping[str, tuple[int, int]] | None = None) -> list[StageWorkers]:
    """Workers for every stage of ``plan`` (see the module docstring).

    Args:
        live: resource type -> ids of the live workers of that type.
        previous: worker id -> the (start, stop) layers it ran under the previous plan.
    """
    previous = previous or {}
    free = {r: list(ids) for r, ids in live.items()}
    chosen: list[list[str]] = []
    for s in plan.stages:
        pool = free.get(s.resource_name, [])
        if not pool:
            raise ValueError(f"stage layers {s.start}-{s.stop - 1} needs a {s.resource_name} worker; none is live")
        # Same layers before first, then any; stable order otherwise.
        pool.sort(key=lambda w: previous.get(w) != (s.start, s.stop))
        n = max(1, min(s.workers, len(pool), micro_batches))
        chosen.append(pool[:n])
        del pool[:n]
    if use_spare:
        for r, pool in free.items():
            for w in pool:
                mine = [i for i, s in enumerate(plan.stages) if s.resource_name == r and len(chosen[i]) < micro_batches]
                if not mine:
                    break
                i = max(mine, key=lambda i: plan.stages[i].compute_s / len(chosen[i]))
                chosen[i].append(w)
    return [StageWorkers(s.start, s.stop, s.resource_name, tuple(ws), s.compute_s, s.transfer_s, problem.batch_size)
            for s, ws in zip(plan.stages, chosen)]


def predicted_throughput(stages: Sequence[StageWorkers]) -> float:
    """Pipeline samples/s the cost model predicts for the stages as staffed: the slowest stage."""
    return min((s.predicted_throughput for s in stages), default=math.nan)
