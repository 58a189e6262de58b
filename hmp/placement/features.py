"""Observation features shared by the gymnasium environment and the RL policy.

An observation for layer ``i`` is ``static[i]`` (what the layer costs where, ``[L, 4R + 3]``)
followed by the dynamic part (the choices so far, ``[2R + 2]``, :class:`PrefixState`); all values
are dimensionless and clipped to ``[-CLIP, CLIP]`` so that one policy works across problems of any
scale. The features are listed in docs/placement.md, "Environment".
"""

from __future__ import annotations

import numpy as np

from hmp.placement.problem import PlacementProblem

CLIP = 10.0


def static_dim(n_resources: int) -> int:
    return 4 * n_resources + 3


def dynamic_dim(n_resources: int) -> int:
    return 2 * n_resources + 2


def static_features(problem: PlacementProblem) -> np.ndarray:
    """``[L, 4R + 3]`` float32 features of each layer (see the module docstring)."""
    T = problem.times
    L, R = T.shape
    tau = problem.batch_time_budget_s
    pool = tau * np.maximum(problem.counts, 1)[None, :]
    per_batch_cost = T * problem.prices[None, :]
    eps = 1e-9 * max(float(per_batch_cost.max()), 1e-300)
    rel_cost = np.log((per_batch_cost + eps) / (per_batch_cost.min(axis=1, keepdims=True) + eps)) / 5.0
    suffix = np.cumsum(T[::-1], axis=0)[::-1]
    parts = [
        np.log(T / tau) / 5.0,
        np.log1p(T / pool),
        rel_cost,
        np.log1p(suffix / pool),
        np.log1p(problem.boundary_s / tau)[:, None],
        (np.log1p(problem.param_bytes) / 25.0)[:, None],
        (np.arange(L) / max(L - 1, 1))[:, None],
    ]
    return np.clip(np.concatenate(parts, axis=1), -CLIP, CLIP).astype(np.float32)


class PrefixState:
    """The choices so far for a batch of ``n`` partial plans, and their dynamic features.

    Tracks, per plan, the previous type, the open stage's compute (seconds per batch on one worker)
    and input boundary seconds, and the whole workers closed stages need per type. Worker demand is
    the cost model's rule, ``C / (tau - X)``, with the open stage's output transfer not yet known.
    """

    def __init__(self, problem: PlacementProblem, n: int) -> None:
        self.problem, self.n = problem, n
        R = problem.n_resources
        self.tau = problem.batch_time_budget_s
        self._rows = np.arange(n)
        self.prev = np.full(n, -1, dtype=np.int64)
        self.open_compute = np.zeros(n)
        self.open_in_s = np.zeros(n)
        self.closed = np.zeros((n, R))
        self.step = 0

    def _demand(self, compute: np.ndarray, boundary_s: np.ndarray) -> np.ndarray:
        slack = self.tau - boundary_s
        # A transfer-bound stage can never be provisioned; call it "far more than any pool".
        big = 10.0 * (self.problem.counts.max() + 1)
        return np.where(slack > 0, compute / np.where(slack > 0, slack, 1.0), big)

    def features(self) -> np.ndarray:
        """``[n, 2R + 2]`` float32 dynamic features before the next layer is placed."""
        R = self.problem.n_resources
        out = np.zeros((self.n, dynamic_dim(R)), dtype=np.float64)
        out[self._rows, np.where(self.prev >= 0, self.prev, R)] = 1.0
        d = self._demand(self.open_compute, self.open_in_s)
        used = self.closed.copy()
        has_open = self.prev >= 0
        used[self._rows[has_open], self.prev[has_open]] += np.ceil(d[has_open] - 1e-9)
        out[:, R + 1 : 2 * R + 1] = used / np.maximum(self.problem.counts, 1)[None, :]
        out[:, 2 * R + 1] = np.where(has_open, np.ceil(d - 1e-9) - d, 0.0)
        return np.clip(out, -CLIP, CLIP).astype(np.float32)

    def push(self, actions: np.ndarray) -> None:
        """Place the next layer: ``actions`` is ``[n]`` resource indices."""
        i = self.step
        if i >= self.problem.n_layers:
            raise ValueError(f"all {self.problem.n_layers} layers are already placed")
        a = np.asarray(actions, dtype=np.int64)
        t = self.problem.times[i, a]
        switching = (self.prev >= 0) & (a != self.prev)
        if switching.any():
            b_out = self.problem.boundary_s[i - 1]
            rows = self._rows[switching]
            d = self._demand(self.open_compute[switching], self.open_in_s[switching] + b_out)
            self.closed[rows, self.prev[switching]] += np.ceil(d - 1e-9)
        boundary_in = self.problem.boundary_s[i - 1] if i > 0 else 0.0
        self.open_compute = np.where(switching | (self.prev < 0), t, self.open_compute + t)
        self.open_in_s = np.where(switching, boundary_in, self.open_in_s)
        self.prev = a
        self.step += 1
