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
import signal
import time
from pathlib import Path

from hmp.ps import checkpoint

from tests.support import Daemons, HB_JOB, until, write_config

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the scheduler core
RESTARTS = "restarts = { ps = 1 }"


# ----------------------------------------------------------------------------- real daemons
SLOW = 'name = "sgd"\nlr = 0.02'  # the job must outlast the crash, its detection and the restart by far
CHECKPOINT_EVERY = 20


def _job(tmp: Path, join_timeout_s: float = 60) -> Path:
    """An async digits job, shards on port 0 (a restarted shard comes back at another port), role ps restartable."""
    cfg = write_config(tmp, consistency="async", target=0.95, epochs=200, max_seconds=120, optimizer=SLOW,
                       checkpoint_every=CHECKPOINT_EVERY)
    text = cfg.read_text().replace("join_timeout_s = 60", f"join_timeout_s = {join_timeout_s}\n{RESTARTS}")
    cfg.write_text(text + "\n[shm]\nenabled = false\n")
    return cfg


def _checkpoint_version(path: Path) -> int:
    try:
        return int(checkpoint.read(path)["version"])
    except Exception:  # not written yet, or being replaced
        return -1


def _start_job(d: Daemons) -> None:
    d.start("scheduler", "scheduler")
    for s in ("ps0", "ps1"):
        d.start("ps", s)
    d.start("cpu_worker", "cpu0")
    d.start("gpu_worker", "gpu0")


async def test_a_killed_shard_restarted_with_resume_rejoins_and_the_job_reaches_its_target(tmp_path):
    cfg = _job(tmp_path)
    checkpoint = tmp_path / "ckpt" / "ps0.pt"
    with Daemons(cfg, tmp_path) as d:
        _start_job(d)
        # Training, with a few checkpoints of ps0 written.
        await until(lambda: _checkpoint_version(checkpoint) >= 3 * CHECKPOINT_EVERY, 90, "ps0 has checkpoints")
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
    join_timeout_s = 5
    cfg = _job(tmp_path, join_timeout_s=join_timeout_s)
    with Daemons(cfg, tmp_path) as d:
        _start_job(d)
        await until(lambda: _checkpoint_version(tmp_path / "ckpt" / "ps0.pt") >= CHECKPOINT_EVERY, 90,
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


async def test_the_launcher_restarts_a_killed_shard_which_resumes_and_the_job_completes(tmp_path):
    """[job] restarts = {ps = 1} through LocalCluster: ps0 SIGKILLed mid-job is started again with --resume by
    the launcher (no hand work), the workers wait for it and retry, and the job reaches its target."""
    from hmp.cluster import LocalCluster

    cfg = _job(tmp_path)
    checkpoint = tmp_path / "ckpt" / "ps0.pt"
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await until(lambda: _checkpoint_version(checkpoint) >= 2 * CHECKPOINT_EVERY, 90, "ps0 has checkpoints")
        cluster.kill("ps0", signal.SIGKILL)
        report = await cluster.train(timeout_s=150)
        assert [(r["node"], r["exit_code"]) for r in cluster.restarts] == [("ps0", -signal.SIGKILL)]
        assert cluster.procs["ps0"].returncode == 0
    (restart,) = report["shard_restarts"]
    assert restart["node"] == "ps0" and 0 <= restart["updates_lost"] <= CHECKPOINT_EVERY, restart
    assert report["final"]["stop_reason"].startswith("target accuracy"), report["final"]
    assert (tmp_path / "run" / "logs" / "ps0.1.log").read_text().count("resumed") >= 1
