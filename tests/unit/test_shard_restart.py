"""Shard restarts: pushes applied once across a checkpoint, and the scheduler's waiting rules."""

from __future__ import annotations

import torch

from hmp.ps import checkpoint
from hmp.ps.shard_core import ShardCore
from hmp.scheduler.core import Admitted, JobFailed, ShardsChanged
from tests.support import SCHEDULER_HB, running_scheduler


# ----------------------------------------------------------------------------- the shard core
def _shard(consistency: str = "async", workers=("w",)) -> ShardCore:
    chunks = {0: torch.zeros(8), 1: torch.ones(4)}
    return ShardCore("ps0", chunks, "sgd", {"lr": 1.0}, consistency, workers=workers)


def _grads() -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    return (0, 1), (torch.ones(8), torch.ones(4))


def test_a_retried_push_is_applied_once_and_push_numbers_survive_a_checkpoint(tmp_path):
    core = _shard()
    keys, grads = _grads()
    assert core.seen("w", 5) == ""
    core.apply("w", keys, grads, 1, seq=5)
    assert core.seen("w", 5) == "applied" and core.seen("w", 4) == "applied" and core.seen("w", 6) == ""
    assert core.seen("other", 5) == "" and core.seen("w", 0) == ""  # seq 0: never deduplicated
    core.save(tmp_path / "ps0.pt")
    core.apply("w", keys, grads, 1, seq=6)  # after the checkpoint: lost with a crash
    resumed = _shard()
    resumed.load(tmp_path / "ps0.pt")
    assert resumed.last_seq == {"w": 5} and resumed.version == 1
    assert resumed.seen("w", 5) == "applied"  # in the checkpoint: not applied again
    assert resumed.seen("w", 6) == ""  # lost with the crash: the retry is applied
    assert torch.equal(resumed.chunks[0].param, torch.full((8,), -1.0))


def test_a_sync_contribution_counts_as_applied_only_with_its_round(tmp_path):
    core = _shard("sync", workers=("a", "b"))
    keys, grads = _grads()
    core.contribute("a", keys, grads, 1, seq=10)
    assert core.seen("a", 10) == "pending"  # a retry waits for the round, it is not added twice
    core.save(tmp_path / "mid.pt")  # mid-round: the contribution is not in the parameters, nor its seq
    core.contribute("b", keys, grads, 1, seq=20)
    assert core.round_complete()
    core.finish_round()
    assert core.seen("a", 10) == "applied" and core.seen("b", 20) == "applied" and core.round_seq == {}
    restarted = _shard("sync", workers=("a", "b"))
    restarted.load(tmp_path / "mid.pt")
    assert restarted.seen("a", 10) == ""  # the round restarts from the checkpoint: its contributions count again


def test_a_checkpoint_without_push_numbers_still_loads(tmp_path):
    core = _shard()
    state = core.state_dict()
    del state["last_seq"]  # written before pushes were numbered
    checkpoint.write(state, tmp_path / "old.pt")
    fresh = _shard()
    fresh.load(tmp_path / "old.pt")
    assert fresh.last_seq == {}


# ----------------------------------------------------------------------------- the scheduler core
RESTARTS = "restarts = { ps = 1 }"


def test_a_lost_shard_that_may_be_restarted_is_waited_for_and_rejoins_at_a_new_address():
    core = running_scheduler(tolerate=True, restarts=RESTARTS, join_timeout_s=10.0)
    core.heartbeat("ps0", 0.0, step=30)  # the shard's version as its heartbeats carry it
    for t in (1.0, 2.0, 3.0):
        for n in ("ps1", "cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is None and core.membership["ps0"].state == "lost" and core.shards_down == {"ps0"}
    down = [e for e in core.take_events() if isinstance(e, ShardsChanged)]
    assert [(e.epoch, e.down) for e in down] == [(1, ("ps0",))]
    assert core.status(3.0)["shards_down"] == ["ps0"]
    core.shard_version_seen("ps0", 40)  # a worker's last reply from it: later than its last heartbeat
    core.shard_version_seen("ps0", 35)
    core.shard_version_seen("ps1", 99)  # not down: ignored
    assert core.membership["ps0"].step == 40 and core.membership["ps1"].step == 0
    # Started again with --resume: a new process at a new port, admitted with the workers still in the job.
    decision = core.join("ps0", "ps", "tcp://ps0-new", 7, 4.0)
    assert isinstance(decision, Admitted)
    assert decision.info.workers == ("cpu0", "gpu0")
    assert dict(decision.info.shards)["ps0"] == "tcp://ps0-new"
    back = [e for e in core.take_events() if isinstance(e, ShardsChanged)]
    assert [(e.epoch, e.down, dict(e.shards)["ps0"]) for e in back] == [(2, (), "tcp://ps0-new")]
    assert core.membership["ps0"].state == "live" and core.awaiting_restart == {}
    entry = core.run_report.shard_restarts[0]
    assert (entry["version_before"], entry["updates_lost"], entry["was_pid"], entry["pid"]) == (40, None, 1, 7)
    core.heartbeat("ps0", 4.1, step=32)  # its first heartbeat: the version it resumed at (its checkpoint's)
    assert (entry["resumed_version"], entry["updates_lost"]) == (32, 8)
    core.heartbeat("ps0", 4.2, step=50)
    assert entry["updates_lost"] == 8  # counted once
    assert [r["event"] for r in core.run_report.membership if r["node"] == "ps0"] == ["lost", "restarted"]
    assert core.run_report.to_json()["shard_restarts"] == [entry]
    # A worker admitted from now on hears of the change in its welcome.
    assert core.shard_epoch == 2 and core.restarts_left["ps0"] == 0


def test_a_lost_shard_not_back_within_join_timeout_fails_the_job_naming_it():
    core = running_scheduler(tolerate=True, restarts=RESTARTS, join_timeout_s=5.0)
    t = 0.0
    while core.failed is None and t < 20:
        t = round(t + 0.1 * SCHEDULER_HB, 2)
        for n in ("ps1", "cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    # Lost after 2.8 s of silence, then 5 s of join_timeout_s.
    assert 2.8 + 5.0 < t <= 2.9 + 5.0 + 0.2
    assert "PS shard ps0 was lost and did not come back within 5.0 s" in core.failed
    assert [e.reason for e in core.take_events() if isinstance(e, JobFailed)] == [core.failed]


def test_without_restarts_a_lost_shard_still_fails_the_job_at_once():
    core = running_scheduler(tolerate=True)
    for t in (1.0, 2.0, 3.0):
        for n in ("ps1", "cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is not None and "ps0" in core.failed and "lost" in core.failed
    assert core.shards_down == set()


def test_a_shard_restarted_before_it_was_noticed_lost_is_taken_back_and_announced():
    core = running_scheduler(tolerate=True)  # no restarts needed: it never was lost
    decision = core.join("ps1", "ps", "tcp://ps1-new", 9, 0.5)
    assert isinstance(decision, Admitted) and core.failed is None
    changes = [e for e in core.take_events() if isinstance(e, ShardsChanged)]
    assert [(e.down, dict(e.shards)["ps1"]) for e in changes] == [((), "tcp://ps1-new")]
    assert core.run_report.shard_restarts[0]["address"] == "tcp://ps1-new"
