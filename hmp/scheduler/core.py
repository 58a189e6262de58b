"""The scheduler's sans-IO core: membership, liveness, stop rules, the work cursor and the run report.

No sockets, no asyncio, no clock of its own: the daemon shell (:mod:`hmp.nodes.scheduler`) decodes
a request, calls the method named after it with ``now`` (``time.monotonic()``), turns the returned
decision into the reply, and hands the events the call produced (:meth:`SchedulerCore.take_events`)
to whoever cares (logs, the placement loop, the shell's own asyncio events). Tests drive it with
scripted events and clocks.

Events in (methods), decisions out (return values):

* ``join(sender, role, address, pid, now)`` -> :class:`Admitted` (the welcome's ``info``),
  :class:`Held` (a worker before every shard has joined: the shell waits for :class:`ShardsReady`,
  then calls ``admit(sender, generation, now)``; only the newest held join of a worker is admitted,
  older ones are refused), or :class:`Refused` (the job is over).
* ``heartbeat(sender, now, step)`` -> None (ack) or :class:`Refused` (the job is over: shut down).
* ``report(sender, metrics, done, now)`` -> :class:`Assignment` (batch size, data share, stop).
* ``work(sender, count, now)`` -> :class:`WorkRange`: the next examples of the current epoch,
  first come first served (count 0: the epochs are used up, or the job is stopping).
* ``target_judged(candidate, metrics, now)`` -> the stop reason, or "" (after :class:`TargetReported`).
* ``leave(sender, reason, now)``; ``tick(now)`` (the liveness and join-deadline rules, called
  every tenth of a heartbeat interval); ``request_stop(reason, now)`` (an outside stop rule, e.g. the
  pipeline's epochs are done); ``fail(reason)``; ``interrupt()``; ``end()``.

Events out (:meth:`SchedulerCore.take_events`): :class:`MemberChanged` (every state change;
``roster`` marks the changes to the set of workers available for work, which the placement loop
re-plans on), :class:`ShardsReady`, :class:`ShardsChanged`, :class:`RingFormed`, :class:`WorkerDropped`,
:class:`WorkersDone`, :class:`StopDecided`, :class:`TargetReported`, :class:`JobFailed`.

Membership (:mod:`hmp.scheduler.membership`) is a state machine: EXPECTED -> (JOINING ->) LIVE;
LIVE -> SUSPECT after 2 silent heartbeat intervals, back to LIVE when heard from; LIVE, SUSPECT or
DONE -> LOST after 2.8 (checked every 0.1 interval: at most 2.9 intervals after its last message);
LIVE -> DONE on a worker's final report; any -> LEFT on ``leave``. A lost
PS shard fails the job, unless ``[job] restarts`` gives role ``ps`` a restart left (docs/protocol.md,
"Shard restarts"): then it is down (:class:`ShardsChanged`: the shell tells every worker, whose
pushes to it wait) until it joins again (a new process with ``--resume``, at a new address: the
workers learn it the same way and re-send their pushes in flight) or is heard from again (a stalled
one), and the job fails only if it is not back within ``join_timeout_s``. The report's
``shard_restarts`` says per restart the updates lost: the shard's version before the crash as last
known (its heartbeats, and the workers' last replies from it: :meth:`SchedulerCore.shard_version_seen`)
minus the version it resumed at (its checkpoint's). A worker that is lost, fails or leaves before it is done does not
(``tolerate_worker_loss``, the default; docs/architecture.md, "Elastic workers"): it is dropped
(:class:`WorkerDropped`: the shell tells every PS shard, so that sync rounds and SSP bounds stop
waiting for it), the work ranges it held go back to the queue, an allreduce ring re-forms without
it, and the job fails only when fewer than ``[train] min_workers`` workers remain (live, joining,
done, or expected back: lost or failed while ``[job] restarts`` allows its role another restart,
until ``join_timeout_s`` passes). A dropped worker may come back: heard from again (PS and
pipeline jobs) or joining again (a restarted process; in an allreduce job the ring re-forms with
it). The report's ``membership`` lists who was lost, left, failed, rejoined or restarted, and when;
``work_redone`` the examples handed out again. A node still EXPECTED or JOINING ``join_timeout_s`` after
:meth:`SchedulerCore.start` fails the job.

Replicated shards (``[ps] replicas = 2``, docs/resilience.md): each chunk group (named by the shard
it was first assigned to) has a primary and a backup (:attr:`SchedulerCore.replica_map`). A lost shard
does not fail the job nor wait for a restart: each group it served fails over to its backup
(:class:`ReplicasChanged`: the shell tells every live shard, then the workers, whose pushes to the lost
shard go to the promoted one with the same ``seq``), and each group left without a backup gets one on
the next live shard (the primary sends it a copy); with no other live shard the group runs unreplicated,
which the report's ``unreplicated`` says. A shard restarted later (``[job] restarts``) joins as a backup.
The job fails only if a group loses both copies. The report's ``shard_failovers`` says when, who took
over and how long it took (:meth:`SchedulerCore.replicas_applied`). A shard failed over that is heard
from again (a stalled process) is told to shut down: its groups are served elsewhere.

Resuming (``--resume``, docs/resilience.md): :meth:`SchedulerCore.state_dict` is what a scheduler saves
next to the shards' checkpoints (the work cursor and epoch, the ranges not done, the best figures, each
worker's progress and the report so far), and :meth:`SchedulerCore.resume` continues from it: the
cursor where it was, each worker's counters (its welcome's ``resume``; with static data shares the
epoch to start from, ``start_epoch``), and the report appended to, its times running on from the
previous part's (``time_offset``). ``max_seconds`` counts this part's time.

Stop rules, judged on each progress report: ``[train] target_accuracy`` (the best reported test
accuracy), ``target_loss`` (the best reported test loss), ``target`` of ``target_metric`` (its best
reported value, in the metric's direction: docs/task.md), ``max_seconds`` (since the first worker
was admitted). Once a stop reason is set every reply tells the workers to stop. With
``confirm_targets`` (PS jobs; :mod:`hmp.train.stop_rule`) a target reached on a worker's replica is
only a candidate: :class:`TargetReported` asks the shell to evaluate the parameters it pulls from
the shards, and :meth:`SchedulerCore.target_judged` stops the job only if those meet the target
(they are then the job's result: ``final`` and ``model.pt``). When every worker
is DONE or LEFT (or LOST, in a pipeline job) the core emits :class:`WorkersDone`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from hmp.batching.adapter import PolicyAdapter
from hmp.config import Config, Consistency, Role
from hmp.errors import RequestError
from hmp.messages import ReplicaInfo, RingInfo, WelcomeInfo
from hmp.ps.sharding import initial_replicas, next_backup
from hmp.report import RunReport
from hmp.train.stop_rule import TargetConfirmation, target_reason
from hmp.train.task import better, evaluation_of, primary_metric
from hmp.scheduler.membership import (CONNECTED, LOST_AFTER, NOT_JOINED, SUSPECT_AFTER, UP, Change, Member,
                                      MemberState, Membership)

S = MemberState


# ---------------------------------------------------------------- decisions (return values)
@dataclasses.dataclass(frozen=True)
class Admitted:
    """Welcome the node; ``info`` goes into its ``welcome`` (shards; workers: index, batch size)."""

    info: WelcomeInfo


@dataclasses.dataclass(frozen=True)
class Held:
    """A worker's join waits until every shard has joined; then ``admit(sender, generation, now)``."""

    generation: int


