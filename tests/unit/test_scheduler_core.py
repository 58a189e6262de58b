"""The scheduler core without sockets or asyncio: scripted joins, heartbeats, reports, leaves and clocks."""

from __future__ import annotations

import pytest

from hmp.config import loads
from hmp.errors import ConfigError, RequestError
from hmp.messages import RingInfo, WelcomeInfo
from hmp.scheduler.core import (Admitted, Assignment, Held, JobFailed, MemberChanged, Refused, RingFormed,
                                SchedulerCore, ShardsReady, StopDecided, WorkerDropped, WorkersDone, WorkRange)
from hmp.scheduler.membership import (TRANSITIONS, IllegalTransition, Member, MemberState, Membership)
from tests.support import SCHEDULER_HB, SCRIPTED_WORKERS, running_scheduler, scheduler_config, scheduler_core

S = MemberState


def _changes(events) -> list[tuple[str, S, S, bool]]:
    return [(e.change.node, e.change.old, e.change.new, e.roster) for e in events if isinstance(e, MemberChanged)]


def _state(core: SchedulerCore, node: str) -> S:
    return core.membership[node].state


# ---------------------------------------------------------------- the state machine
def test_every_state_has_a_row_in_the_transition_table():
    """The table is complete: every state says where it may go, and nothing may go back to EXPECTED."""
    assert set(TRANSITIONS) == set(MemberState)
    assert all(S.EXPECTED not in targets for targets in TRANSITIONS.values())


def test_illegal_transitions_are_refused_with_both_states_named():
    """A move the table does not allow raises IllegalTransition naming the member and both states; nothing changes."""
    ms = Membership([("cpu0", "cpu_worker")])
    m = ms["cpu0"]
    with pytest.raises(IllegalTransition, match=r"cpu0 \(cpu_worker\) cannot go from expected to lost"):
        ms.transition(m, S.LOST)
    assert m.state == S.EXPECTED
    assert ms.transition(m, S.LIVE).new == S.LIVE
    assert ms.transition(m, S.LIVE) is None  # already there: no change
    ms.transition(m, S.LEFT)
    with pytest.raises(IllegalTransition):
        ms.transition(m, S.DONE)
    assert isinstance(IllegalTransition(Member("x", "ps"), S.DONE), RequestError)


# ---------------------------------------------------------------- joins
def test_shards_join_live_and_shards_ready_fires_once_all_have():
    """A shard goes straight to LIVE; ShardsReady is emitted when the last shard joins, and only then."""
    core = scheduler_core()
    first = core.join("ps0", "ps", "tcp://ps0", 1, 0.0)
    assert first == Admitted(WelcomeInfo(shards=())) and _state(core, "ps0") == S.LIVE
    assert not any(isinstance(e, ShardsReady) for e in core.take_events())
    second = core.join("ps1", "ps", "tcp://ps1", 1, 0.1)
    assert second.info.shards == (("ps0", "tcp://ps0"), ("ps1", "tcp://ps1"))
    assert sum(isinstance(e, ShardsReady) for e in core.take_events()) == 1


def test_worker_join_is_held_until_every_shard_has_joined():
    """A worker joining before the shards is JOINING (held); once they are in, admit() welcomes it as LIVE."""
    core = scheduler_core()
    core.join("ps0", "ps", "tcp://ps0", 1, 0.0)
    held = core.join("cpu0", "cpu_worker", "tcp://cpu0", 2, 0.5)
    assert isinstance(held, Held) and _state(core, "cpu0") == S.JOINING
    with pytest.raises(RequestError, match="not every shard"):
        core.admit("cpu0", held.generation, 0.6)
    core.join("ps1", "ps", "tcp://ps1", 1, 1.0)
    welcome = core.admit("cpu0", held.generation, 1.0)
    assert welcome.info.wire() == {"shards": (("ps0", "tcp://ps0"), ("ps1", "tcp://ps1")), "worker_index": 0,
                                   "num_workers": 2, "batch_size": 32}
    assert _state(core, "cpu0") == S.LIVE and core.t0 == 1.0
    assert ("cpu0", S.JOINING, S.LIVE, True) in _changes(core.take_events())


