"""The placement API the runtime calls: profile, plan, re-plan. These signatures are kept stable.

:func:`parse_spec`, :func:`profile` (or both at once, :func:`problem_from_config`),
:func:`make_planner`, :func:`plan` and :func:`replan` are what the scheduler's placement loop and
the benchmarks use, so that planners and profilers can change behind them. docs/placement.md
lists their signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from hmp.placement import cost_model
from hmp.placement.baselines import BruteForcePlanner, GeneticPlanner, GreedyPlanner, Planner, RandomSearchPlanner
from hmp.placement.problem import PlacementProblem, Plan
from hmp.placement.profiler import problem_from_config, profile
from hmp.placement.rl import RLPlanner
from hmp.placement.spec import PlacementSpec, parse_spec

__all__ = ["PLANNERS", "PlacementSpec", "make_planner", "parse_spec", "plan", "problem_from_config", "profile", "replan"]

#: Planner factories by name; each accepts keyword arguments (``seed`` for the seeded ones).
PLANNERS: dict[str, Callable[..., Planner]] = {
    "bruteforce": BruteForcePlanner,
    "greedy": GreedyPlanner,
    "random": RandomSearchPlanner,
    "ga": GeneticPlanner,
    "rl": RLPlanner,
}


def make_planner(name: str, **kwargs) -> Planner:
    """Build a planner by registry name; unknown names list the known ones."""
    try:
        factory = PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; expected one of {sorted(PLANNERS)}") from None
    return factory(**kwargs)


def plan(problem: PlacementProblem, planner: str | Planner = "rl") -> Plan:
    """Plan ``problem`` with a planner given by registry name or object."""
    return (make_planner(planner) if isinstance(planner, str) else planner).plan(problem)


def replan(
    problem: PlacementProblem,
    available_counts: Mapping[str, int] | Sequence[int],
    planner: str | Planner = "rl",
    current: Sequence[int] | None = None,
    min_gain: float = 0.0,
) -> Plan:
    """Plan again after workers joined or left. Pure: no I/O, no state.

    Args:
        problem: the problem the running plan was made for.
        available_counts: workers available now, per type (mapping by name, or one int per type).
        planner: a registry name or a planner object.
        current: the running assignment, if any. It is kept (re-evaluated under the new counts)
            when it is still feasible and the new plan is not cheaper by more than ``min_gain``
            (a fraction), so that small gains do not cause a costly re-partition.
        min_gain: see ``current``.

    Returns:
        The plan for ``problem.with_counts(available_counts)``; ``planner`` is ``"kept"`` when the
        current assignment was kept.
    """
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be a fraction in [0, 1), got {min_gain!r}")
    updated = problem.with_counts(available_counts)
    fresh = plan(updated, planner)
    if current is None:
        return fresh
    kept = cost_model.evaluate(updated, current)
    if kept.feasible and not (fresh.feasible and fresh.cost < kept.cost * (1.0 - min_gain)):
        return replace(kept, planner="kept")
    return fresh
