"""Replicated PS shards, ``[ps] replicas = 2`` (issue 13, "Shards that survive"; docs/resilience.md).

The cores first (no sockets): a backup fed what its primary applied (forwarded pushes, sync rounds)
holds a bit-identical copy, values and Adam state; a whole copy makes a new backup identical too; the
scheduler fails a lost primary's groups over to their backups and rebuilds or reports missing backups.
Then shard daemons in this process (a push is answered once the backup applied it; a repeated forward is
not applied twice; forwards and replica maps from strangers are refused; a promoted backup answers a
retried push without applying it again), and a whole job on loopback: a primary SIGKILLed while a worker
pushes known gradients, where every acknowledged push must be in the final parameters exactly once.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from hmp.config import load
from hmp.errors import RemoteError
from hmp.messages import Push, Replicas, Replicate, Status
from hmp.nodes.ps_shard import PSShardNode
from hmp.nodes.worker import WorkerNode
from hmp.ps.shard_core import ShardCore
from hmp.ps.sharding import initial_replicas, next_backup
from hmp.scheduler.core import Admitted, ReplicasChanged

from .cluster_util import write_config
from .test_checkpoint import _as, _running
from .test_scheduler_core import _running as _running_core
from .test_shard_restart import HB_JOB, _Daemons, _until

ADAM = 'name = "adam"\nlr = 0.01'
SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "report.schema.json"
SGD = 'name = "sgd"\nlr = 0.01'


def check_sections(report: dict, keys: tuple[str, ...]) -> None:
    """The report's ``keys`` are as docs/report.schema.json says (where the schema is in this checkout)."""
    if not SCHEMA.exists():
        return
    import jsonschema

    properties = json.loads(SCHEMA.read_text())["properties"]
    for key in keys:
        jsonschema.validate(report[key], properties[key])


# ----------------------------------------------------------------------------- the shard core
def _pair(optimizer: str = "adam", consistency: str = "async") -> tuple[ShardCore, ShardCore]:
    chunks = {0: torch.arange(64, dtype=torch.float32) / 7, 3: torch.linspace(-1, 1, 33)}
    make = lambda: ShardCore("ps0", chunks, optimizer, {"lr": 0.01}, consistency, workers=("a", "b"))  # noqa: E731
    return make(), make()


def _assert_identical(primary: ShardCore, backup: ShardCore) -> None:
    """Bit-identical values and optimizer state, and the same clock and push numbers."""
    for k, c in primary.chunks.items():
        assert torch.equal(c.param.view(torch.int32), backup.chunks[k].param.view(torch.int32)), k
        theirs = backup.chunks[k].optimizer.state_dict()
        for name, value in c.optimizer.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.view(torch.int32), theirs[name].view(torch.int32)), (k, name)
            else:
                assert value == theirs[name], (k, name)
    assert (primary.version, primary.updates_applied, primary.samples, primary.last_seq) == \
        (backup.version, backup.updates_applied, backup.samples, backup.last_seq)


def test_a_backup_fed_the_forwarded_pushes_is_a_bit_identical_copy_with_adam():
    primary, backup = _pair("adam")
    gen = torch.Generator().manual_seed(7)
    for i in range(40):
        keys = (0, 3) if i % 3 else (3,)  # some pushes carry only some chunks
        grads = tuple(torch.randn(primary.chunks[k].param.numel(), generator=gen) for k in keys)
        worker = "ab"[i % 2]
        primary.apply(worker, keys, grads, 8, seq=100 + i)
        backup.apply(worker, keys, grads, 8, seq=100 + i)  # what the primary forwards: the same frames
    _assert_identical(primary, backup)
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
    _assert_identical(primary, backup)
    assert backup.last_seq == {"a": 90, "b": 91}