def test_only_the_newest_of_a_workers_resent_held_joins_is_answered():
    """A worker re-sends its join while held: admitting the older join is refused, the newest is welcomed."""
    core = scheduler_core()
    first = core.join("cpu0", "cpu_worker", "a", 1, 0.0)
    second = core.join("cpu0", "cpu_worker", "a", 1, 5.0)
    assert isinstance(first, Held) and isinstance(second, Held) and second.generation > first.generation
    for s in ("ps0", "ps1"):
        core.join(s, "ps", f"tcp://{s}", 1, 6.0)
    with pytest.raises(RequestError, match="newest join") as info:
        core.admit("cpu0", first.generation, 6.0)
    assert info.value.code == "bad_request"
    assert isinstance(core.admit("cpu0", second.generation, 6.0), Admitted)


def test_a_held_join_of_a_worker_that_left_meanwhile_is_not_admitted():
    """A worker that leaves while its join is held is not brought back by the join's late admission."""
    core = scheduler_core()
    held = core.join("cpu0", "cpu_worker", "a", 1, 0.0)
    core.leave("cpu0", "stopped", 1.0)
    for s in ("ps0", "ps1"):
        core.join(s, "ps", f"tcp://{s}", 1, 2.0)
    with pytest.raises(RequestError, match="left since this join"):
        core.admit("cpu0", held.generation, 2.0)
    assert _state(core, "cpu0") == S.LEFT


def test_worker_joining_after_the_shards_is_admitted_at_once():
    """Once every shard is in, a worker's join is answered with its welcome directly."""
    core = running_scheduler()
    assert _state(core, "cpu0") == S.LIVE and _state(core, "gpu0") == S.LIVE
    assert core.membership["gpu0"].address == "tcp://gpu0"


def test_join_checks_the_sender_and_its_role():
    """An unknown sender is refused with unknown_node; a node joining as another role with bad_role."""
    core = scheduler_core()
    with pytest.raises(RequestError) as info:
        core.join("nobody", "ps", "a", 1, 0.0)
    assert info.value.code == "unknown_node"
    with pytest.raises(RequestError) as info:
        core.join("ps0", "cpu_worker", "a", 1, 0.0)
    assert info.value.code == "bad_role" and _state(core, "ps0") == S.EXPECTED


def test_after_the_end_joins_and_heartbeats_are_told_to_shut_down():
    """Once the job is over a join is refused and a heartbeat is answered with the reason to shut down."""
    core = running_scheduler()
    assert core.heartbeat("ps0", 1.0) is None
    core.request_stop("target reached", 1.0)
    core.end()
    assert core.heartbeat("ps0", 1.1) == Refused("target reached")
    assert core.join("cpu0", "cpu_worker", "a", 1, 1.2) == Refused("target reached")


# ---------------------------------------------------------------- liveness
def test_a_node_silent_for_two_intervals_is_suspect_and_live_again_when_heard():
    """Silence past 2 heartbeat intervals makes a member SUSPECT; its next heartbeat makes it LIVE again."""
    core = running_scheduler()
    core.heartbeat("ps0", 0.0)
    core.tick(2.0)
    assert _state(core, "ps0") == S.LIVE
    core.tick(2.1)
    assert _state(core, "ps0") == S.SUSPECT and core.failed is None
    core.heartbeat("ps0", 2.2)
    assert _state(core, "ps0") == S.LIVE
    assert [(n, old, new) for n, old, new, _ in _changes(core.take_events()) if n == "ps0"] == [
        ("ps0", S.LIVE, S.SUSPECT), ("ps0", S.SUSPECT, S.LIVE)]


