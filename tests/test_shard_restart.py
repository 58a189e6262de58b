"""A PS shard lost mid-job and started again with ``--resume`` (issue 13, "Shards that survive").

The cores first (no sockets): a retried push is applied once, the push numbers survive a
checkpoint, and the scheduler waits ``join_timeout_s`` for a lost shard whose role may be
restarted, tells the workers when it is down and back, and reports the updates its crash lost.
Then real daemons on loopback: a shard SIGKILLed in an async job and started again by hand
(``python -m hmp.nodes.main ps --resume``) at a new port; the job reaches its target.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hmp.ps.shard_core import ShardCore
from hmp.scheduler.core import Admitted, JobFailed, ShardsChanged

from .cluster_util import write_config
from .test_scheduler_core import HB, _running

ROOT = Path(__file__).resolve().parents[1]


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
    ShardCore.write(state, tmp_path / "old.pt")
    fresh = _shard()
    fresh.load(tmp_path / "old.pt")
    assert fresh.last_seq == {}


# ----------------------------------------------------------------------------- the scheduler core
RESTARTS = "restarts = { ps = 1 }"


def test_a_lost_shard_that_may_be_restarted_is_waited_for_and_rejoins_at_a_new_address():
    core = _running(tolerate=True, restarts=RESTARTS, join_timeout_s=10.0)
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
    core = _running(tolerate=True, restarts=RESTARTS, join_timeout_s=5.0)
    t = 0.0
    while core.failed is None and t < 20:
        t = round(t + 0.1 * HB, 2)
        for n in ("ps1", "cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    # Lost after 2.8 s of silence, then 5 s of join_timeout_s.
    assert 2.8 + 5.0 < t <= 2.9 + 5.0 + 0.2
    assert "PS shard ps0 was lost and did not come back within 5.0 s" in core.failed
    assert [e.reason for e in core.take_events() if isinstance(e, JobFailed)] == [core.failed]


def test_without_restarts_a_lost_shard_still_fails_the_job_at_once():
    core = _running(tolerate=True)
    for t in (1.0, 2.0, 3.0):
        for n in ("ps1", "cpu0", "gpu0"):
            core.heartbeat(n, t)
        core.tick(t)
    assert core.failed is not None and "ps0" in core.failed and "lost" in core.failed
    assert core.shards_down == set()


def test_a_shard_restarted_before_it_was_noticed_lost_is_taken_back_and_announced():
    core = _running(tolerate=True)  # no restarts needed: it never was lost
    decision = core.join("ps1", "ps", "tcp://ps1-new", 9, 0.5)
    assert isinstance(decision, Admitted) and core.failed is None
    changes = [e for e in core.take_events() if isinstance(e, ShardsChanged)]
    assert [(e.down, dict(e.shards)["ps1"]) for e in changes] == [((), "tcp://ps1-new")]
    assert core.run_report.shard_restarts[0]["address"] == "tcp://ps1-new"


# ----------------------------------------------------------------------------- real daemons
SLOW = 'name = "sgd"\nlr = 0.02'  # the job must outlast the crash, its detection and the restart by far
CHECKPOINT_EVERY = 20


def _env() -> dict[str, str]:
    """The daemons' environment: this checkout importable, no job token (started by hand, as a user would)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HMP_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class _Daemons:
    """The job's daemons as processes (``python -m hmp.nodes.main``), each logging to a file; every one is
    stopped (SIGTERM, then SIGKILL after a grace) when the block ends, however it ends."""

    def __init__(self, cfg: Path, logs: Path) -> None:
        self.cfg, self.logs = cfg, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}

    def start(self, role: str, node_id: str, *extra: str) -> subprocess.Popen:
        self.starts[node_id] = self.starts.get(node_id, 0) + 1
        log = open(self.logs / f"{node_id}.{self.starts[node_id]}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen([sys.executable, "-m", "hmp.nodes.main", role, "--config", str(self.cfg),
                                 "--id", node_id, *extra], env=_env(), stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child has its own descriptor
        self.procs[node_id] = proc
        return proc

    def log(self, node_id: str, start: int = 1) -> str:
        return (self.logs / f"{node_id}.{start}.log").read_text(errors="replace")

    def __enter__(self) -> _Daemons:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def _job(tmp: Path, join_timeout_s: float = 60) -> Path:
    """An async digits job, shards on port 0 (a restarted shard comes back at another port), role ps restartable."""
    cfg = write_config(tmp, consistency="async", target=0.95, epochs=200, max_seconds=120, optimizer=SLOW,
                       checkpoint_every=CHECKPOINT_EVERY)
    text = cfg.read_text().replace("join_timeout_s = 60", f"join_timeout_s = {join_timeout_s}\n{RESTARTS}")
    cfg.write_text(text + "\n[shm]\nenabled = false\n")
    return cfg


