"""The job manager's sans-IO core: slots per host, the queue, the running jobs, the scheduler's decisions.

No sockets, no processes, no clock of its own: the shell (:mod:`hmp.manager.service`) feeds it events with
the time (a submission, a job's end) and gets back what to do (:class:`Start` a job on a placement).
On every arrival and completion the core asks the :class:`~hmp.gadget.interface.Scheduler` which
pending jobs start now, and where, and checks the answer before acting on it: a placement that names
an unknown or already running job, does not fit the free slots (also counting the other jobs started
by the same answer), or gives a job fewer than ``min_workers`` or more than ``max_workers`` workers is
refused (kept in :attr:`ManagerCore.refused` and logged by the shell), never run: a scheduler bug
must not put two workers on one slot.

The core also keeps, for each running job, the cost model's predicted iteration time averaged over
the job's run (time-weighted: the prediction changes as other rings start and end on the links the
job crosses), which the shell reports beside the measured one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hmp.gadget.interface import ClusterSpec, ClusterView, CostModel, PendingJob, Placement, RunningJob, Scheduler


@dataclasses.dataclass(frozen=True)
class Start:
    """Decision: start job ``job_id`` with ``placement[i]`` workers on ``cluster.hosts[i]``."""

    job_id: str
    placement: Placement
    predicted_iteration_s: float  # the cost model's iteration time at the start (nan: the model does not know it)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A placement of the scheduler's that the core did not run, and why."""

    job_id: str
    placement: Placement
    reason: str


@dataclasses.dataclass
class _Running:
    pending: PendingJob
    placement: Placement
    start_s: float
    predicted_s: float             # the current prediction (changes with the other rings)
    weighted_s: float = 0.0        # integral of the prediction over the run so far
    weighted_span_s: float = 0.0   # time of the run that had a prediction
    since_s: float = 0.0           # when weighted_s was last brought up to date
    samples_done: float = 0.0      # predicted work done (for the scheduler's view of samples left)