@dataclasses.dataclass(frozen=True)
class Refused:
    """The job is over: tell the node to shut down."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The answer to a progress report."""

    batch_size: int
    data_share: float = 1.0
    stop: bool = False


@dataclasses.dataclass(frozen=True)
class WorkRange:
    """Examples ``[start, start + count)`` of epoch ``epoch``'s order; count 0: no more work."""

    count: int
    epoch: int
    start: int = 0


# ---------------------------------------------------------------- events (take_events)
@dataclasses.dataclass(frozen=True)
class MemberChanged:
    """A member changed state. ``roster``: a worker became available for work or stopped being
    (joined, came back, was lost, or left while the job is not stopping)."""

    change: Change
    roster: bool = False


@dataclasses.dataclass(frozen=True)
class ShardsReady:
    """Every PS shard has joined: held worker joins may be admitted now."""


@dataclasses.dataclass(frozen=True)
class ShardsChanged:
    """A PS shard went down (lost, expected back) or came back (restarted at ``shards``' new address,
    or heard from again): the shell tells every worker (``shards``, change number ``epoch``)."""

    epoch: int
    shards: tuple[tuple[str, str], ...]
    down: tuple[str, ...]
    why: str


@dataclasses.dataclass(frozen=True)
class ReplicasChanged:
    """(``[ps] replicas = 2``) Who serves and who backs up each chunk group changed (``groups``:
    ``(group, primary, backup)``; ``epoch`` shares the counter of :class:`ShardsChanged`): the shell tells
    every live shard (``replicas``), then every worker where each group is served now (``shards``: group id
    -> its primary's address) and reports the promotion's duration with :meth:`SchedulerCore.replicas_applied`."""

    epoch: int
    groups: tuple[tuple[str, str, str], ...]
    shards: tuple[tuple[str, str], ...]
    why: str
    tell_workers: bool = True
    #: ``(shard id, address)`` of every shard as it joined: where the shards reach each other's backups
    addresses: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class RingFormed:
    """(``consistency = "allreduce"``) The workers' ring, generation ``generation``: ``members`` (ids)
    at ``addresses``, in rank order. Generation 1 forms once every worker has joined (held worker
    joins may be admitted now: their welcome carries it); each later one re-forms it from the
    survivors after a member was lost or failed, and the shell tells each member (``ring_assign``)."""

    generation: int
    members: tuple[str, ...]
    addresses: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class WorkerDropped:
    """Worker ``node`` is gone while the job runs (lost, failed, left early, or replaced by a new
    process): the shell sends every PS shard a ``drop`` so that their sync rounds and SSP bounds
    stop waiting for it."""

    node: str
    reason: str


@dataclasses.dataclass(frozen=True)
class WorkersDone:
    """Every worker is done or gone: the job may finish."""


@dataclasses.dataclass(frozen=True)
class StopDecided:
    """A stop rule fired; from now on workers are told to stop."""

    reason: str
    elapsed_s: float


@dataclasses.dataclass(frozen=True)
class TargetReported:
    """(``confirm_targets``) A worker reported a target reached on its replica (``candidate``, the would-be
    stop reason): the shell evaluates the parameters the shards hold and calls ``target_judged``."""

    candidate: str


@dataclasses.dataclass(frozen=True)
class JobFailed:
    """The job cannot go on (a node lost or missing, a worker failed, placement failed)."""

    reason: str


Event = (MemberChanged | ShardsReady | ShardsChanged | ReplicasChanged | RingFormed
         | WorkerDropped | WorkersDone | StopDecided | TargetReported | JobFailed)


