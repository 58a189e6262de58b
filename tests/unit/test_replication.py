"""Shard replication's pure rules."""

from __future__ import annotations

import pytest
import torch

from hmp.ps.shard_core import ShardCore
from hmp.ps.sharding import initial_replicas, next_backup
from hmp.scheduler.core import Admitted, ReplicasChanged
from tests.support import assert_cores_identical, running_scheduler


# ----------------------------------------------------------------------------- the shard core
def _pair(optimizer: str = "adam", consistency: str = "async") -> tuple[ShardCore, ShardCore]:
    chunks = {0: torch.arange(64, dtype=torch.float32) / 7, 3: torch.linspace(-1, 1, 33)}
    make = lambda: ShardCore("ps0", chunks, optimizer, {"lr": 0.01}, consistency, workers=("a", "b"))  # noqa: E731
    return make(), make()


def test_a_backup_fed_the_forwarded_pushes_is_a_bit_identical_copy_with_adam():
    primary, backup = _pair("adam")
    gen = torch.Generator().manual_seed(7)
    for i in range(40):
        keys = (0, 3) if i % 3 else (3,)  # some pushes carry only some chunks
        grads = tuple(torch.randn(primary.chunks[k].param.numel(), generator=gen) for k in keys)
        worker = "ab"[i % 2]
        primary.apply(worker, keys, grads, 8, seq=100 + i)
        backup.apply(worker, keys, grads, 8, seq=100 + i)  # what the primary forwards: the same frames
    assert_cores_identical(primary, backup)
    assert backup.seen("a", 138) == "applied" and backup.seen("b", 139) == "applied"  # a retry after failover


def test_a_backup_fed_the_rounds_of_a_sync_primary_is_a_bit_identical_copy():
    primary, backup = _pair("adam", "sync")
    gen = torch.Generator().manual_seed(3)
    for r in range(10):
        for w in ("a", "b"):
            primary.contribute(w, (0, 3), (torch.randn(64, generator=gen), torch.randn(33, generator=gen)), 4,
                               seq=10 * r + (w == "b"))
        assert primary.round_complete()
        primary.finish_round()
        keys, grads, seqs, samples = primary.last_round
        backup.apply_round(keys, grads, samples, seqs)
    assert_cores_identical(primary, backup)
    assert backup.last_seq == {"a": 90, "b": 91}


def test_a_whole_copy_makes_a_new_backup_identical_and_counts_the_same_workers():
    primary, _ = _pair("adam", "ssp")
    for i in range(5):
        primary.apply("a", (0, 3), (torch.ones(64), torch.ones(33)), 2, seq=i + 1)
    primary.remove_worker("b")
    fresh, _ = _pair("adam", "ssp")
    fresh.load_replica_bytes(primary.replica_bytes())
    assert_cores_identical(primary, fresh)
    assert fresh.live_workers == {"a"} and fresh.clock == primary.clock
    with pytest.raises(ValueError, match="optimizer"):  # a copy of another job's group is refused
        _pair("sgd")[0].load_replica_bytes(primary.replica_bytes())


def test_backups_go_to_the_next_shard_and_after_a_loss_to_the_next_live_one():
    ids = ["ps0", "ps1", "ps2"]
    assert initial_replicas(ids) == {"ps0": ("ps0", "ps1"), "ps1": ("ps1", "ps2"), "ps2": ("ps2", "ps0")}
    assert initial_replicas(ids, replicas=1)["ps0"] == ("ps0", "")
    assert next_backup(ids, "ps2", {"ps0", "ps2"}) == "ps0" and next_backup(ids, "ps0", {"ps0"}) == ""


# ----------------------------------------------------------------------------- the scheduler core
REPLICATED = "[ps]\nreplicas = 2"  # into _cfg's [job] lines: its own section


def test_a_lost_primary_fails_over_to_its_backup_and_the_job_runs_unreplicated_with_two_shards():
    core = running_scheduler(tolerate=True, restarts=REPLICATED)
    assert core.replica_map == {"ps0": ["ps0", "ps1"], "ps1": ["ps1", "ps0"]}
    for t in (1.0, 2.0, 3.0):
        for n in ("ps1", "cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is None and core.shards_down == set()  # nobody waits for a restart
    assert core.replica_map == {"ps0": ["ps1", ""], "ps1": ["ps1", ""]}
    (ev,) = [e for e in core.take_events() if isinstance(e, ReplicasChanged)]
    assert set(ev.groups) == {("ps0", "ps1", ""), ("ps1", "ps1", "")} and ev.tell_workers
    assert dict(ev.shards) == {"ps0": "tcp://ps1", "ps1": "tcp://ps1"}  # workers send ps0's chunks to ps1
    assert dict(ev.addresses)["ps0"] == "tcp://ps0"
    (failover,) = core.run_report.shard_failovers
    assert failover["shard"] == "ps0" and failover["promoted"] == {"ps0": "ps1"}
    assert 2.8 <= failover["detected_after_s"] <= 3.0 and failover["promote_s"] is None
    core.replicas_applied(ev.epoch, 3.05)
    assert failover["promote_s"] == pytest.approx(0.05)
    report = core.run_report.to_json()
    assert report["ran_unreplicated"] and {u["group"] for u in report["unreplicated"]} == {"ps0", "ps1"}
    assert core.shard_addresses() == (("ps0", "tcp://ps1"), ("ps1", "tcp://ps1"))
    # The lost process heard from again (it was only stalled): its groups are served elsewhere, it stops.
    assert "failed over" in core.heartbeat("ps0", 3.2).reason
    # Restarted (a new process): it joins as the backup of both groups, and they are replicated again.
    decision = core.join("ps0", "ps", "tcp://ps0-new", 9, 4.0)
    assert isinstance(decision, Admitted)
    assert decision.info.replicas.groups == (("ps0", "ps1", "ps0"), ("ps1", "ps1", "ps0"))
    assert all(u["until_t"] is not None for u in core.run_report.unreplicated)
    assert core.heartbeat("ps0", 4.1) is None


def test_losing_both_copies_of_a_group_fails_the_job_naming_it():
    core = running_scheduler(tolerate=True, restarts=REPLICATED)
    for t in (1.0, 2.0, 3.0):  # both shards silent: the first one lost takes the other's copy with it
        for n in ("cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is not None and "no copy left" in core.failed
