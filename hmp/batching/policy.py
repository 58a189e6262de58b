"""Batch sizing as the scheduler sees it: one small interface over the Hogbatch policies.

``static`` keeps each worker's configured batch size. ``sync``, ``hogbatch`` and ``adaptive`` are
the policies of :mod:`hmp.batching.hogbatch` (pure); this adapter feeds them the workers' reports.
"""

from __future__ import annotations

from typing import Any, Protocol

from hmp.batching.adapter import HogbatchAdapter
from hmp.config import Config


class BatchPolicy(Protocol):
    def initial(self, worker_id: str) -> int: ...

    def update(self, worker_id: str, metrics: dict[str, float], now_s: float) -> tuple[int, float]: ...

    def forget(self, worker_id: str) -> None: ...


class StaticPolicy:
    """Every worker keeps its configured batch size and an equal data share."""

    def __init__(self, batch_sizes: dict[str, int]) -> None:
        self.batch_sizes = dict(batch_sizes)

    def initial(self, worker_id: str) -> int:
        return self.batch_sizes[worker_id]

    def update(self, worker_id: str, metrics: dict[str, float], now_s: float) -> tuple[int, float]:
        return self.batch_sizes.get(worker_id, 1), 1.0 / max(1, len(self.batch_sizes))

    def forget(self, worker_id: str) -> None:
        pass


def configured_batch_sizes(cfg: Config) -> dict[str, int]:
    return {w.id: w.batch_size or cfg.train.batch_size for w in cfg.workers}


def make_batch_policy(cfg: Config) -> Any:
    """The batch policy named by ``[train] policy``."""
    name = cfg.train.policy
    if name == "static":
        return StaticPolicy(configured_batch_sizes(cfg))
    return HogbatchAdapter(cfg)