def test_a_whole_copy_makes_a_new_backup_identical_and_counts_the_same_workers():
    primary, _ = _pair("adam", "ssp")
    for i in range(5):
        primary.apply("a", (0, 3), (torch.ones(64), torch.ones(33)), 2, seq=i + 1)
    primary.remove_worker("b")
    fresh, _ = _pair("adam", "ssp")
    fresh.load_replica_bytes(primary.replica_bytes())
    _assert_identical(primary, fresh)
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
    core = _running_core(tolerate=True, restarts=REPLICATED)
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
    core = _running_core(tolerate=True, restarts=REPLICATED)
    for t in (1.0, 2.0, 3.0):  # both shards silent: the first one lost takes the other's copy with it
        for n in ("cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is not None and "no copy left" in core.failed


# ----------------------------------------------------------------------------- shard daemons in this process
def _two_shards(tmp: Path, optimizer: str = ADAM, consistency: str = "async") -> tuple[PSShardNode, PSShardNode]:
    cfg = write_config(tmp, fixed_ps_ports=True, consistency=consistency, optimizer=optimizer)
    cfg.write_text(cfg.read_text().replace("[ps]\n", "[ps]\nreplicas = 2\n") + "\n[shm]\nenabled = false\n")
    c = load(cfg)
    return PSShardNode(c, "ps0"), PSShardNode(c, "ps1")


def _map(node: PSShardNode, groups: dict[str, tuple[str, str]], epoch: int) -> Replicas:
    shards = tuple((s.id, s.bind) for s in node.cfg.shards)
    return Replicas(groups=tuple((g, p, b) for g, (p, b) in groups.items()), shards=shards, epoch=epoch)


async def test_a_push_is_answered_once_the_backup_applied_it_and_a_promoted_backup_applies_a_retry_once(tmp_path):
    ps0, ps1 = _two_shards(tmp_path)
    keys = tuple(sorted(ps0.core.chunks))
    grads = tuple(torch.linspace(-1, 1, ps0.core.chunks[k].param.numel()) for k in keys)
    async with _running(ps0), _running(ps1), _as(ps0, "scheduler") as sched0, _as(ps1, "scheduler") as sched1, \
            _as(ps0, "cpu0") as cpu, _as(ps1, "cpu0") as cpu_at_ps1:
        start = _map(ps0, initial_replicas(["ps0", "ps1"]), 1)  # the scheduler's map once every shard joined
        await asyncio.gather(sched0.request(start), sched1.request(start))
        for seq in range(1, 6):
            await cpu.request(Push(keys=keys, grads=grads, samples=4, seq=seq))
            # Answered: the backup applied it before the reply was sent.
            _assert_identical(ps0.core, ps1.backups["ps0"])
        assert ps0.stats["forwards_applied"] == 5 and ps1._applied_forward["ps0"] == 5
        # ps0 is lost; the scheduler promotes ps1 for group ps0, which now has no backup.
        await sched1.request(_map(ps1, {"ps0": ("ps1", ""), "ps1": ("ps1", "")}, 2))
        assert "ps0" in ps1.cores and ps1.stats["promotions"] == 1
        # The worker's push 5 was in flight when ps0 died: re-sent to ps1 with the same seq, not applied again.
        reply = await cpu_at_ps1.request(Push(keys=keys, grads=grads, samples=4, seq=5))
        assert reply.version == 5 and ps1.cores["ps0"].version == 5 and ps1.stats["duplicates"] == 1
        reply = await cpu_at_ps1.request(Push(keys=keys, grads=grads, samples=4, seq=6))
        assert reply.version == 6  # a new one is applied, unreplicated
        assert torch.equal(reply.values[0], ps1.cores["ps0"].chunks[keys[0]].param)


async def test_forwards_are_applied_once_in_order_and_refused_from_strangers(tmp_path):
    ps0, ps1 = _two_shards(tmp_path, optimizer=SGD)
    keys = tuple(sorted(ps0.core.chunks))
    ones = tuple(torch.ones(ps0.core.chunks[k].param.numel()) for k in keys)
    fwd = lambda fseq, **kw: Replicate(group="ps0", fseq=fseq, keys=keys, grads=ones, worker="cpu0", seq=fseq,  # noqa: E731
                                       samples=1, **kw)
    async with _running(ps1), _as(ps1, "ps0") as primary, _as(ps1, "cpu0") as stranger, _as(ps1, "ps1") as itself:
        before = ps1.backups["ps0"].chunks[keys[0]].param.clone()
        await primary.request(fwd(1))
        again = await primary.request(fwd(1))  # the primary retried: acknowledged, not applied twice
        assert "applied already" in again.detail and ps1.backups["ps0"].version == 1
        assert torch.equal(ps1.backups["ps0"].chunks[keys[0]].param, before - 0.01)
        with pytest.raises(RemoteError) as gap:
            await primary.request(fwd(3))
        assert gap.value.code == "out_of_order" and "forward 3 out of order (last applied 1)" in str(gap.value)
        for client, who in ((stranger, "cpu0"), (itself, "ps1")):
            with pytest.raises(RemoteError) as refused:
                await client.request(fwd(2))
            assert refused.value.code == "unauthorized" and "only the group's primary ('ps0')" in str(refused.value)
        with pytest.raises(RemoteError) as bad_op:
            await primary.request(fwd(2, op="delete"))
        assert bad_op.value.code == "bad_request" and "op must be" in str(bad_op.value)
        with pytest.raises(RemoteError) as bad_shape:
            await primary.request(Replicate(group="ps0", fseq=2, keys=keys[:1], grads=(torch.ones(3),)))
        assert bad_shape.value.code == "bad_shape"
        with pytest.raises(RemoteError) as not_scheduler:  # only the scheduler says who serves what
            await stranger.request(_map(ps1, {"ps0": ("cpu0", ""), "ps1": ("ps1", "")}, 5))
        assert not_scheduler.value.code == "unauthorized" and ps1.replica_epoch == 0
        await primary.request(fwd(2))  # the daemon kept serving: the next forward in order is applied
        assert ps1.backups["ps0"].version == 2
        status = await stranger.request(Status())
        assert status.state["backup_of"] == ["ps0"] and status.state["primary_of"] == ["ps1"]


# ----------------------------------------------------------------------------- a job on loopback
PUSHES, KILL_AT = 60, 20


class _KnownGradientWorker(WorkerNode):
    """A real worker daemon (join, heartbeats, the scheduler's ``shards``, retries with the same seq) whose
    training pushes a gradient of ones ``PUSHES`` times and counts the pushes acknowledged; at push
    ``KILL_AT`` it SIGKILLs the shard ``victim`` (the test's subprocess), so the kill lands mid-stream."""

    victim = None
    acknowledged = 0
    final: dict[int, torch.Tensor] = {}

    async def train(self, ps, data, index, count) -> None:
        for i in range(PUSHES):
            for g in ps.sharded.flat.grads.values():
                g.fill_(1.0)
            if i == KILL_AT:  # while this push is on its way: applied by ps0 (and its backup) or not
                asyncio.get_running_loop().call_later(0.001, self.victim.kill)
            if not await self.push_unless_stopped(ps, 1):
                break
            self.acknowledged += 1
            self.step += 1
        await self.with_shards(ps, ps.pull, "pull")
        self.final = {k: v.clone() for k, v in ps.sharded.param_views().items()}


def _expected(cfg, pushes: int) -> dict[int, torch.Tensor]:
    """Each chunk after ``pushes`` pushes of ones, each applied once, by the shards' own optimizer code."""
    from hmp import job
    from hmp.ps.optim import chunk_optimizer_of

    sharded = job.sharded_model(cfg)
    views = sharded.param_views()
    core = ShardCore("all", {k: v.detach() for k, v in views.items()}, *chunk_optimizer_of(cfg))
    keys = tuple(core.chunks)
    for _ in range(pushes):
        core.apply("w", keys, tuple(torch.ones_like(core.chunks[k].param) for k in keys), 1)
    return {k: core.chunks[k].param for k in keys}


@pytest.mark.parametrize("consistency", ["async", "sync"])
async def test_a_killed_primary_fails_over_and_every_acknowledged_push_is_in_the_final_parameters(
        tmp_path, consistency):
    path = write_config(tmp_path, consistency=consistency, optimizer=SGD, workers="cpu", epochs=1)
    path.write_text(path.read_text().replace("[ps]\n", "[ps]\nreplicas = 2\n") + "\n[shm]\nenabled = false\n")
    cfg = load(path)
    worker = _KnownGradientWorker(cfg, "cpu0")
    with _Daemons(path, tmp_path) as d:
        d.start("scheduler", "scheduler")
        for s in ("ps0", "ps1"):
            d.start("ps", s)
        worker.victim = d.procs["ps0"]
        task = asyncio.create_task(worker.run())
        try:
            rc = await asyncio.wait_for(asyncio.shield(task), 60)
        finally:
            worker.stopping.set()
            await asyncio.wait_for(task, 15)
        assert rc == 0 and not worker.failed
        assert d.procs["ps0"].wait(timeout=10) == -signal.SIGKILL
        assert await asyncio.to_thread(d.procs["scheduler"].wait, 30) == 0, d.log("scheduler")[-3000:]
        assert d.procs["ps1"].wait(timeout=20) == 0, d.log("ps1")[-3000:]
        ps1_log = d.log("ps1")
    assert worker.acknowledged == PUSHES  # every push acknowledged (retried across the failover)
    expected = _expected(cfg, PUSHES)  # ... and each applied exactly once: not lost, not twice
    assert set(worker.final) == set(expected)
    for k, value in expected.items():
        assert torch.equal(worker.final[k], value), (k, (worker.final[k] - value).abs().max())
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    (failover,) = report["shard_failovers"]
    assert failover["shard"] == "ps0" and failover["promoted"] == {"ps0": "ps1"}
    # Lost after 2.8 intervals of silence, checked every 0.1 (the scheduler core's test pins the rule); a loaded
    # two-core machine may run the check a little late.
    assert failover["detected_after_s"] <= 3 * HB_JOB + 0.3 and failover["promote_s"] < 1.0, failover
    assert report["ran_unreplicated"] and report["final"]["stop_reason"] == "epochs done"
    assert '"promoted"' in ps1_log or "promoted" in ps1_log
    assert [e["event"] for e in report["membership"] if e["node"] == "ps0"] == ["lost"]
    check_sections(report, ("shard_failovers", "unreplicated", "ran_unreplicated", "membership"))


async def test_a_killed_replicated_shard_restarted_with_resume_becomes_the_backup_of_both_groups(tmp_path):
    """After the failover (two shards: unreplicated), ps0 started again joins as the backup: the primary
    sends it a whole copy of each group, forwards go on, and the job reaches its target."""
    path = write_config(tmp_path, consistency="async", target=0.95, epochs=200, max_seconds=120,
                        optimizer='name = "sgd"\nlr = 0.02', checkpoint_every=20)
    path.write_text(path.read_text().replace("[ps]\n", "[ps]\nreplicas = 2\n") + "\n[shm]\nenabled = false\n")
    with _Daemons(path, tmp_path) as d:
        d.start("scheduler", "scheduler")
        for s in ("ps0", "ps1"):
            d.start("ps", s)
        d.start("cpu_worker", "cpu0")
        d.start("gpu_worker", "gpu0")
        await _until(lambda: (tmp_path / "ckpt" / "ps0.pt").exists(), 60, "ps0 wrote a checkpoint")
        d.procs["ps0"].kill()
        await _until(lambda: '"promoted"' in d.log("ps1"), 10, "ps1 took group ps0 over")
        d.start("ps", "ps0", "--resume")
        await _until(lambda: d.log("ps0", 2).count('"copy_received"') >= 2, 20, "ps0 has copies of both groups")
        assert await asyncio.to_thread(d.procs["scheduler"].wait, 120) == 0, d.log("scheduler")[-3000:]
        for n in ("ps1", "cpu0", "gpu0"):
            assert d.procs[n].wait(timeout=20) == 0, d.log(n)[-2000:]
        assert d.procs["ps0"].wait(timeout=20) == 0, d.log("ps0", 2)[-2000:]
        assert '"forward_failed"' not in d.log("ps1").split('"copy_sent"')[-1]  # after the copies: all acked
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["final"]["stop_reason"].startswith("target accuracy"), report["final"]
    assert [f["promoted"] for f in report["shard_failovers"]] == [{"ps0": "ps1"}]
    assert report["ran_unreplicated"] and all(u["until_t"] is not None for u in report["unreplicated"])
    assert [e["event"] for e in report["membership"] if e["node"] == "ps0"] == ["lost", "restarted"]
    check_sections(report, ("shard_failovers", "unreplicated", "ran_unreplicated", "membership"))