class SchedulerCore:
    """One job's scheduling state. ``n_train``: examples per epoch (the work cursor's range);
    ``policy``: the batch policy (default: built from ``[train] policy``); ``sharding``: the chunk
    placement for the report; ``tolerate_worker_loss`` (default True): a lost or failed worker is
    dropped and the job goes on while ``[train] min_workers`` remain (False: the first lost or
    failed worker fails the job); ``confirm_targets`` (default False): a target stop rule waits for
    the shell's evaluation of the parameters that will be the result (module docstring)."""

    def __init__(self, cfg: Config, n_train: int, policy: PolicyAdapter | None = None, *,
                 sharding: dict[str, Any] | None = None, tolerate_worker_loss: bool | None = None,
                 confirm_targets: bool = False) -> None:
        self.cfg = cfg
        self.n_train = n_train
        self.interval = cfg.job.heartbeat_interval_s
        self.membership = Membership((n.id, n.role) for n in cfg.nodes if n.role != Role.SCHEDULER)
        self.worker_ids = [w.id for w in cfg.workers]
        self.shard_ids = [s.id for s in cfg.shards]
        self.policy: PolicyAdapter = policy if policy is not None else PolicyAdapter(cfg)
        self.allreduce = cfg.train.consistency == Consistency.ALLREDUCE
        self.tolerate_worker_loss = True if tolerate_worker_loss is None else tolerate_worker_loss
        self.min_workers = cfg.train.min_workers  # 1 .. the number of workers: the config loader checks it
        # [job] restarts: a worker lost or failed while its role may still be restarted by the launcher
        # counts as remaining until it rejoins or ``join_timeout_s`` passes (deadline by worker).
        # A lost shard likewise, while role ps may be restarted: it is down, and the job waits for it.
        self.restarts_left = {n.id: int(cfg.job.restarts.get(n.role, 0)) for n in (*cfg.workers, *cfg.shards)}
        self.awaiting_restart: dict[str, float] = {}
        self.shards_down: set[str] = set()
        self.shard_epoch = 0  # ShardsChanged events so far
        # Restarted shards whose resumed version (the first heartbeat's step) is not known yet:
        # their entries of the report's shard_restarts.
        self._restart_pending: dict[str, dict[str, Any]] = {}
        # [ps] replicas = 2: group -> [primary, backup] ("" no backup); the shards failed over (not taken back)
        self.replicas = cfg.ps.replicas if self.shard_ids else 1
        self.replica_map: dict[str, list[str]] = ({g: list(pb) for g, pb in initial_replicas(self.shard_ids).items()}
                                                  if self.replicas > 1 else {})
        self.failed_over: set[str] = set()
        self._failover_pending: dict[int, dict[str, Any]] = {}  # by epoch: report entries awaiting the shards' acks
        self.run_report = RunReport(job=cfg.job.name, config=cfg.path, consistency=cfg.train.consistency,
                                    policy=cfg.train.policy)
        self.run_report.sharding = dict(sharding or {})
        self.best_accuracy = 0.0
        self.best_test_loss = float("inf")
        # The task's metric the progress line and the report follow (test_accuracy, r2, [train] target_metric, ...)
        # and the best value of it reported, in its own direction (None: none yet).
        self.metric = primary_metric(cfg)
        self.best_metric: float | None = None
        self.confirm_targets = confirm_targets
        self.confirmation = TargetConfirmation(retry_after_s=cfg.train.eval_every_s)
        self.t0: float | None = None  # the first worker's admission: the run's clock starts
        self.join_deadline: float | None = None  # set by start()
        self.stop_reason = ""
        self.failed: str | None = None
        self.over = False  # end(): every node is told to shut down
        self.shards_ready = not self.shard_ids  # an allreduce job has none to wait for
        self.workers_done = False
        # allreduce: the workers' ring (generation 0: not formed yet, every worker has to join first)
        self.ring_generation = 0
        self.ring_members: tuple[str, ...] = ()
        # First-come-first-served data (Hogbatch): a cursor over each epoch's shuffled order.
        self.work_epoch, self.work_cursor = 0, 0
        self.finished_workers: set[str] = set()  # sent their final report (done, not missing)
        self.work_taken: dict[str, int] = {}
        # Ranges handed out and not yet done, per worker ((epoch, start, count); a worker's next
        # ``work`` request or final report marks its range done), and a lost worker's ranges,
        # handed out again before the cursor advances.
        self.work_outstanding: dict[str, tuple[int, int, int]] = {}
        self.work_requeued: list[tuple[int, int, int]] = []
        self._events: list[Event] = []
        # --resume: the previous parts' training time (report times run on from it), and each worker's
        # counters as the previous part last knew them (its welcome carries them)
        self.time_offset = 0.0
        self.resumed_progress: dict[str, dict[str, float]] = {}

    # ---------------------------------------------------------------- outputs
    def take_events(self) -> list[Event]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def elapsed(self, now: float) -> float:
        """Seconds since the first worker was admitted (0 before), in this part of a resumed run."""
        return 0.0 if self.t0 is None else now - self.t0

    def run_time(self, now: float) -> float:
        """The run's training time: the previous parts' (``--resume``) and this one's: the report's clock."""
        return self.time_offset + self.elapsed(now)

    # ---------------------------------------------------------------- --resume
    def state_dict(self, now: float) -> dict[str, Any]:
        """What a resumed scheduler continues from (plain data, JSON): the work cursor, the ranges handed
        out and not done (they are handed out again), the best figures, each worker's counters and the
        report so far."""
        pending = list(self.work_requeued) + list(self.work_outstanding.values())
        progress: dict[str, dict[str, float]] = {}
        for w, d in self.run_report.workers.items():
            last = d["final"] or (d["series"][-1] if d["series"] else {})
            progress[w] = {k: last[k] for k in ("samples", "updates", "epoch") if k in last}
        # A finished run's time is its training time (the final evaluation and the report are not training).
        elapsed = self.run_report.final.get("elapsed_s", self.run_time(now))
        return {"format": 1, "job": self.cfg.job.name, "written_at": time.time(), "elapsed_s": elapsed,
                "work_epoch": self.work_epoch, "work_cursor": self.work_cursor,
                "work_pending": [list(r) for r in pending], "work_taken": dict(self.work_taken),
                "best_accuracy": self.best_accuracy,
                "best_test_loss": None if self.best_test_loss == float("inf") else self.best_test_loss,
                "best_metric": self.best_metric, "progress": progress, "report": self.run_report.state()}

    def resume(self, state: dict[str, Any], source: str) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (read from ``source``, named in the report). Raises
        ``ValueError`` (what is wrong) for a state of another job or format."""
        if state.get("format") != 1:
            raise ValueError(f"scheduler state format {state.get('format')!r}; this hmp reads format 1")
        if state.get("job") != self.cfg.job.name:
            raise ValueError(f"the state of job {state.get('job')!r}, not of {self.cfg.job.name!r}")
        self.work_epoch, self.work_cursor = int(state["work_epoch"]), int(state["work_cursor"])
        self.work_requeued = [(int(e), int(s), int(c)) for e, s, c in state.get("work_pending", [])]
        self.work_taken = {str(w): int(n) for w, n in state.get("work_taken", {}).items()}
        self.best_accuracy = float(state.get("best_accuracy") or 0.0)
        loss = state.get("best_test_loss")
        self.best_test_loss = float("inf") if loss is None else float(loss)
        best = state.get("best_metric")
        self.best_metric = None if best is None else float(best)
        self.time_offset = float(state["elapsed_s"])
        self.resumed_progress = {str(w): dict(p) for w, p in state.get("progress", {}).items()}
        sharding = self.run_report.sharding
        self.run_report = RunReport.from_state(state["report"], config=self.cfg.path, sharding=sharding)
        self.run_report.final = {}
        self.run_report.resumes.append({
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "from": source,
            "elapsed_s": round(self.time_offset, 3), "epoch": self.work_epoch, "cursor": self.work_cursor})

    def start_epoch(self) -> int:
        """(static data shares) The epoch a resumed run's workers start from: the earliest one a worker
        was in (its slice of it is trained again); 0 when not resumed."""
        epochs = [int(p["epoch"]) for p in self.resumed_progress.values() if "epoch" in p]
        return min(epochs) if epochs else 0

    @property
    def end_reason(self) -> str:
        return self.failed or self.stop_reason or "job over"

    @property
    def stopping(self) -> bool:
        """Workers are told to stop (a stop rule fired or the job failed)."""
        return bool(self.stop_reason or self.failed)

    def status(self, now: float) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed(now), "stop_reason": self.stop_reason, "failed": self.failed or "",
                "members": self.membership.states(), "workers": self.run_report.latest(),
                "shards_down": sorted(self.shards_down),
                **({"replicas": {g: list(pb) for g, pb in self.replica_map.items()}} if self.replica_map else {}),
                "best_accuracy": self.best_accuracy,
                "best_test_loss": self.best_test_loss if self.best_test_loss != float("inf") else None,
                "best_metric": None if self.best_metric is None else {"name": self.metric, "value": self.best_metric}}

    # ---------------------------------------------------------------- helpers
    def _move(self, m: Member, new: MemberState, why: str = "") -> None:
        change = self.membership.transition(m, new, why)
        if change is None:
            return
        roster = m.is_worker and ((new in UP and change.old not in UP) or new == S.LOST
                                  or (new == S.LEFT and not self.stop_reason))
        self._events.append(MemberChanged(change, roster))

    def _heard(self, m: Member, now: float) -> None:
        """Any message from a member: it is alive."""
        m.last_seen = now
        if m.state == S.SUSPECT:
            self._move(m, S.LIVE, "heard from again")
        elif m.state == S.LOST and m.is_worker and self.tolerate_worker_loss and not self.over and not self.allreduce:
            # A worker that was only stalled (a busy machine, SIGSTOP) is back: it gets work (and,
            # in a pipeline job, is planned with) again; the shards count it from its next push.
            self._move(m, S.LIVE, "back after being lost")
            self._record(m.id, "rejoined", "heard from again after being lost", now)
        elif m.state == S.LOST and m.id in self.shards_down and not self.over:
            # A stalled shard is back with its state: the workers re-send what was in flight to it.
            self._move(m, S.LIVE, "back after being lost")
            self._record(m.id, "rejoined", "heard from again after being lost", now)
            self._shard_up(m, "heard from again")

    # ---------------------------------------------------------------- shards down and back
    def _shard_down(self, m: Member, why: str, now: float) -> None:
        """Shard ``m`` is lost while its role may be restarted: the job waits ``join_timeout_s`` for it."""
        self.restarts_left[m.id] -= 1
        self.awaiting_restart[m.id] = now + self.cfg.job.join_timeout_s
        self._record(m.id, "lost", f"{why}; expected back within {self.cfg.job.join_timeout_s} s", now)
        self.shards_down.add(m.id)
        self._shards_changed(f"{m.id} lost ({why})")

    def _shard_up(self, m: Member, why: str) -> None:
        self.awaiting_restart.pop(m.id, None)
        self.shards_down.discard(m.id)
        self._shards_changed(f"{m.id} {why}")

    def _shards_changed(self, why: str) -> None:
        self.shard_epoch += 1
        self._events.append(ShardsChanged(self.shard_epoch, self.shard_addresses(), tuple(sorted(self.shards_down)),
                                          why))

    # ---------------------------------------------------------------- replicas ([ps] replicas = 2)
    def primary_of(self, group: str) -> str:
        """The shard serving chunk group ``group`` now (itself without replicas)."""
        return self.replica_map[group][0] if self.replica_map else group

    def _live_shards(self) -> set[str]:
        return {s for s in self.shard_ids if self.membership[s].state in UP and s not in self.failed_over}

    def _failover(self, m: Member, why: str, silent: float, now: float) -> None:
        """Shard ``m`` is lost: its groups' backups take over, and groups left without a backup get one."""
        lost = m.id
        self.failed_over.add(lost)
        promoted: dict[str, str] = {}
        for group, (primary, backup) in self.replica_map.items():
            if primary == lost:
                if not backup or backup not in self._live_shards():
                    self._record(lost, "lost", why, now)
                    self.fail(f"PS shard {lost} was lost and the backup of its chunk group {group} "
                              f"({backup or 'none'}) is gone too: the group has no copy left")
                    return
                self.replica_map[group] = [backup, ""]
                promoted[group] = backup
            elif backup == lost:
                self.replica_map[group][1] = ""
        self._record(lost, "lost", f"{why}; " + (", ".join(f"group {g} fails over to {p}" for g, p in promoted.items())
                                                  or "it held backups only"), now)
        self._rebuild_backups(now)
        entry = {"shard": lost, "t": round(self.run_time(now), 3), "detected_after_s": round(silent, 3),
                 "promoted": promoted, "promote_s": None, "epoch": self.shard_epoch + 1}
        self.run_report.shard_failovers.append(entry)
        self._failover_pending[entry["epoch"]] = {"entry": entry, "since": now}
        self._replicas_changed(f"{lost} lost ({why})")

    def _rebuild_backups(self, now: float) -> None:
        """Give every group without a backup the next live shard after its primary; a group with none
        available runs unreplicated (the report's ``unreplicated`` says from when until when)."""
        live = self._live_shards()
        t = round(self.run_time(now), 3)
        for group, pair in self.replica_map.items():
            open_gap = next((u for u in self.run_report.unreplicated if u["group"] == group and u["until_t"] is None),
                            None)
            if not pair[1]:
                pair[1] = next_backup(self.shard_ids, pair[0], live)
            if not pair[1] and open_gap is None:
                self.run_report.unreplicated.append({"group": group, "primary": pair[0], "from_t": t, "until_t": None})
            elif pair[1] and open_gap is not None:
                open_gap["until_t"] = t

    def _replicas_changed(self, why: str, tell_workers: bool = True) -> None:
        self.shard_epoch += 1
        self._events.append(ReplicasChanged(self.shard_epoch, self._replica_groups(), self.shard_addresses(), why,
                                            tell_workers, self.replica_shards()))

    def _replica_groups(self) -> tuple[tuple[str, str, str], ...]:
        return tuple((g, p, b) for g, (p, b) in self.replica_map.items())

    def replica_shards(self) -> tuple[tuple[str, str], ...]:
        """``((shard id, address), ...)`` of every shard as it joined (where the shards reach each other)."""
        return tuple((s, self.membership[s].address) for s in self.shard_ids)

    def replicas_applied(self, epoch: int, now: float) -> None:
        """The shell told every live shard of change ``epoch`` and each answered: the failover it
        carried (if any) is done; its report entry gets ``promote_s``."""
        pending = self._failover_pending.pop(epoch, None)
        if pending is not None:
            pending["entry"]["promote_s"] = round(now - pending["since"], 4)

    def shard_version_seen(self, shard: str, version: int) -> None:
        """A worker's last reply from ``shard``, now down, carried ``version`` (its answer to the
        shell's ``shards``): the shard had at least that many updates before its crash. The
        heartbeats alone know it only as of the last interval."""
        m = self.membership.get(shard)
        if shard in self.shards_down:
            m.step = max(m.step, version)

    def _shard_restarted(self, m: Member, pid: int, address: str, now: float) -> None:
        """Shard ``m``, seen before, joins from a new process (``--resume``): its report entry (the
        updates lost are known at its first heartbeat), and the workers learn its new address."""
        why = f"new process (pid {pid}, was {m.pid}) at {address}"
        self._record(m.id, "restarted", why, now)
        entry = {"node": m.id, "t": round(self.run_time(now), 3), "pid": pid, "was_pid": m.pid,
                 "address": address, "was_address": m.address, "version_before": m.step,
                 "resumed_version": None, "updates_lost": None}
        self.run_report.shard_restarts.append(entry)
        self._restart_pending[m.id] = entry
        m.address, m.pid = address, pid
        if m.state not in UP:  # lost or left; one restarted before it was noticed lost is live already
            self._move(m, S.LIVE, "restarted")
        self._shard_up(m, f"restarted ({why})")

    def _replica_restarted(self, m: Member, pid: int, address: str, now: float) -> Admitted:
        """(replicas) Shard ``m`` joins from a new process: it holds no group as primary (its groups were
        failed over, or it never lost them: then they fail over now, as its old process is gone), and
        becomes the backup of groups without one. Its welcome carries the map."""
        why = f"new process (pid {pid}, was {m.pid}) at {address}"
        if m.id not in self.failed_over:  # restarted before it was noticed lost: the old process is gone
            self._failover(m, f"restarted ({why})", now - m.last_seen, now)
            if self.failed:
                return Admitted(WelcomeInfo(shards=self.shard_addresses()))
        self._record(m.id, "restarted", f"{why}; joins as a backup", now)
        m.address, m.pid, m.last_seen = address, pid, now
        self.failed_over.discard(m.id)
        if m.state not in UP:
            self._move(m, S.LIVE, "restarted")
        self._rebuild_backups(now)
        self._replicas_changed(f"{m.id} restarted ({why})")
        return Admitted(WelcomeInfo(shards=self.replica_shards(), workers=self._workers_in(),
                                    replicas=ReplicaInfo(groups=self._replica_groups(), epoch=self.shard_epoch)))

    def _workers_in(self) -> tuple[str, ...]:
        """The workers still in the job (a restarted shard's welcome: the others hold no round or bound back)."""
        return tuple(self.membership.ids(UP | {S.JOINING}, workers=True))

    def _record(self, node: str, event: str, why: str, now: float) -> None:
        """One line of the report's membership history (``event``: lost, left, failed, rejoined, restarted)."""
        self.run_report.membership.append({"node": node, "event": event, "t": round(self.run_time(now), 3),
                                           "why": why})

    def _worker_gone(self, m: Member, event: str, why: str, now: float) -> None:
        """Worker ``m`` stopped working before it was done (lost, failed, left early): drop it from
        the shards' rounds, requeue its work, re-form the ring, and fail the job if too few remain."""
        self._record(m.id, event, why, now)
        self._requeue(m.id)
        if not self.over:
            self._events.append(WorkerDropped(m.id, f"{event}: {why}"))
        self._reform_ring(m.id, why if event == "failed" else f"{event} ({why})")
        if event != "left" and self.restarts_left.get(m.id, 0) > 0:
            self.restarts_left[m.id] -= 1
            self.awaiting_restart[m.id] = now + self.cfg.job.join_timeout_s
        self._check_min_workers(f"after {m.id} {event} ({why})")
        self._check_workers_done()

    def _check_min_workers(self, after: str) -> None:
        """Fail the job if fewer than ``min_workers`` workers remain: live, joining, done (also once they
        left after their final report), or lost but expected back from a restart."""
        if self.stopping:
            return
        # A worker that sent its final report and left did its share: it is not missing. One not joined yet is
        # still due (the join deadline fails the job if it never comes).
        remaining = [w for w in self.worker_ids
                     if self.membership[w].state in UP | {S.EXPECTED, S.JOINING, S.DONE} or w in self.awaiting_restart
                     or w in self.finished_workers]
        if len(remaining) < self.min_workers:
            who = ", ".join(remaining) or "none"
            self.fail(f"only {len(remaining)} of {len(self.worker_ids)} workers remain ({who}) {after}; "
                      f"[train] min_workers = {self.min_workers}")

    def _requeue(self, worker: str) -> None:
        """The work range ``worker`` held goes back to the queue (first-come-first-served jobs)."""
        held = self.work_outstanding.pop(worker, None)
        if held is not None and held[0] < self.cfg.train.epochs:
            self.work_requeued.append(held)

    def check_worker(self, sender: str, kind: str, now: float) -> Member:
        """The sending member, which must be a worker (reports and work units are theirs alone)."""
        m = self.membership.get(sender)
        if not m.is_worker:
            raise RequestError(f"{kind!r} is for workers; {m.id!r} is a {m.role}", "bad_role")
        self._heard(m, now)
        return m

    def _check_workers_done(self) -> None:
        gone = {S.DONE, S.LEFT} | ({S.LOST} if self.tolerate_worker_loss else set())
        if not self.workers_done and all(self.membership[w].state in gone for w in self.worker_ids):
            self.workers_done = True
            self._events.append(WorkersDone())

    def shard_addresses(self) -> tuple[tuple[str, str], ...]:
        """``((shard id, address), ...)`` in shard-index order (the welcome's and the status's ``shards``): with
        replicas, where each chunk group (named by its first shard's id) is served now, its primary's address."""
        return tuple((s, self.membership[self.primary_of(s)].address) for s in self.shard_ids)

    # ---------------------------------------------------------------- control
    def start(self, now: float) -> None:
        """The scheduler serves from ``now``: every node must join within ``join_timeout_s``."""
        self.join_deadline = now + self.cfg.job.join_timeout_s

    def fail(self, reason: str) -> None:
        """The job fails (the first reason is kept)."""
        if self.failed is None:
            self.failed = reason
            self._events.append(JobFailed(reason))

    def request_stop(self, reason: str, now: float) -> None:
        """Tell the workers to stop from now on (the first reason is kept)."""
        if not self.stop_reason:
            self.stop_reason = reason
            self._events.append(StopDecided(reason, self.elapsed(now)))

    def target_judged(self, candidate: str, metrics: dict[str, Any], now: float) -> str:
        """The shell's evaluation (``metrics``) of the parameters pulled after :class:`TargetReported`
        ``candidate``: stop when they meet the target (returns the reason, "" when they do not; the
        next candidate is then taken ``eval_every_s`` later at the soonest)."""
        reason = self.confirmation.judged(candidate, metrics, self.cfg.train, now, self.elapsed(now))
        if reason and not self.stop_reason:
            self.request_stop(f"{reason} on the PS parameters", now)
        return reason

    def interrupt(self) -> None:
        """The scheduler was stopped (signal, shutdown request) before the job finished."""
        self.stop_reason = "scheduler stopped before the job finished"

    def end(self) -> None:
        """The job is over: joins and heartbeats are answered with ``shutdown`` from now on."""
        self.over = True

    # ---------------------------------------------------------------- events in
    def join(self, sender: str, role: str, address: str, pid: int, now: float) -> Admitted | Held | Refused:
        m = self.membership.get(sender)
        m.last_seen = now
        if role != m.role:
            raise RequestError(f"{sender} joined as {role!r}; the config says {m.role!r}", "bad_role")
        if self.over:
            return Refused(self.end_reason)
        rejoin = m.is_worker and m.state not in NOT_JOINED and (m.state not in CONNECTED or pid != m.pid)
        if rejoin and self.allreduce and self.stopping:
            return Refused(f"the job is stopping ({self.end_reason}); {sender} is not taken back into the ring")
        if rejoin:
            self._rejoin(m, pid, now)
        if not m.is_worker and m.state not in NOT_JOINED and m.pid and pid != m.pid:
            if self.stopping:
                return Refused(f"the job is stopping ({self.end_reason}); restarted {sender} is not taken back")
            if self.replica_map:
                return self._replica_restarted(m, pid, address, now)
            self._shard_restarted(m, pid, address, now)
            return Admitted(WelcomeInfo(shards=self.shard_addresses(), workers=self._workers_in()))
        m.address, m.pid = address, pid
        if not m.is_worker:
            self._move(m, S.LIVE, "joined")
            if not self.shards_ready and all(self.membership[s].state in UP for s in self.shard_ids):
                self.shards_ready = True
                self._events.append(ShardsReady())
                if self.replica_map:  # the shards learn where their backups are (the workers know from their welcome)
                    self._replicas_changed("every shard has joined", tell_workers=False)
            return Admitted(WelcomeInfo(shards=self.shard_addresses() if self.shards_ready else ()))
        # A worker is held until every shard has joined (its welcome lists them). It re-sends its
        # join every few seconds meanwhile; only the newest one is admitted, so that held joins do
        # not all wake at once (each would re-run the placement loop's membership hook).
        m.joins += 1
        why = "join" if self.admitting else ("join held until every worker has joined (the ring forms then)"
                                             if self.allreduce else "join held until every shard has joined")
        self._move(m, S.JOINING, why)
        if self.allreduce and self.ring_generation and (rejoin or sender not in self.ring_members):
            # Joining a running ring (a restarted or returning worker): a new generation with it, in
            # topology order; every member resyncs on it, so the joiner starts from their state.
            members = set(self.ring_members) | {sender}
            self._form_ring([w for w in self.worker_ids if w in members], f"{sender} joined")
        if self.allreduce and not self.ring_generation and all(
                self.membership[w].state in (S.JOINING, *UP) for w in self.worker_ids):
            self._form_ring(self.worker_ids, "every worker has joined")
        if self.admitting:
            return self.admit(sender, m.joins, now)
        return Held(m.joins)

    def _rejoin(self, m: Member, pid: int, now: float) -> None:
        """Worker ``m``, seen before, joins again: a restarted process (new pid) or one that was lost
        or left. A previous process not yet declared lost is replaced: its work goes back to the queue
        and the shards drop it (the new one is counted from its first push)."""
        self.awaiting_restart.pop(m.id, None)
        restarted = bool(m.pid) and pid != m.pid
        why = f"new process (pid {pid}, was {m.pid})" if restarted else f"joined again after being {m.state}"
        if m.state in CONNECTED:
            self._requeue(m.id)
            self._events.append(WorkerDropped(m.id, f"replaced by a {why}"))
        self._record(m.id, "restarted" if restarted else "rejoined", why, now)

    @property
    def admitting(self) -> bool:
        """Worker joins are answered (not held): every shard has joined, or (allreduce) the ring is formed."""
        return self.ring_generation > 0 if self.allreduce else self.shards_ready

    def _form_ring(self, members: list[str] | tuple[str, ...], why: str) -> None:
        self.ring_generation += 1
        self.ring_members = tuple(members)
        self.run_report.rings.append({"generation": self.ring_generation, "members": list(members), "why": why})
        self._events.append(RingFormed(self.ring_generation, self.ring_members,
                                       tuple(self.membership[w].address for w in self.ring_members)))

    def _reform_ring(self, lost: str, why: str) -> None:
        """A ring member is gone: the survivors (members still up) form the next generation."""
        if not self.allreduce or lost not in self.ring_members or self.over:
            return
        survivors = [w for w in self.ring_members if w != lost and self.membership[w].state in UP]
        if survivors:
            self._form_ring(survivors, f"{lost} {why}")


    def admit(self, sender: str, generation: int, now: float) -> Admitted:
        """Admit a held worker join (call once every shard has joined); an older join than the
        worker's newest is refused."""
        m = self.membership.get(sender)
        if m.joins != generation:
            raise RequestError(f"{sender} joined again since this join; the newest join is answered", "bad_request")
        if not self.admitting:
            raise RequestError(f"{sender}: not every {'worker' if self.allreduce else 'shard'} has joined yet",
                               "bad_request")
        if m.state != S.JOINING:  # it left (or was stopped) while its join was held
            raise RequestError(f"{sender} is {m.state} since this join; not admitted", "bad_request")
        m.last_seen = now  # it was waiting for this reply, not silent
        self._move(m, S.LIVE, "admitted")
        if self.t0 is None:
            self.t0 = now
        ring = RingInfo(generation=self.ring_generation, members=self.ring_members,
                        addresses=tuple(self.membership[w].address for w in self.ring_members),
                        rank=self.ring_members.index(m.id)) if self.allreduce else None
        return Admitted(WelcomeInfo(
            shards=self.shard_addresses(), worker_index=ring.rank if ring else self.worker_ids.index(m.id),
            num_workers=len(ring.members if ring else self.worker_ids), batch_size=self.policy.initial(m.id),
            # --resume: the worker's counters go on from the previous part's
            resume=self.resumed_progress.get(m.id), start_epoch=self.start_epoch() if self.resumed_progress else None,
            # a shard went down or moved since the job began: the worker starts from this view
            shards_down=tuple(sorted(self.shards_down)) if self.shard_epoch else None,
            shard_epoch=self.shard_epoch or None, ring=ring))

    def heartbeat(self, sender: str, now: float, step: int | None = None) -> Refused | None:
        """``step``: what the heartbeat carried (a shard's version: a restart's lost updates are counted with it)."""
        m = self.membership.get(sender)
        self._heard(m, now)
        if step is not None:
            m.step = step
            entry = self._restart_pending.pop(sender, None)
            if entry is not None:  # a restarted shard's first heartbeat: the version it resumed at
                entry["resumed_version"] = step
                entry["updates_lost"] = max(0, entry["version_before"] - step)
        if self.over:
            return Refused(self.end_reason)
        if sender in self.failed_over:
            return Refused(f"{sender} was lost and its chunk groups failed over; it is not taken back")
        if self.allreduce and m.is_worker and m.state == S.LOST:
            return Refused(f"{sender} was lost and the ring went on without it (generation {self.ring_generation})")
        return None

    def report(self, sender: str, metrics: dict[str, float], done: bool, now: float) -> Assignment:
        m = self.check_worker(sender, "report", now)
        if done:
            self._move(m, S.DONE, "final report")  # before any other effect: an illegal one changes nothing
            self.finished_workers.add(m.id)
        t = self.elapsed(now)
        self.run_report.add_sample(m.id, self.time_offset + t, metrics)
        acc = metrics.get("test_accuracy")
        if acc is not None:
            self.best_accuracy = max(self.best_accuracy, acc)
        test_loss = metrics.get("test_loss")
        if test_loss is not None:
            self.best_test_loss = min(self.best_test_loss, test_loss)
        value = metrics.get(self.metric)
        if isinstance(value, (int, float)) and value == value and better(
                self.metric, value, self.best_metric, self.cfg.train.target_mode):
            self.best_metric = float(value)
        if done:
            # A worker that ran out of work asked for more first, which marked its range done; one
            # still holding a range was stopped in the middle of it (SIGTERM): it goes back to the queue.
            self._requeue(m.id)
            self.run_report.finish_worker(m.id, metrics)
            self._check_workers_done()
            return Assignment(batch_size=0, stop=True)
        if not self.stop_reason:
            tc = self.cfg.train
            # With confirm_targets, judged on this report's own evaluation (the best so far would be offered
            # again at every report); else on the best reported, as the workers' replicas saw it.
            target = (target_reason(metrics, tc) if self.confirm_targets else
                      target_reason({"test_accuracy": self.best_accuracy, "test_loss": self.best_test_loss,
                                     **({self.metric: self.best_metric} if self.best_metric is not None else {})}, tc))
            if target and not self.confirm_targets:
                self.request_stop(target, now)
            elif target and self.confirmation.offer(now):
                self._events.append(TargetReported(target))
            if not self.stop_reason and t > tc.max_seconds:
                self.request_stop(f"time limit of {tc.max_seconds} s reached", now)
        batch, share = self.policy.update(m.id, metrics, t)
        return Assignment(batch_size=batch, data_share=share, stop=self.stopping)

    def work(self, sender: str, count: int, now: float) -> WorkRange:
        """Hand out the next ``count`` examples of the current epoch to whoever asks first."""
        m = self.check_worker(sender, "work", now)
        if count < 1:
            raise RequestError(f"work count must be >= 1, got {count}", "bad_request")
        self.work_outstanding.pop(m.id, None)  # asking for more: the previous range is done
        if self.stopping:
            return WorkRange(count=0, epoch=self.work_epoch)
        if self.work_requeued:  # a lost worker's ranges first, split to the size asked for
            epoch, start, held = self.work_requeued.pop(0)
            if held > count:
                self.work_requeued.insert(0, (epoch, start + count, held - count))
            given = min(count, held)
            self.run_report.work_redone += given
        else:
            if self.work_cursor >= self.n_train:
                self.work_epoch, self.work_cursor = self.work_epoch + 1, 0
            if self.work_epoch >= self.cfg.train.epochs:
                return WorkRange(count=0, epoch=self.work_epoch)
            epoch, start = self.work_epoch, self.work_cursor
            given = min(count, self.n_train - start)
            self.work_cursor += given
        self.work_taken[m.id] = self.work_taken.get(m.id, 0) + given
        self.work_outstanding[m.id] = (epoch, start, given)
        return WorkRange(count=given, epoch=epoch, start=start)

    def leave(self, sender: str, reason: str, now: float) -> None:
        m = self.membership.get(sender)
        m.last_seen = now
        was = m.state
        if m.is_worker and was not in (S.DONE, S.LEFT):
            self.run_report.finish_worker(m.id, {})  # counted with its last progress report
        self._move(m, S.LEFT, reason)
        failed = reason.startswith("failed:")
        if not (m.is_worker and self.tolerate_worker_loss):
            if failed:
                self.fail(f"node {m.id} ({m.role}) {reason}")
        elif failed or (was in UP | {S.JOINING} and not self.stopping and not self.over):
            # Gone before it was done (a failure, or a leave while the job runs): as if lost.
            self._worker_gone(m, "failed" if failed else "left", reason, now)
        self.policy.forget(m.id)
        self._check_workers_done()

    def tick(self, now: float) -> None:
        """Liveness and the join deadline: silent members become suspect, then lost; a lost shard,
        a lost worker that leaves fewer than ``min_workers``, or a node that did not join in time
        fails the job."""
        for w, deadline in list(self.awaiting_restart.items()):
            if now > deadline:
                del self.awaiting_restart[w]
                if w in self.shards_down:
                    self.fail(f"PS shard {w} was lost and did not come back within {self.cfg.job.join_timeout_s} s "
                              "(join_timeout_s; [job] restarts allows role ps to be restarted with --resume)")
                else:
                    self._check_min_workers(f"({w} was not restarted within {self.cfg.job.join_timeout_s} s)")
        for m in self.membership:
            silent = now - m.last_seen
            if m.state in CONNECTED and silent > LOST_AFTER * self.interval:
                was_done = m.state == S.DONE
                self._move(m, S.LOST, f"silent for {silent:.1f} s")
                if not m.is_worker and self.replicas > 1 and not self.stopping:
                    self._failover(m, f"silent for {silent:.1f} s", silent, now)
                elif not m.is_worker and self.restarts_left.get(m.id, 0) > 0 and not self.stopping:
                    self._shard_down(m, f"silent for {silent:.1f} s", now)
                elif not (m.is_worker and self.tolerate_worker_loss):
                    self.fail(f"node {m.id} ({m.role}) lost: silent for {silent:.1f} s")
                elif was_done:  # its work was done; only its goodbye is missing
                    self._record(m.id, "lost", f"silent for {silent:.1f} s after its final report", now)
                    self._check_workers_done()
                else:
                    self._worker_gone(m, "lost", f"silent for {silent:.1f} s", now)
            elif m.state == S.LIVE and silent > SUSPECT_AFTER * self.interval:
                self._move(m, S.SUSPECT, f"silent for {silent:.1f} s")
            elif m.state in NOT_JOINED and self.join_deadline is not None and now > self.join_deadline:
                self.fail(f"node {m.id} ({m.role}) did not join within {self.cfg.job.join_timeout_s} s")

    # ---------------------------------------------------------------- the end
    def final_from_reports(self) -> dict[str, Any]:
        """The test metrics of the last evaluation a worker reported (allreduce jobs have no PS to
        pull from: the workers' replicas are identical, and rank 0 evaluates its own at the end)."""
        best: tuple[float, str, dict[str, Any]] | None = None
        for w, d in self.run_report.workers.items():
            # every task's evaluation has a test_loss (a sweep's: test_accuracy only)
            evaluated = ("test_loss", "test_accuracy")
            points = [(float("inf"), d["final"])] if any(k in d["final"] for k in evaluated) else []
            points += [(p["t"], p) for p in d["series"] if any(k in p for k in evaluated)]
            for t, p in points:
                if best is None or t > best[0]:
                    best = (t, w, p)
        if best is None:
            return {"error": "no worker reported a test evaluation"}
        _, w, p = best
        return {**evaluation_of(p), "evaluated_by": w}

    def finish_report(self, final: dict[str, Any], now: float) -> RunReport:
        """The run report with its ``final`` section: the final evaluation plus how the run ended.
        ``best_reported_value`` (of ``best_reported_metric``; classification also ``best_reported_accuracy``)
        is what the workers measured on their replicas while training (what the stop rule saw); ``final`` is
        the PS parameters at the end."""
        self.run_report.final = {**final, "elapsed_s": self.run_time(now),
                                 "stop_reason": self.stop_reason or "epochs done",
                                 "best_reported_metric": self.metric, "best_reported_value": self.best_metric}
        if self.cfg.train.task == "classification":  # the classification spelling, which came first
            self.run_report.final["best_reported_accuracy"] = self.best_accuracy
        if self.confirm_targets:
            self.run_report.final["targets_unconfirmed"] = self.confirmation.rejections
            self.run_report.final["unconfirmed"] = list(self.confirmation.rejected)
        return self.run_report