class ManagerCore:
    """The job manager's state: see the module docstring. Times are seconds on the shell's clock."""

    def __init__(self, cluster: ClusterSpec, scheduler: Scheduler, cost: CostModel) -> None:
        self.cluster = cluster
        self.scheduler = scheduler
        self.cost = cost
        self.free = [h.slots for h in cluster.hosts]
        self.pending: list[PendingJob] = []          # in submit order
        self.running: dict[str, _Running] = {}
        self.refused: list[Refusal] = []

    # ------------------------------------------------------------------ events
    def submit(self, job: PendingJob, now_s: float) -> list[Start]:
        """A job arrives. ValueError when it can never run here (more workers than the cluster has, a
        duplicate id): the shell refuses the submission and nothing changes."""
        if job.job_id in self.running or any(p.job_id == job.job_id for p in self.pending):
            raise ValueError(f"job id {job.job_id!r} is already in use")
        if job.min_workers > self.cluster.total_slots:
            raise ValueError(f"min_workers {job.min_workers} is more than the cluster's {self.cluster.total_slots} "
                             f"worker slots")
        self.pending.append(job)
        return self._schedule(now_s)

    def finish(self, job_id: str, now_s: float) -> list[Start]:
        """A running job ended (done, failed or stopped): its slots are free again."""
        run = self.running.get(job_id)
        if run is None:
            raise KeyError(f"job {job_id!r} is not running")
        self._advance(now_s)
        del self.running[job_id]
        for i, n in enumerate(run.placement):
            self.free[i] += n
        self._repredict()
        return self._schedule(now_s)

    def withdraw(self, job_id: str) -> bool:
        """Drop a pending job (cancelled before it started); False when it is not pending."""
        before = len(self.pending)
        self.pending = [p for p in self.pending if p.job_id != job_id]
        return len(self.pending) != before

    def predicted_iteration_s(self, job_id: str, now_s: float) -> float:
        """The running job's predicted iteration time, averaged over its run up to ``now_s``."""
        self._advance(now_s)
        run = self.running[job_id]
        return run.weighted_s / run.weighted_span_s if run.weighted_span_s > 0 else run.predicted_s

    # ------------------------------------------------------------------ scheduling
    def view(self, now_s: float) -> ClusterView:
        running = {}
        for jid, r in self.running.items():
            p = r.pending
            running[jid] = RunningJob(job_id=jid, model=p.model, placement=r.placement, start_s=r.start_s,
                                      samples_left=max(0.0, p.samples - r.samples_done), utility=p.utility,
                                      attained_s=sum(r.placement) * (now_s - r.start_s), submit_s=p.submit_s)
        return ClusterView(now_s=now_s, cluster=self.cluster, free=tuple(self.free), pending=tuple(self.pending),
                           running=running, cost=self.cost)

    def _schedule(self, now_s: float) -> list[Start]:
        if not self.pending:
            return []
        self._advance(now_s)
        decision = self.scheduler.schedule(self.view(now_s))
        by_id = {p.job_id: p for p in self.pending}
        starts: list[Start] = []
        for job_id, placement in decision.items():
            placement = tuple(int(n) for n in placement)
            reason = self._check(job_id, placement, by_id)
            if reason:
                self.refused.append(Refusal(job_id, placement, reason))
                continue
            job = by_id.pop(job_id)
            for i, n in enumerate(placement):
                self.free[i] -= n
            self.running[job_id] = _Running(job, placement, now_s, float("nan"), since_s=now_s)
            starts.append(Start(job_id, placement, float("nan")))
        if starts:
            started = {s.job_id for s in starts}
            self.pending = [p for p in self.pending if p.job_id not in started]
            self._repredict()
            starts = [dataclasses.replace(s, predicted_iteration_s=self.running[s.job_id].predicted_s) for s in starts]
        return starts

    def _check(self, job_id: str, placement: Placement, pending: dict[str, PendingJob]) -> str:
        job = pending.get(job_id)
        if job is None:
            return "not a pending job (unknown, running, or placed twice in one answer)"
        if len(placement) != len(self.cluster.hosts) or any(n < 0 for n in placement):
            return f"a placement needs one count >= 0 per host ({len(self.cluster.hosts)})"
        if any(n > f for n, f in zip(placement, self.free)):
            return f"does not fit the free slots {tuple(self.free)}"
        if not job.min_workers <= sum(placement) <= job.max_workers:
            return f"{sum(placement)} workers, outside [{job.min_workers}, {job.max_workers}]"
        return ""

    # ------------------------------------------------------------------ predictions
    def _advance(self, now_s: float) -> None:
        """Bring each running job's prediction integral and predicted progress up to ``now_s``."""
        for r in self.running.values():
            dt = now_s - r.since_s
            if dt > 0 and r.predicted_s == r.predicted_s:  # not nan
                r.weighted_s += r.predicted_s * dt
                r.weighted_span_s += dt
                try:
                    per_iteration = self.cost.samples_per_iteration(r.pending.model, sum(r.placement))
                    r.samples_done += dt / r.predicted_s * per_iteration
                except (KeyError, ValueError):
                    pass
            r.since_s = max(r.since_s, now_s)

    def _repredict(self) -> None:
        """Each running ring's predicted iteration time given the others now running."""
        rings: Sequence[tuple[str, str, Placement]] = [(j, r.pending.model, r.placement) for j, r in self.running.items()]
        for jid, model, placement in rings:
            others = [(m, p) for j, m, p in rings if j != jid]
            try:
                self.running[jid].predicted_s = float(self.cost.iteration_s(model, placement, others))
            except (KeyError, ValueError):  # a model type the cost model does not know: no prediction
                self.running[jid].predicted_s = float("nan")


__all__ = ["ManagerCore", "Refusal", "Start"]
