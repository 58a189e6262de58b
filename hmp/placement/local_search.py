"""Steepest-descent local search around one assignment (the RL planner's final polish).

A move recolours one segment of consecutive layers with one type (see :func:`neighbours`). Each
round scores every move at once with the cost model and takes the best one if it improves the
plan (feasible over infeasible, then lower cost, then lower shortfall); it stops at a local
optimum, after ``max_rounds`` rounds, or when the next round would exceed ``budget`` evaluations.
"""

from __future__ import annotations

import numpy as np

from hmp.placement import cost_model
from hmp.placement.problem import PlacementProblem


def neighbours(assignment: np.ndarray, n_resources: int) -> np.ndarray:
    """``[M, L]``: ``assignment`` with one segment ``[s, e)`` recoloured to one other type, for every
    segment and type (``M = L (L + 1) / 2 * (R - 1)``).

    A segment inside a stage splits it (a new stage in the middle), one at its edge moves a
    boundary, one covering whole stages merges them: every way of moving between few-stage plans.
    """
    a = np.asarray(assignment, dtype=np.int64)
    L, R = a.shape[0], n_resources
    if R < 2:
        return np.empty((0, L), dtype=np.int64)
    s, e = np.triu_indices(L + 1, k=1)  # every 0 <= s < e <= L
    seg = (np.arange(L)[None, :] >= s[:, None]) & (np.arange(L)[None, :] < e[:, None])  # [S, L]
    out = []
    for k in range(1, R):
        # Shift by k: each layer of the segment moves to another type; over k = 1..R-1 a
        # one-type segment takes every other type once.
        target = (a[s] + k) % R
        out.append(np.where(seg, target[:, None], a[None, :]))
    return np.concatenate(out)


def _key(sc: cost_model.Scores, i: int) -> tuple[int, float]:
    """Sort key of plan i: feasible first, then cost (or shortfall when infeasible)."""
    return (0, float(sc.cost[i])) if sc.feasible[i] else (1, float(sc.shortfall[i]))


def improve(problem: PlacementProblem, assignment, max_rounds: int = 50, budget: int | None = None) -> tuple[np.ndarray, int]:
    """Local search from ``assignment``; returns the best assignment found and the evaluations spent."""
    current = np.asarray(assignment, dtype=np.int64).copy()
    spent = 1
    cur_key = _key(cost_model.score(problem, current), 0)
    for _ in range(max_rounds):
        cands = neighbours(current, problem.n_resources)
        if len(cands) == 0 or (budget is not None and spent + len(cands) > budget):
            break
        sc = cost_model.score(problem, cands)
        spent += len(cands)
        j = cost_model.best_index(sc)
        key = _key(sc, j)
        if key >= cur_key:
            break
        current, cur_key = cands[j], key
    return current, spent