def _checkpoint_version(path: Path) -> int:
    try:
        return int(ShardCore.read(path)["version"])
    except Exception:  # not written yet, or being replaced
        return -1


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        await asyncio.sleep(0.05)


def _start_job(d: _Daemons) -> None:
    d.start("scheduler", "scheduler")
    for s in ("ps0", "ps1"):
        d.start("ps", s)
    d.start("cpu_worker", "cpu0")
    d.start("gpu_worker", "gpu0")


async def test_a_killed_shard_restarted_with_resume_rejoins_and_the_job_reaches_its_target(tmp_path):
    cfg = _job(tmp_path)
    checkpoint = tmp_path / "ckpt" / "ps0.pt"
    with _Daemons(cfg, tmp_path) as d:
        _start_job(d)
        # Training, with a few checkpoints of ps0 written.
        await _until(lambda: _checkpoint_version(checkpoint) >= 3 * CHECKPOINT_EVERY, 90, "ps0 has checkpoints")
        d.procs["ps0"].kill()
        assert d.procs["ps0"].wait(timeout=10) == -signal.SIGKILL
        await asyncio.sleep(4 * HB_JOB)  # the scheduler declares it lost; the workers' pushes wait
        assert d.procs["scheduler"].poll() is None  # the job did not fail
        d.start("ps", "ps0", "--resume")
        rc = await asyncio.to_thread(d.procs["scheduler"].wait, 150)
        assert rc == 0, d.log("scheduler")[-3000:]
        for n in ("cpu0", "gpu0", "ps1"):
            assert d.procs[n].wait(timeout=20) == 0, d.log(n)[-2000:]
        assert d.procs["ps0"].wait(timeout=20) == 0, d.log("ps0", 2)[-2000:]
        retried = d.log("cpu0") + d.log("gpu0")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["final"]["stop_reason"].startswith("target accuracy"), report["final"]
    assert report["final"]["test_accuracy"] >= 0.9  # the shards' parameters at the end, restarted one included
    (restart,) = report["shard_restarts"]
    assert restart["node"] == "ps0" and restart["address"] != restart["was_address"]
    assert restart["resumed_version"] >= 3 * CHECKPOINT_EVERY
    assert 0 <= restart["updates_lost"] <= CHECKPOINT_EVERY, restart
    # Known from the workers' last replies (the heartbeats lag an interval, tens of updates here).
    assert restart["version_before"] >= restart["resumed_version"] - 2, restart
    assert [e["event"] for e in report["membership"] if e["node"] == "ps0"] == ["lost", "restarted"]
    assert "push_retry" in retried or "push_failed_during_shard_change" in retried


