"""A gymnasium environment over the cost model: place one layer per step.

Episode: ``L`` steps, the action at step ``i`` the resource index for layer ``i``, the observation
the features of :mod:`hmp.placement.features`, and the reward ``cost_model.reward`` at the last
step (0 before). The RL planner rolls out episodes in bulk with the same features and reward rather
than stepping this class; a test pins the two together. See docs/placement.md, "Environment".
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from hmp.placement import cost_model
from hmp.placement.features import CLIP, PrefixState, dynamic_dim, static_dim, static_features
from hmp.placement.problem import PlacementProblem


class PlacementEnv(gymnasium.Env):
    """Place the layers of ``problem`` one by one; see the module docstring."""

    metadata = {"render_modes": []}

    def __init__(self, problem: PlacementProblem) -> None:
        super().__init__()
        self.problem = problem
        R = problem.n_resources
        self._static = static_features(problem)
        self.observation_space = spaces.Box(low=-CLIP, high=CLIP, shape=(static_dim(R) + dynamic_dim(R),), dtype=np.float32)
        self.action_space = spaces.Discrete(R)
        self._actions: list[int] = []
        self._state = PrefixState(problem, 1)

    def _obs(self) -> np.ndarray:
        i = min(len(self._actions), self.problem.n_layers - 1)
        return np.concatenate([self._static[i], self._state.features()[0]])

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._actions = []
        self._state = PrefixState(self.problem, 1)
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if len(self._actions) >= self.problem.n_layers:
            raise RuntimeError("episode is over; call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action must be a resource index in [0, {self.problem.n_resources}), got {action!r}")
        a = int(action)
        self._actions.append(a)
        self._state.push(np.array([a]))
        if len(self._actions) < self.problem.n_layers:
            return self._obs(), 0.0, False, False, {}
        plan = cost_model.evaluate(self.problem, self._actions)
        r = float(cost_model.reward(self.problem, cost_model.score(self.problem, self._actions))[0])
        return self._obs(), r, True, False, {"plan": plan}
