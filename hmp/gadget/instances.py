"""Small random scheduling rounds, for comparing GADGET with the exact optimum (tests and bench)."""

from __future__ import annotations

import dataclasses
import random

from .interface import ClusterView, PendingJob, RunningJob
from .jobs import ConvergenceStop, LinearDecay, SigmoidDeadline
from .model import RingCostModel
from .schedulers import GadgetScheduler, OptimalScheduler, round_value


def random_round(rng: random.Random, cost: RingCostModel, max_jobs: int = 5, max_workers: int = 4,
                 running: int = 0) -> ClusterView:
    """A random round on ``cost.cluster``: 2..max_jobs pending jobs of the cost model's model types with
    random worker bounds (1..max_workers), work (50-300 iterations of one worker) and utilities whose
    times scale with that work; random free slots; up to ``running`` random running rings (over one or
    two hosts, so they may share links) on the busy slots."""
    names = sorted(cost.models)
    hosts = cost.cluster.hosts
    free = [rng.randint(0, h.slots) for h in hosts]
    if sum(free) == 0:
        free[0] = hosts[0].slots
    busy = [h.slots - f for h, f in zip(hosts, free)]
    running_jobs: dict[str, RunningJob] = {}
    for i in range(running):
        # a ring over up to two hosts with busy slots
        candidates = [h for h in range(len(hosts)) if busy[h] > 0]
        if not candidates:
            break
        chosen = rng.sample(candidates, min(len(candidates), rng.randint(1, 2)))
        placement = [0] * len(hosts)
        for h in chosen:
            take = rng.randint(1, busy[h])
            placement[h] = take
            busy[h] -= take
        model = rng.choice(names)
        one_iter = cost.iteration_s(model, tuple(placement))
        samples = rng.uniform(20, 200) * cost.samples_per_iteration(model, sum(placement))
        running_jobs[f"r{i}"] = RunningJob(f"r{i}", model, tuple(placement), 0.0, samples,
                                           LinearDecay(rng.uniform(0.5, 2), rng.uniform(100, 400) * one_iter), 0.0,
                                           submit_s=0.0)
    pending = []
    for i in range(rng.randint(2, max_jobs)):
        model = rng.choice(names)
        lo = rng.randint(1, 2)
        hi = rng.randint(lo, max(lo, min(max_workers, cost.cluster.total_slots)))
        one_worker_s = cost.iteration_s(model, cost.compact_placement(1))
        samples = rng.uniform(50, 300) * cost.samples_per_iteration(model, 1)
        scale = samples / cost.samples_per_iteration(model, 1) * one_worker_s   # seconds on one worker
        u = rng.choice([LinearDecay(rng.uniform(0.5, 2), rng.uniform(0.5, 2.0) * scale),
                        SigmoidDeadline(rng.uniform(0.5, 2), rng.uniform(0.3, 1.2) * scale, rng.uniform(0.02, 0.2) * scale),
                        ConvergenceStop(rng.uniform(0.5, 2), rng.uniform(0.2, 0.8) * scale, rng.uniform(0.2, 2.0) * scale)])
        pending.append(PendingJob(f"p{i}", 0.0, model, lo, hi, rng.randint(lo, hi), samples, u))
    return ClusterView(rng.uniform(0, 0.1) * 100, cost.cluster, tuple(free), tuple(pending), running_jobs, cost)


@dataclasses.dataclass(frozen=True)
class RoundComparison:
    gadget_value: float
    optimal_value: float
    slot_price: float

    @property
    def ratio(self) -> float:
        """GADGET / optimum (1.0 when the optimum is worth nothing)."""
        return self.gadget_value / self.optimal_value if self.optimal_value > 1e-12 else 1.0


def compare_round(view: ClusterView, **gadget_kw) -> RoundComparison:
    """GADGET's round value against the exact optimum of the same round objective (same slot price).
    As the bound assumes: hopeless jobs are not skipped, every job is in the window, no deferral pass."""
    kw = dict(fill_hopeless=False, hopeless_fraction=0.0, window=len(view.pending), defer_s=0.0)
    kw.update(gadget_kw)
    gadget = GadgetScheduler(**kw)
    decisions = gadget.schedule(view)
    price = gadget.last_slot_price
    optimal = OptimalScheduler(slot_price=price)
    best = optimal.schedule(view)
    return RoundComparison(round_value(view, decisions, price), round_value(view, best, price), price)