def test_a_node_silent_for_three_intervals_is_lost_and_fails_the_job():
    """A member silent for more than 2.8 heartbeat intervals is LOST (checked every 0.1 interval, that is
    within 3 intervals of its last message) and the job fails naming it."""
    core = running_scheduler()
    for t in (1.0, 2.0, 2.8):
        for n in ("ps0", "cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is None
    core.tick(2.9)
    assert _state(core, "ps1") == S.LOST
    assert core.failed == "node ps1 (ps) lost: silent for 2.9 s"
    assert JobFailed(core.failed) in core.take_events()
    assert _state(core, "ps0") == S.LIVE


def test_a_held_worker_is_not_declared_lost_and_is_live_from_its_admission():
    """Liveness does not apply while a worker's join is held; on admission its silence counts from then."""
    core = scheduler_core()
    core.join("cpu0", "cpu_worker", "a", 1, 0.0)
    for t in (3.5, 5.0):
        core.join("ps0", "ps", "p0", 1, t)
        core.tick(t)
    assert _state(core, "cpu0") == S.JOINING and core.failed is None
    held = core.join("cpu0", "cpu_worker", "a", 1, 5.0)
    core.join("ps1", "ps", "p1", 1, 9.0)
    core.admit("cpu0", held.generation, 9.0)
    core.tick(10.0)
    assert _state(core, "cpu0") == S.LIVE


def test_a_pipeline_jobs_lost_worker_does_not_fail_the_job_and_may_come_back():
    """With tolerate_worker_loss a lost worker is a roster change, not a failure; heard again, it is LIVE again."""
    core = running_scheduler(tolerate=True)
    for n in ("ps0", "ps1", "gpu0"):
        core.heartbeat(n, 3.0)
    core.tick(3.5)
    assert _state(core, "cpu0") == S.LOST and core.failed is None
    assert ("cpu0", S.LIVE, S.LOST, True) in _changes(core.take_events())
    core.heartbeat("cpu0", 3.6)
    assert _state(core, "cpu0") == S.LIVE
    assert _changes(core.take_events()) == [("cpu0", S.LOST, S.LIVE, True)]


def test_a_lost_worker_does_not_come_back_in_a_job_that_does_not_tolerate_it():
    """Without tolerate_worker_loss a lost worker's late heartbeat leaves it LOST (the job has failed)."""
    core = running_scheduler()
    core.tick(3.5)
    core.heartbeat("cpu0", 3.6)
    assert _state(core, "cpu0") == S.LOST and core.failed


def test_a_node_that_does_not_join_in_time_fails_the_job():
    """A member still EXPECTED (or JOINING) after join_timeout_s since start() fails the job, not before."""
    core = scheduler_core(join_timeout_s=10.0)
    for n, role in (("ps0", "ps"), ("cpu0", "cpu_worker"), ("gpu0", "gpu_worker")):
        core.join(n, role, "a", 1, 0.0)
    for t in (2.0, 4.0, 6.0, 8.0, 10.0):
        for n in ("ps0",):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is None
    core.tick(10.1)
    assert core.failed == "node ps1 (ps) did not join within 10.0 s"


def test_a_worker_still_held_at_the_join_deadline_fails_the_job():
    """A worker whose join is still held (JOINING) when the join deadline passes fails the job too."""
    core = scheduler_core(join_timeout_s=10.0)
    core.join("ps0", "ps", "a", 1, 0.0)
    core.leave("ps1", "stopped", 0.0)  # it will never be ready
    for n, role in SCRIPTED_WORKERS:
        core.join(n, role, "a", 1, 0.0)
    core.heartbeat("ps0", 9.0)
    core.tick(10.1)
    assert _state(core, "cpu0") == S.JOINING
    assert core.failed == "node cpu0 (cpu_worker) did not join within 10.0 s"


# ---------------------------------------------------------------- reports, done, leave
def test_non_workers_cannot_report_or_take_work():
    """A shard's report or work request is refused with bad_role and leaves no trace in the report."""
    core = running_scheduler()
    with pytest.raises(RequestError) as info:
        core.report("ps0", {"samples": 5.0}, True, 1.0)
    assert info.value.code == "bad_role"
    with pytest.raises(RequestError) as info:
        core.work("ps0", 16, 1.0)
    assert info.value.code == "bad_role"
    assert "ps0" not in core.run_report.workers and _state(core, "ps0") == S.LIVE


def test_a_worker_reporting_done_is_done_and_the_job_ends_when_all_are():
    """A final report makes the worker DONE with stop; WorkersDone comes once every worker is done or left."""
    core = running_scheduler()
    a = core.report("cpu0", {"updates": 7.0}, True, 1.0)
    assert a == Assignment(batch_size=0, stop=True) and _state(core, "cpu0") == S.DONE
    assert core.run_report.workers["cpu0"]["final"] == {"updates": 7.0}
    assert not any(isinstance(e, WorkersDone) for e in core.take_events())
    core.leave("gpu0", "done", 2.0)
    assert _state(core, "gpu0") == S.LEFT and core.workers_done
    assert sum(isinstance(e, WorkersDone) for e in core.take_events()) == 1


def test_a_done_worker_must_still_heartbeat_until_it_leaves():
    """A DONE worker silent for 3 intervals is LOST and fails the job, like any connected node."""
    core = running_scheduler()
    core.report("cpu0", {}, True, 0.0)
    for n in ("ps0", "ps1", "gpu0"):
        core.heartbeat(n, 3.0)
    core.tick(3.5)
    assert _state(core, "cpu0") == S.LOST and core.failed.startswith("node cpu0 (cpu_worker) lost")


def test_leave_records_the_worker_and_a_failed_leave_fails_the_job():
    """A worker leaving without a final report is finished in the report; a 'failed:' reason fails the job."""
    core = running_scheduler()
    core.report("cpu0", {"updates": 3.0}, False, 0.5)
    core.leave("cpu0", "failed: CUDA error", 1.0)
    assert _state(core, "cpu0") == S.LEFT
    assert core.run_report.workers["cpu0"]["final"] == {}
    assert core.failed == "node cpu0 (cpu_worker) failed: CUDA error"
    assert ("cpu0", S.LIVE, S.LEFT, True) in _changes(core.take_events())


def test_a_pipeline_jobs_worker_leaving_is_a_roster_change_only_while_not_stopping():
    """tolerate_worker_loss: a failed worker's leave does not fail the job; after a stop a leave is no roster change."""
    core = running_scheduler(tolerate=True)
    core.leave("cpu0", "failed: boom", 1.0)
    assert core.failed is None
    assert _changes(core.take_events()) == [("cpu0", S.LIVE, S.LEFT, True)]
    core.request_stop("epochs done", 1.5)
    core.leave("gpu0", "done", 2.0)
    assert _changes(core.take_events()) == [("gpu0", S.LIVE, S.LEFT, False)]


def test_a_final_report_from_a_worker_that_left_is_refused():
    """The state machine refuses LEFT -> DONE: the late final report gets an error and changes nothing."""
    core = running_scheduler()
    core.leave("cpu0", "done", 1.0)
    with pytest.raises(IllegalTransition, match="from left to done"):
        core.report("cpu0", {"updates": 1.0}, True, 1.1)
    assert _state(core, "cpu0") == S.LEFT and core.run_report.workers["cpu0"]["series"] == []


# ---------------------------------------------------------------- stop rules
def test_target_accuracy_stops_the_workers():
    """A reported test accuracy at the target sets the stop reason; that reply and every later one say stop."""
    core = running_scheduler(target_accuracy=0.9)
    assert core.report("cpu0", {"test_accuracy": 0.85}, False, 1.0).stop is False
    a = core.report("cpu0", {"test_accuracy": 0.91}, False, 2.0)
    assert a.stop is True and core.stop_reason == "target accuracy 0.9 reached (0.9100)"
    assert StopDecided(core.stop_reason, 2.0) in core.take_events()
    assert core.report("gpu0", {}, False, 2.5).stop is True
    assert core.work("gpu0", 8, 2.5) == WorkRange(count=0, epoch=0)


def test_target_loss_stops_the_workers():
    """The best reported test loss at or under the target stops the workers."""
    core = running_scheduler(target_loss=0.2)
    assert core.report("cpu0", {"test_loss": 0.3}, False, 1.0).stop is False
    assert core.report("cpu0", {"test_loss": 0.2}, False, 2.0).stop is True
    assert core.stop_reason.startswith("target test loss 0.2 reached")


def test_max_seconds_counts_from_the_first_admission():
    """The time limit is judged on reports, against the time since the first worker was admitted."""
    core = running_scheduler(now=100.0, max_seconds=10.0)
    assert core.report("cpu0", {}, False, 110.0).stop is False
    assert core.report("cpu0", {}, False, 110.5).stop is True
    assert core.stop_reason == "time limit of 10.0 s reached"


def test_the_first_stop_reason_is_kept():
    """An outside stop (the pipeline's epochs done) before the rules fire is the reason; rules do not override it."""
    core = running_scheduler(target_accuracy=0.5)
    core.request_stop("epochs done (40 steps)", 1.0)
    assert core.report("cpu0", {"test_accuracy": 0.99}, False, 2.0).stop is True
    assert core.stop_reason == "epochs done (40 steps)"
    assert core.finish_report({"test_accuracy": 0.98}, 3.0).final["stop_reason"] == "epochs done (40 steps)"


def test_a_failed_job_tells_reporting_workers_to_stop():
    """Once the job has failed, progress reports are answered with stop."""
    core = running_scheduler()
    core.fail("node ps1 (ps) lost")
    assert core.report("cpu0", {}, False, 1.0).stop is True


def test_batch_sizes_come_from_the_batch_policy():
    """Reports are answered with the policy's batch size (static: the configured one)."""
    core = running_scheduler()
    assert core.report("gpu0", {"samples": 10.0}, False, 1.0) == Assignment(batch_size=32, data_share=0.5)


# ---------------------------------------------------------------- the work cursor
def test_the_work_cursor_hands_out_each_epoch_once_then_nothing():
    """Work ranges cover each epoch's examples in order, first come first served, then count 0 after the last epoch."""
    core = running_scheduler(n_train=10, epochs=2)
    got = [core.work(w, 4, 1.0) for w in ("cpu0", "gpu0", "cpu0", "gpu0", "cpu0", "gpu0", "cpu0")]
    assert got == [WorkRange(4, 0, 0), WorkRange(4, 0, 4), WorkRange(2, 0, 8),
                   WorkRange(4, 1, 0), WorkRange(4, 1, 4), WorkRange(2, 1, 8), WorkRange(0, 2)]
    assert core.work_taken == {"cpu0": 10, "gpu0": 10}
    with pytest.raises(RequestError, match="work count must be >= 1"):
        core.work("cpu0", 0, 1.0)


def test_status_shows_every_members_state():
    """The status lists each member's state by its enum value, plus the run's progress."""
    core = running_scheduler()
    core.report("cpu0", {"test_accuracy": 0.5}, False, 1.0)
    st = core.status(2.0)
    assert st["members"] == {"ps0": "live", "ps1": "live", "cpu0": "live", "gpu0": "live"}
    assert st["best_accuracy"] == 0.5 and st["best_test_loss"] is None and st["elapsed_s"] == 2.0


# ---------------------------------------------------------------- allreduce: the workers' ring
def _ring_core() -> SchedulerCore:
    text = f"""
[job]
heartbeat_interval_s = {SCHEDULER_HB}
join_timeout_s = 30

[train]
consistency = "allreduce"
"""
    for nid, role in [("scheduler", "scheduler"), ("w0", "cpu_worker"), ("w1", "cpu_worker"), ("w2", "gpu_worker")]:
        bind = '\nbind = "tcp://127.0.0.1:5555"' if role == "scheduler" else ""
        text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"{bind}\n'
    core = SchedulerCore(loads(text, "ring.toml"), n_train=100)
    core.start(0.0)
    return core


def _rings(events) -> list[tuple[int, tuple[str, ...], tuple[str, ...]]]:
    return [(e.generation, e.members, e.addresses) for e in events if isinstance(e, RingFormed)]


def test_the_ring_forms_once_every_worker_has_joined_and_welcomes_carry_it():
    """Worker joins are held until the last worker joins; then generation 1 forms over every worker in config
    order, and each welcome names the ring, the worker's rank and the ring's size."""
    core = _ring_core()
    assert isinstance(core.join("w1", "cpu_worker", "tcp://w1", 1, 0.0), Held)
    assert isinstance(core.join("w0", "cpu_worker", "tcp://w0", 1, 0.1), Held)
    assert _rings(core.take_events()) == []
    last = core.join("w2", "gpu_worker", "tcp://w2", 1, 0.2)
    assert _rings(core.take_events()) == [(1, ("w0", "w1", "w2"), ("tcp://w0", "tcp://w1", "tcp://w2"))]
    assert isinstance(last, Admitted) and last.info.ring.rank == 2
    first = core.admit("w1", 1, 0.3)
    assert first.info.ring == RingInfo(generation=1, members=("w0", "w1", "w2"),
                                       addresses=("tcp://w0", "tcp://w1", "tcp://w2"), rank=1)
    assert (first.info.worker_index, first.info.num_workers, first.info.shards) == (1, 3, ())


def test_a_lost_ring_member_re_forms_the_ring_from_the_survivors_and_is_refused_if_it_comes_back():
    """Silence for 3 intervals loses a member without failing the job; the survivors form the next generation
    in their old order; the lost member, heard again, is told to shut down (it must join again to come back)."""
    core = _ring_core()
    for w in ("w0", "w1", "w2"):
        core.join(w, "cpu_worker" if w != "w2" else "gpu_worker", f"tcp://{w}", 1, 0.0)
    for w in ("w0", "w1"):
        core.admit(w, 1, 0.0)
    core.take_events()
    for t in (1.0, 2.0, 3.0):
        core.heartbeat("w0", t)
        core.heartbeat("w2", t)
    core.tick(3.5)
    assert _state(core, "w1") == S.LOST and not core.failed
    assert _rings(core.take_events()) == [(2, ("w0", "w2"), ("tcp://w0", "tcp://w2"))]
    assert isinstance(core.heartbeat("w1", 3.6), Refused) and _state(core, "w1") == S.LOST
    # A survivor that fails leaves the last one alone in generation 3; the job ends when it is done.
    core.leave("w2", "failed: RingBroken: boom", 4.0)
    assert _rings(core.take_events()) == [(3, ("w0",), ("tcp://w0",))] and not core.failed
    core.report("w0", {"test_accuracy": 0.9, "samples": 10}, True, 5.0)
    assert any(isinstance(e, WorkersDone) for e in core.take_events())
    assert core.final_from_reports() == {"test_accuracy": 0.9, "evaluated_by": "w0"}
    assert [r["generation"] for r in core.run_report.rings] == [1, 2, 3]


def test_a_ring_member_that_joins_again_is_taken_into_a_new_generation():
    """A lost member that joins again (a restarted process: new pid) is admitted into a new generation with it,
    in topology order, its welcome naming its rank; the report says it restarted. While the job is stopping it is
    refused."""
    core = _ring_core()
    for w in ("w0", "w1", "w2"):
        core.join(w, "cpu_worker" if w != "w2" else "gpu_worker", f"tcp://{w}", 1, 0.0)
    for w in ("w0", "w1"):
        core.admit(w, 1, 0.0)
    for t in (1.0, 2.0, 3.0):
        core.heartbeat("w0", t)
        core.heartbeat("w2", t)
    core.tick(3.5)
    core.take_events()
    back = core.join("w1", "cpu_worker", "tcp://w1b", 7, 4.0)
    assert isinstance(back, Admitted) and back.info.ring.generation == 3 and back.info.ring.rank == 1
    assert _rings(core.take_events()) == [(3, ("w0", "w1", "w2"), ("tcp://w0", "tcp://w1b", "tcp://w2"))]
    assert [(e["node"], e["event"]) for e in core.run_report.membership] == [("w1", "lost"), ("w1", "restarted")]
    core.request_stop("enough", 5.0)
    assert isinstance(core.join("w1", "cpu_worker", "tcp://w1c", 8, 5.5), Refused)


# ---------------------------------------------------------------- elastic workers (PS jobs)
def _silence(core, node, until):
    """Every member but ``node`` heartbeats up to ``until``; then the core ticks."""
    for t in range(1, int(until) + 1):
        for n in core.membership.members:
            if n != node:
                core.heartbeat(n, float(t))
    core.tick(until + 0.5)


def test_a_lost_worker_is_dropped_and_the_job_goes_on():
    """A worker silent for 3 intervals is LOST and dropped (every shard is to hear of it) without failing the
    job; the report records it; once the other worker is done the job is done."""
    core = _elastic()
    _silence(core, "gpu0", 3.0)
    events = core.take_events()
    assert _state(core, "gpu0") == S.LOST and core.failed is None
    assert [e for e in events if isinstance(e, WorkerDropped)] == [WorkerDropped("gpu0", "lost: silent for 3.5 s")]
    assert core.run_report.membership == [{"node": "gpu0", "event": "lost", "t": 3.5, "why": "silent for 3.5 s"}]
    core.report("cpu0", {"samples": 1.0}, True, 4.0)
    assert WorkersDone() in core.take_events()
    assert core.run_report.to_json()["membership"][0]["node"] == "gpu0"


def _elastic(**cfg) -> SchedulerCore:
    core = SchedulerCore(scheduler_config(**cfg), n_train=100)
    core.start(0.0)
    for s in ("ps0", "ps1"):
        core.join(s, "ps", f"tcp://{s}", 1, 0.0)
    for w, role in SCRIPTED_WORKERS:
        core.join(w, role, f"tcp://{w}", 2, 0.0)
    core.take_events()
    return core


def test_fewer_workers_than_min_workers_fails_the_job_with_the_reason():
    """With [train] min_workers = 2, losing one of two workers fails the job, naming who is left and the key."""
    core = _elastic(min_workers=2)
    _silence(core, "cpu0", 3.0)
    assert core.failed == ("only 1 of 2 workers remain (gpu0) after cpu0 lost (silent for 3.5 s); "
                           "[train] min_workers = 2")
    assert JobFailed(core.failed) in core.take_events()


def test_min_workers_above_the_topologys_workers_is_a_config_error():
    """min_workers larger than the number of workers could never be met: a config error naming the key."""
    with pytest.raises(ConfigError, match=r"test.toml: key 'train.min_workers': .*2 worker.*got 3"):
        scheduler_config(min_workers=3)


def test_a_lost_workers_work_range_goes_back_to_the_queue():
    """First come first served: the range a lost worker held is handed out again (split to the size asked for)
    before the cursor advances, counted as work redone; a range whose holder asked again is not."""
    core = _elastic(epochs=1)
    assert core.work("cpu0", 10, 0.5) == WorkRange(10, 0, 0)
    assert core.work("gpu0", 10, 0.5) == WorkRange(10, 0, 10)
    assert core.work("cpu0", 10, 0.6) == WorkRange(10, 0, 20)  # its first range is done
    _silence(core, "cpu0", 4.0)
    assert _state(core, "cpu0") == S.LOST
    assert core.work("gpu0", 4, 5.0) == WorkRange(4, 0, 20)  # cpu0's range 20..30, in pieces
    assert core.work("gpu0", 10, 5.1) == WorkRange(6, 0, 24)
    assert core.work("gpu0", 10, 5.2) == WorkRange(10, 0, 30)  # then the cursor goes on
    assert core.run_report.work_redone == 10
    # gpu0 stopped mid-range (SIGTERM): its final report sends the range back for whoever asks next.
    core.report("gpu0", {}, True, 5.3)
    assert core.work_requeued == [(0, 30, 10)]


def test_a_worker_leaving_while_the_job_runs_is_dropped_and_a_failed_one_too():
    """A leave before the worker is done (the job not stopping) drops it like a loss; so does a failed leave."""
    core = _elastic()
    core.work("gpu0", 10, 0.5)
    core.leave("gpu0", "stopped", 1.0)
    assert WorkerDropped("gpu0", "left: stopped") in core.take_events() and core.failed is None
    assert core.work_requeued == [(0, 0, 10)]
    core.leave("cpu0", "failed: CUDA error", 1.5)
    assert core.failed.startswith("only 0 of 2 workers remain (none) after cpu0 failed (failed: CUDA error)")
    assert [e["event"] for e in core.run_report.membership] == ["left", "failed"]


def test_a_lost_worker_may_come_back_and_a_restarted_one_replaces_its_old_process():
    """A lost worker heard from again is LIVE again ('rejoined'); a join with a new pid while the old process is
    still LIVE replaces it: the old one's work goes back to the queue and the shards drop it ('restarted')."""
    core = _elastic()
    _silence(core, "gpu0", 3.0)
    core.take_events()
    core.heartbeat("gpu0", 4.0)
    assert _state(core, "gpu0") == S.LIVE
    core.work("cpu0", 10, 4.5)
    assert isinstance(core.join("cpu0", "cpu_worker", "tcp://cpu0", 99, 5.0), Admitted)
    assert _state(core, "cpu0") == S.LIVE and core.membership["cpu0"].pid == 99
    assert WorkerDropped("cpu0", "replaced by a new process (pid 99, was 2)") in core.take_events()
    assert core.work_requeued == [(0, 0, 10)]
    assert [(e["node"], e["event"]) for e in core.run_report.membership] == [
        ("gpu0", "lost"), ("gpu0", "rejoined"), ("cpu0", "restarted")]


def test_a_worker_the_launcher_may_restart_counts_until_its_join_deadline():
    """[job] restarts: a lost worker whose role may be restarted counts towards min_workers until it rejoins; one
    not back within join_timeout_s fails the job then, naming why."""
    core = _elastic(min_workers=2, join_timeout_s=10.0, restarts="restarts = { gpu_worker = 1 }")
    _silence(core, "gpu0", 3.0)
    assert _state(core, "gpu0") == S.LOST and core.failed is None and core.awaiting_restart == {"gpu0": 13.5}
    assert isinstance(core.join("gpu0", "gpu_worker", "tcp://gpu0", 77, 5.0), Admitted)
    assert core.awaiting_restart == {} and core.restarts_left["gpu0"] == 0
    for t in range(6, 10):
        core.heartbeat("cpu0", float(t))
        core.heartbeat("ps0", float(t))
        core.heartbeat("ps1", float(t))
    core.tick(9.5)  # lost again, no restart left: too few workers
    assert core.failed == ("only 1 of 2 workers remain (cpu0) after gpu0 lost (silent for 4.5 s); "
                           "[train] min_workers = 2")


def test_a_restart_that_never_comes_fails_the_job_at_the_join_deadline():
    """A lost worker awaited back from a restart that does not come: the job fails once join_timeout_s is over."""
    core = _elastic(min_workers=2, join_timeout_s=10.0, restarts="restarts = { gpu_worker = 1 }")
    _silence(core, "gpu0", 3.0)
    assert core.failed is None
    for t in range(4, 15):
        for n in ("cpu0", "ps0", "ps1"):
            core.heartbeat(n, float(t))
        core.tick(t + 0.5)
    assert core.failed == ("only 1 of 2 workers remain (cpu0) (gpu0 was not restarted within 10.0 s); "
                           "[train] min_workers = 2")


def test_losing_the_last_working_worker_after_the_others_finished_does_not_fail_the_job():
    """Workers that sent their final report and left are done, not missing: when the one still working is
    lost, the job ends (every worker done or gone) instead of failing below min_workers."""
    core = running_scheduler(tolerate=True)
    t = 1.0
    core.report("gpu0", {"loss": 0.1}, True, t)
    core.leave("gpu0", "done", t)
    core.take_events()
    for n in ("ps0", "ps1"):
        core.heartbeat(n, 3.5)
    core.tick(3.5)  # cpu0 silent since the start: lost
    assert core.membership["cpu0"].state == S.LOST
    assert core.failed is None
    assert WorkersDone() in core.take_events()
