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

import pytest
import torch

from hmp.config import load
from hmp.nodes.worker import WorkerNode
from hmp.ps.shard_core import ShardCore

from tests.support import Daemons, HB_JOB, check_sections, until, write_config

ADAM = 'name = "adam"\nlr = 0.01'
SGD = 'name = "sgd"\nlr = 0.01'


# ----------------------------------------------------------------------------- the scheduler core
REPLICATED = "[ps]\nreplicas = 2"  # into _cfg's [job] lines: its own section


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
    with Daemons(path, tmp_path) as d:
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
    with Daemons(path, tmp_path) as d:
        d.start("scheduler", "scheduler")
        for s in ("ps0", "ps1"):
            d.start("ps", s)
        d.start("cpu_worker", "cpu0")
        d.start("gpu_worker", "gpu0")
        await until(lambda: (tmp_path / "ckpt" / "ps0.pt").exists(), 60, "ps0 wrote a checkpoint")
        d.procs["ps0"].kill()
        await until(lambda: '"promoted"' in d.log("ps1"), 10, "ps1 took group ps0 over")
        d.start("ps", "ps0", "--resume")
        await until(lambda: d.log("ps0", 2).count('"copy_received"') >= 2, 20, "ps0 has copies of both groups")
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
