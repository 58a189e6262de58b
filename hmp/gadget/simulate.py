"""Event-driven simulator: replays jobs through any ``interface.Scheduler`` on a cost model.

At each arrival or completion it retires finished rings, admits arrivals, asks the scheduler for
decisions, validates them and starts the chosen rings, re-timing the rings that share links with a
ring that starts or ends. It checks its bookkeeping as it goes (free slots, work conserved, one
start per job). See docs/gadget.md, "Simulator".
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from hmp.errors import HmpError

from .interface import ClusterSpec, ClusterView, PendingJob, Placement, RunningJob, Scheduler
from .model import RingCostModel


class ScheduleViolation(HmpError):
    """A scheduler's decision breaks the rules (unknown job, slots not free, worker bounds)."""


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    job_id: str
    model: str
    submit_s: float
    start_s: float
    end_s: float
    placement: Placement
    samples: float
    utility: float          # the job's utility at its completion time (end - submit)

    @property
    def workers(self) -> int:
        return sum(self.placement)

    @property
    def jct_s(self) -> float:
        return self.end_s - self.submit_s

    @property
    def queue_s(self) -> float:
        return self.start_s - self.submit_s


@dataclasses.dataclass(frozen=True)
class Decision:
    time_s: float
    job_id: str
    placement: Placement


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    scheduler: str
    outcomes: tuple[JobOutcome, ...]          # in completion order
    decisions: tuple[Decision, ...]           # every start, in order
    total_utility: float
    jct_mean_s: float
    jct_p50_s: float
    jct_p99_s: float
    queue_mean_s: float
    queue_p99_s: float
    makespan_s: float                         # last completion - first submission
    utilization: float                        # busy slot-seconds / (slots * makespan)
    busy_slot_s: float
    scheduler_calls: int
    wall_s: float

    def jct_cdf(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted completion times, fraction of jobs done by then)."""
        x = np.sort(np.array([o.jct_s for o in self.outcomes]))
        return x, np.arange(1, len(x) + 1) / len(x)


class _Running:
    __slots__ = ("job", "placement", "start_s", "rate", "t_mark", "done_at_mark", "version", "spans")

    def __init__(self, job: PendingJob, placement: Placement, start_s: float) -> None:
        self.job = job
        self.placement = placement
        self.start_s = start_s
        self.rate = 0.0            # samples / s
        self.t_mark = start_s      # progress banked up to here
        self.done_at_mark = 0.0
        self.version = 0
        self.spans = sum(1 for c in placement if c) >= 2

    def left(self, now: float) -> float:
        return self.job.samples - self.done_at_mark - self.rate * (now - self.t_mark)


class _RunningView(Mapping[str, RunningJob]):
    """``ClusterView.running`` built lazily: most schedulers never look at most running jobs."""

    def __init__(self, running: dict[str, _Running], now: float) -> None:
        self._running = running
        self._now = now

    def __getitem__(self, job_id: str) -> RunningJob:
        r = self._running[job_id]
        return RunningJob(job_id=job_id, model=r.job.model, placement=r.placement, start_s=r.start_s,
                          samples_left=max(0.0, r.left(self._now)), utility=r.job.utility,
                          attained_s=sum(r.placement) * (self._now - r.start_s), submit_s=r.job.submit_s)

    def __iter__(self) -> Iterator[str]:
        return iter(self._running)

    def spanning_rings(self) -> dict[str, tuple[str, Placement]]:
        """job id -> (model, placement) of the rings that cross host links (a fast path for schedulers)."""
        return {job_id: (r.job.model, r.placement) for job_id, r in self._running.items() if r.spans}

    def __len__(self) -> int:
        return len(self._running)


def _validate(decisions: Mapping[str, Placement], pending: Mapping[str, PendingJob], free: list[int],
              cluster: ClusterSpec, now: float, name: str) -> None:
    for job_id, p in decisions.items():
        job = pending.get(job_id)
        if job is None:
            raise ScheduleViolation(f"{name} at t={now:.1f}: {job_id!r} is not a pending job")
        if not isinstance(p, tuple) or len(p) != len(cluster.hosts) or any((not isinstance(c, int)) or c < 0 for c in p):
            raise ScheduleViolation(f"{name} at t={now:.1f}: placement {p!r} of {job_id!r} is not "
                                    f"{len(cluster.hosts)} non-negative ints")
        w = sum(p)
        if not job.min_workers <= w <= job.max_workers:
            raise ScheduleViolation(f"{name} at t={now:.1f}: {job_id!r} given {w} workers, allowed "
                                    f"{job.min_workers}..{job.max_workers}")
        for h, c in enumerate(p):
            free[h] -= c
            if free[h] < 0:
                raise ScheduleViolation(f"{name} at t={now:.1f}: host {cluster.hosts[h].name} over-committed "
                                        f"(placing {job_id!r}: {p})")


def simulate(jobs: Sequence[PendingJob], cost: RingCostModel, scheduler: Scheduler, *,
             progress: Callable[[str], None] | None = None, progress_every_s: float = 10.0,
             check_every: int = 1) -> SimulationResult:
    """Replay ``jobs`` (any order; sorted by submit time here) on ``cost.cluster`` through ``scheduler``.

    Raises :class:`ScheduleViolation` on a bad decision, and ``RuntimeError`` if jobs are left that the
    scheduler never starts on an idle cluster with no arrival to come. ``check_every``: verify the
    slot bookkeeping from scratch every this many events (0: never; the incremental checks always run).
    """
    cluster = cost.cluster
    name = getattr(scheduler, "name", type(scheduler).__name__)
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i].submit_s, i))
    arrivals = [jobs[i] for i in order]
    ids = [j.job_id for j in arrivals]
    if len(set(ids)) != len(ids):
        raise ValueError("job ids must be unique")
    for j in arrivals:
        if not (j.samples > 0 and 1 <= j.min_workers <= j.max_workers):
            raise ValueError(f"job {j.job_id!r}: need samples > 0 and 1 <= min_workers <= max_workers")
        if j.min_workers > cluster.total_slots:
            raise ValueError(f"job {j.job_id!r} needs {j.min_workers} workers, the cluster has {cluster.total_slots}")
    slots = [h.slots for h in cluster.hosts]
    free = list(slots)
    link_rings = [0] * len(slots)
    rings_on_host: list[set[str]] = [set() for _ in slots]
    pending: dict[str, PendingJob] = {}          # insertion order = submit order
    running: dict[str, _Running] = {}
    completions: list[tuple[float, int, str]] = []   # (end time, version, job id)
    outcomes: list[JobOutcome] = []
    decisions_log: list[Decision] = []
    busy_slot_s = 0.0
    calls = 0
    next_arrival = 0
    wall0 = time.monotonic()
    last_progress = wall0
    first_submit = arrivals[0].submit_s if arrivals else 0.0

    def retime(r: _Running, now: float) -> None:
        r.done_at_mark += r.rate * (now - r.t_mark)
        r.t_mark = now
        busy = cost.cpu_demand((o.job.model, o.placement) for o in running.values() if o is not r) if pooled else None
        it = cost.iteration_s_loaded(r.job.model, r.placement, link_rings, counted=r.spans, busy=busy)
        r.rate = cost.samples_per_iteration(r.job.model, sum(r.placement)) / it
        r.version += 1
        left = r.job.samples - r.done_at_mark
        heapq.heappush(completions, (now + max(0.0, left) / r.rate, r.version, r.job.job_id))
        pushes[0] += 1

    # hosts that share compute pools (cost.pool_of): a ring's speed then depends on every ring in its pools
    pooled = cost.shares_compute
    pool_of = cost.pool_of

    def neighbours(placement: Placement) -> set[str]:
        """The rings whose speed a ring on ``placement`` changes when it starts or ends."""
        out: set[str] = set()
        if sum(1 for c in placement if c) >= 2:
            for h, c in enumerate(placement):
                if c:
                    out |= rings_on_host[h]
        if pooled:
            pools = {pool_of[h] for h, c in enumerate(placement) if c and pool_of[h] >= 0}
            if pools:
                out |= {job_id for job_id, o in running.items()
                        if any(c and pool_of[h] in pools for h, c in enumerate(o.placement))}
        return out

    # Each pass consumes an arrival or a completion entry (or raises), so passes <= arrivals + entries pushed.
    events = 0
    pushes = [0]
    while next_arrival < len(arrivals) or running or pending:
        events += 1
        if events > len(arrivals) + pushes[0] + 1:
            raise RuntimeError(f"simulation of {name} did not end after {events} events")
        # stale completion entries (a ring re-timed since) are dropped here
        while completions and (completions[0][2] not in running or running[completions[0][2]].version != completions[0][1]):
            heapq.heappop(completions)
        t_done = completions[0][0] if completions else math.inf
        t_arr = arrivals[next_arrival].submit_s if next_arrival < len(arrivals) else math.inf
        now = min(t_done, t_arr)
        if now == math.inf:
            raise RuntimeError(f"{name} left {len(pending)} job(s) pending on an idle cluster with no arrival to "
                               f"come (first: {next(iter(pending))!r})")
        # completions at `now`
        finished: list[_Running] = []
        while completions and completions[0][0] <= now:
            end, version, job_id = heapq.heappop(completions)
            r = running.get(job_id)
            if r is None or r.version != version:
                continue
            finished.append(r)
        touched: set[str] = set()
        for r in finished:
            job = r.job
            done = r.done_at_mark + r.rate * (now - r.t_mark)
            assert math.isclose(done, job.samples, rel_tol=1e-6, abs_tol=1e-6), \
                f"work not conserved for {job.job_id}: {done} of {job.samples} samples"
            del running[job.job_id]
            for h, c in enumerate(r.placement):
                free[h] += c
                if r.spans and c:
                    link_rings[h] -= 1
                    rings_on_host[h].discard(job.job_id)
            busy_slot_s += sum(r.placement) * (now - r.start_s)
            outcomes.append(JobOutcome(job.job_id, job.model, job.submit_s, r.start_s, now, r.placement,
                                       job.samples, job.utility(now - job.submit_s)))
            if r.spans or pooled:
                touched |= neighbours(r.placement)
        # arrivals at `now`
        while next_arrival < len(arrivals) and arrivals[next_arrival].submit_s <= now:
            j = arrivals[next_arrival]
            pending[j.job_id] = j
            next_arrival += 1
        # schedule
        if pending and any(free):
            calls += 1
            view = ClusterView(now_s=now, cluster=cluster, free=tuple(free), pending=tuple(pending.values()),
                               running=_RunningView(running, now), cost=cost)
            decided = scheduler.schedule(view)
            check_free = list(free)
            _validate(decided, pending, check_free, cluster, now, name)
            for job_id, p in decided.items():
                job = pending.pop(job_id)
                r = _Running(job, p, now)
                running[job_id] = r
                decisions_log.append(Decision(now, job_id, p))
                for h, c in enumerate(p):
                    free[h] -= c
                    if r.spans and c:
                        link_rings[h] += 1
                        rings_on_host[h].add(job_id)
                touched.add(job_id)
                if r.spans or pooled:
                    touched |= neighbours(p)
            assert free == check_free
        for job_id in touched:
            if job_id in running:
                retime(running[job_id], now)
        if check_every and events % check_every == 0:
            used = [0] * len(slots)
            for r in running.values():
                for h, c in enumerate(r.placement):
                    used[h] += c
            assert all(free[h] == slots[h] - used[h] >= 0 for h in range(len(slots))), "slot bookkeeping broken"
        if progress is not None and time.monotonic() - last_progress > progress_every_s:
            last_progress = time.monotonic()
            progress(f"{name}: t={now / 3600:.1f} h, {len(outcomes)}/{len(arrivals)} done, "
                     f"{len(running)} running, {len(pending)} pending")
    makespan = (max(o.end_s for o in outcomes) - first_submit) if outcomes else 0.0
    jct = np.array([o.jct_s for o in outcomes]) if outcomes else np.zeros(1)
    queue = np.array([o.queue_s for o in outcomes]) if outcomes else np.zeros(1)
    total_slots = sum(slots)
    return SimulationResult(
        scheduler=name, outcomes=tuple(outcomes), decisions=tuple(decisions_log),
        total_utility=float(sum(o.utility for o in outcomes)),
        jct_mean_s=float(jct.mean()), jct_p50_s=float(np.percentile(jct, 50)), jct_p99_s=float(np.percentile(jct, 99)),
        queue_mean_s=float(queue.mean()), queue_p99_s=float(np.percentile(queue, 99)),
        makespan_s=makespan, utilization=busy_slot_s / (total_slots * makespan) if makespan > 0 else 0.0,
        busy_slot_s=busy_slot_s, scheduler_calls=calls, wall_s=time.monotonic() - wall0)
