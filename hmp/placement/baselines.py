"""Baseline planners: brute force, greedy, random search and a genetic algorithm.

Every planner has ``plan(problem) -> Plan`` and scores candidates only through
``cost_model.score``/``evaluate``. Seeded ones draw from ``numpy.random.default_rng(seed)``, so
the same problem and seed give the same plan. Random search and the genetic algorithm get the
same number of cost-model evaluations (``budget``) as the RL planner's default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from hmp.placement import cost_model
from hmp.placement.problem import PlacementProblem, Plan

#: Evaluations given to the sampling planners by default (the RL planner's default, 300 x 64).
DEFAULT_BUDGET = 19_200


class Planner(Protocol):
    name: str

    def plan(self, problem: PlacementProblem) -> Plan: ...


class SpaceTooLarge(ValueError):
    """Brute force refused: the problem has more assignments than the planner's limit."""


def _finish(problem: PlacementProblem, assignment, name: str) -> Plan:
    return replace(cost_model.evaluate(problem, assignment), planner=name)


@dataclass
class BruteForcePlanner:
    """Score every one of the ``R ** L`` assignments (in chunks) and keep the best.

    Exact, so it is the reference for the others; refuses problems with more than ``max_plans``
    assignments (``SpaceTooLarge``).
    """

    max_plans: int = 1 << 20
    chunk: int = 1 << 15
    name: str = "bruteforce"

    def can_solve(self, problem: PlacementProblem) -> bool:
        return problem.plan_space_size <= self.max_plans

    def plan(self, problem: PlacementProblem) -> Plan:
        if not self.can_solve(problem):
            raise SpaceTooLarge(
                f"{problem.name or 'problem'}: {problem.n_resources}^{problem.n_layers} = {problem.plan_space_size} "
                f"assignments exceed brute force's limit of {self.max_plans}"
            )
        R, L = problem.n_resources, problem.n_layers
        place = R ** np.arange(L, dtype=np.int64)
        best: Plan | None = None
        for lo in range(0, problem.plan_space_size, self.chunk):
            idx = np.arange(lo, min(lo + self.chunk, problem.plan_space_size), dtype=np.int64)
            batch = (idx[:, None] // place[None, :]) % R  # mixed-radix digits: every assignment once
            sc = cost_model.score(problem, batch)
            cand = cost_model.evaluate(problem, batch[cost_model.best_index(sc)])
            if cost_model.is_better(cand, best):
                best = cand
        return replace(best, planner=self.name)


@dataclass
class GreedyPlanner:
    """Fix layers front to back; each takes the type whose plan (the rest of the layers on that
    same type) is best. The first step so picks the best homogeneous plan, and the plan never gets
    worse. ``L * R`` evaluations."""

    name: str = "greedy"

    def plan(self, problem: PlacementProblem) -> Plan:
        L, R = problem.n_layers, problem.n_resources
        current = np.zeros(L, dtype=np.int64)
        for i in range(L):
            cands = np.repeat(current[None, :], R, axis=0)
            cands[:, i:] = np.arange(R)[:, None]
            current = cands[cost_model.best_index(cost_model.score(problem, cands))]
        return _finish(problem, current, self.name)


@dataclass
class RandomSearchPlanner:
    """``budget`` assignments drawn uniformly at random (each layer's type i.i.d.); keep the best."""

    seed: int = 0
    budget: int = DEFAULT_BUDGET
    chunk: int = 4096
    name: str = "random"

    def plan(self, problem: PlacementProblem) -> Plan:
        rng = np.random.default_rng(self.seed)
        best: Plan | None = None
        left = self.budget
        while left > 0:
            n = min(self.chunk, left)
            left -= n
            batch = rng.integers(0, problem.n_resources, size=(n, problem.n_layers))
            cand = cost_model.evaluate(problem, batch[cost_model.best_index(cost_model.score(problem, batch))])
            if cost_model.is_better(cand, best):
                best = cand
        return replace(best, planner=self.name)


@dataclass
class GeneticPlanner:
    """A steady genetic algorithm over assignments.

    Population ``population``; parents by tournament (size ``tournament``) on the RL reward
    (``cost_model.reward``: cost, or shortfall when infeasible); two-point crossover (keeps runs of
    layers, i.e. stages, intact); mutation recolours a random segment (merging or splitting stages)
    and flips single layers with probability ``1 / L``; the ``elite`` best survive unchanged.
    Stops after ``budget`` evaluations.
    """

    seed: int = 0
    budget: int = DEFAULT_BUDGET
    population: int = 64
    tournament: int = 3
    elite: int = 4
    segment_mutation: float = 0.5
    name: str = "ga"

    def plan(self, problem: PlacementProblem) -> Plan:
        rng = np.random.default_rng(self.seed)
        L, R, P = problem.n_layers, problem.n_resources, self.population
        pop = rng.integers(0, R, size=(P, L))
        fit = cost_model.reward(problem, cost_model.score(problem, pop))
        spent = P
        while spent + P - self.elite <= self.budget:
            n_child = P - self.elite
            # Tournament selection: the fittest of `tournament` random members, twice per child.
            contenders = rng.integers(0, P, size=(2, n_child, self.tournament))
            winners = np.take_along_axis(contenders, np.argmax(fit[contenders], axis=2)[..., None], axis=2)[..., 0]
            mum, dad = pop[winners[0]], pop[winners[1]]
            cut = np.sort(rng.integers(0, L + 1, size=(n_child, 2)), axis=1)
            pos = np.arange(L)[None, :]
            from_dad = (pos >= cut[:, :1]) & (pos < cut[:, 1:])
            child = np.where(from_dad, dad, mum)
            # Segment mutation: recolour [s, e) with one type.
            seg = rng.random(n_child) < self.segment_mutation
            s = rng.integers(0, L, size=n_child)
            e = np.minimum(s + 1 + rng.geometric(0.25, size=n_child), L)
            in_seg = seg[:, None] & (pos >= s[:, None]) & (pos < e[:, None])
            child = np.where(in_seg, rng.integers(0, R, size=n_child)[:, None], child)
            flip = rng.random((n_child, L)) < 1.0 / L
            child = np.where(flip, rng.integers(0, R, size=(n_child, L)), child)

            child_fit = cost_model.reward(problem, cost_model.score(problem, child))
            spent += n_child
            keep = np.argsort(-fit, kind="stable")[: self.elite]
            pop = np.concatenate([pop[keep], child])
            fit = np.concatenate([fit[keep], child_fit])
        sc = cost_model.score(problem, pop)
        return _finish(problem, pop[cost_model.best_index(sc)], self.name)
