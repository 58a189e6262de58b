"""The scheduler's side of the batch policies (:mod:`hmp.batching.hogbatch`).

Workers report cumulative counters; the policies want per-interval rates. :class:`PolicyAdapter`
keeps each worker's previous report, turns the difference into a :class:`WorkerReport`, fills the
knobs the config leaves out from the topology, and returns the policy's batch size and data share
for the reporting worker. Speeds are measured on compute time by default, not wall time, for the
reason docs/hogbatch.md gives ("Run 3").
"""

from __future__ import annotations

import math
from typing import Any

from hmp.batching.hogbatch import WorkerReport, make_policy
from hmp.config import BatchPolicyKind, Config, Role
from hmp.errors import ConfigError


def _default_knobs(cfg: Config, sizes: dict[str, int]) -> dict[str, Any]:
    policy = cfg.train.policy
    if policy == BatchPolicyKind.STATIC:
        return {"batch_sizes": sizes, "default_batch": cfg.train.batch_size}
    if policy == BatchPolicyKind.SYNC:
        return {"batch_size": cfg.train.batch_size}
    cpu = [sizes[w.id] for w in cfg.workers if w.role == Role.CPU_WORKER] or [cfg.train.batch_size]
    gpu = [sizes[w.id] for w in cfg.workers if w.role == Role.GPU_WORKER] or [max(cpu)]
    if policy == BatchPolicyKind.HOGBATCH:
        return {"cpu_batch": min(cpu), "gpu_batch": max(gpu)}
    return {"base_batch": min(cpu), "max_batch": max(4096, max(gpu)), "initial_gpu_batch": max(gpu)}


class PolicyAdapter:
    """``initial / update / forget`` per worker for the scheduler, backed by the job's batch policy
    (``[train] policy`` and ``policy_args``)."""

    def __init__(self, cfg: Config) -> None:
        self.configured = {w.id: w.batch_size or cfg.train.batch_size for w in cfg.workers}
        knobs = {**_default_knobs(cfg, self.configured), **cfg.train.policy_args}
        self.speed_basis = knobs.pop("speed", "compute")
        if self.speed_basis not in ("compute", "wall"):
            raise ConfigError(cfg.path, "train.policy_args.speed", f'"compute" or "wall", got {self.speed_basis!r}')
        try:
            self.policy = make_policy(cfg.train.policy, **knobs)
        except ValueError as exc:
            raise ConfigError(cfg.path, "train.policy_args", str(exc)) from None
        self.kinds = {w.id: "gpu" if w.role == Role.GPU_WORKER else "cpu" for w in cfg.workers}
        self.default_batch = cfg.train.batch_size
        self.assignments = self.policy.initial(list(self.kinds.items()))
        self.last: dict[str, tuple[float, float, float]] = {}  # worker -> (time, samples, busy)

    def initial(self, worker_id: str) -> int:
        a = self.assignments.get(worker_id)
        if a is not None:
            return a.batch_size
        # Not among the policy's live workers: dropped as stale before it joined (stale_after_s),
        # or forgotten and now rejoining. It starts at its configured batch; its first report
        # registers it with the policy again (a late join).
        return self.configured.get(worker_id, self.default_batch)

    def update(self, worker_id: str, metrics: dict[str, float], now_s: float) -> tuple[int, float]:
        samples = metrics.get("samples", 0.0)
        busy = metrics.get("busy_s", 0.0)
        t_prev, s_prev, b_prev = self.last.get(worker_id, (0.0, 0.0, 0.0))
        self.last[worker_id] = (now_s, samples, busy)
        dt = now_s - t_prev
        busy_dt = busy - b_prev
        if dt > 0 and samples > s_prev:
            loss = metrics.get("loss", math.nan)
            # Compute speed when the worker measured busy time for this interval (see the module doc).
            per_s = busy_dt if self.speed_basis == "compute" and busy_dt > 0 else dt
            report = WorkerReport(
                worker_id=worker_id, kind=self.kinds.get(worker_id, "cpu"), samples_per_s=(samples - s_prev) / per_s,
                updates=int(metrics.get("updates", 0)), loss=float(loss) if loss == loss else math.nan,
                busy_fraction=min(1.0, max(0.0, busy_dt / dt)),
                batch_size=max(1, int(metrics.get("batch_size", 1))), time_s=now_s)
            self.assignments = self.policy.update([report], now_s)
        a = self.assignments.get(worker_id)
        return (a.batch_size, a.data_share) if a else (int(metrics.get("batch_size", 1)), 0.0)

    def forget(self, worker_id: str) -> None:
        if worker_id in self.assignments:
            self.assignments = self.policy.forget(worker_id)


def check_config(cfg: Config) -> None:
    """``[train] policy_args``: the batch policy's knobs, judged by the policy itself (raises
    ConfigError naming ``train.policy_args``)."""
    PolicyAdapter(cfg)