async def test_a_killed_shard_that_is_not_restarted_fails_the_job_after_join_timeout(tmp_path):
    join_timeout_s = 12
    cfg = _job(tmp_path, join_timeout_s=join_timeout_s)
    with _Daemons(cfg, tmp_path) as d:
        _start_job(d)
        await _until(lambda: _checkpoint_version(tmp_path / "ckpt" / "ps0.pt") >= CHECKPOINT_EVERY, 90,
                     "ps0 has a checkpoint")
        d.procs["ps0"].kill()
        t0 = time.monotonic()
        rc = await asyncio.to_thread(d.procs["scheduler"].wait, join_timeout_s + 30)
        waited = time.monotonic() - t0
        assert rc == 1
        log = d.log("scheduler")
        assert "PS shard ps0 was lost and did not come back within" in log, log[-3000:]
        # Lost within 3 heartbeat intervals, then join_timeout_s; bounded on a shared machine.
        assert join_timeout_s < waited < join_timeout_s + 3 * HB_JOB + 10
        for n in ("cpu0", "gpu0", "ps1"):  # told the job is over: they stop, none needs SIGKILL
            d.procs[n].wait(timeout=20)


HB_JOB = 0.3  # cluster_util's heartbeat interval


# ----------------------------------------------------------------------------- a shard daemon, in this process
@pytest.mark.parametrize("consistency", ["sync", "ssp"])
async def test_a_retry_of_a_push_still_waiting_in_the_shard_is_applied_once(tmp_path, consistency):
    """A worker abandons a push that waits for its sync round or the SSP bound (a shard went down) and
    sends it again with the same seq: the retry is answered with the original's result, applied once."""
    from hmp.config import load
    from hmp.messages import Push
    from hmp.nodes.ps_shard import PSShardNode

    from .test_checkpoint import _as, _config, _grads, _running

    node = PSShardNode(load(_config(tmp_path, consistency=consistency, extra_train="staleness = 0")), "ps0")
    keys, grads = _grads(node)
    async with _running(node), _as(node, "cpu0") as cpu, _as(node, "cpu0") as cpu_again, _as(node, "gpu0") as gpu:
        if consistency == "ssp":  # cpu0 one update ahead: its next push waits for gpu0's
            await cpu.request(Push(keys=keys, grads=grads, seq=4))
        first = asyncio.create_task(cpu.request(Push(keys=keys, grads=grads, seq=5)))
        await asyncio.sleep(0.2)
        retry = asyncio.create_task(cpu_again.request(Push(keys=keys, grads=grads, seq=5)))
        await asyncio.sleep(0.2)
        assert not first.done() and not retry.done()
        await gpu.request(Push(keys=keys, grads=grads, seq=100))
        a, b = await asyncio.wait_for(asyncio.gather(first, retry), 5)
        expected = 1 if consistency == "sync" else 3  # sync: one round of both; ssp: cpu0 twice and gpu0 once
        assert node.core.version == expected and a.version == b.version
        assert node.core.last_seq["cpu0"] == 5 and node.stats["duplicates"] == 1
        assert all(torch.equal(x, y) for x, y in zip(a.values, b.values))


async def test_the_launcher_restarts_a_killed_shard_which_resumes_and_the_job_completes(tmp_path):
    """[job] restarts = {ps = 1} through LocalCluster: ps0 SIGKILLed mid-job is started again with --resume by
    the launcher (no hand work), the workers wait for it and retry, and the job reaches its target."""
    from hmp.cluster import LocalCluster

    cfg = _job(tmp_path)
    checkpoint = tmp_path / "ckpt" / "ps0.pt"
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until(lambda: _checkpoint_version(checkpoint) >= 2 * CHECKPOINT_EVERY, 90, "ps0 has checkpoints")
        cluster.kill("ps0", signal.SIGKILL)
        report = await cluster.train(timeout_s=150)
        assert [(r["node"], r["exit_code"]) for r in cluster.restarts] == [("ps0", -signal.SIGKILL)]
        assert cluster.procs["ps0"].returncode == 0
    (restart,) = report["shard_restarts"]
    assert restart["node"] == "ps0" and 0 <= restart["updates_lost"] <= CHECKPOINT_EVERY, restart
    assert report["final"]["stop_reason"].startswith("target accuracy"), report["final"]
    assert (tmp_path / "run" / "logs" / "ps0.1.log").read_text().count("resumed") >= 1
