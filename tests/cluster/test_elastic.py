"""Elastic workers, with real daemons on loopback: a worker that dies, hangs or leaves does not end the job;
too few workers do; a crashed worker is restarted and rejoins (PS and allreduce jobs); a frozen ring member is
dropped and the ring goes on; a worker (PS, ring or pipeline stage) blocked on a frozen peer stops at once on
SIGTERM; a pipeline job goes on after a shard restart (docs/architecture.md, "Elastic workers")."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from hmp.cluster import JobFailed, LocalCluster

from tests.support import HB_JOB, pipeline_config, ring_config, write_config

pytestmark = pytest.mark.timeout(180)
HB = HB_JOB
#: A slower optimizer than the other cluster tests': the job must outlast a fault's detection (~1 s) by far.
SLOW = 'name = "sgd"\nlr = 0.02'


async def _until_training(cluster: LocalCluster, workers: tuple[str, ...] = ("cpu0", "gpu0"),
                          updates: int = 5) -> dict:
    """The scheduler's status once every worker in ``workers`` has reported ``updates`` updates."""
    st = None
    for _ in range(600):
        st = await cluster.status()
        w = (st or {}).get("workers", {})
        if all(w.get(n, {}).get("updates", 0) > updates for n in workers):
            return st
        await asyncio.sleep(0.1)
    pytest.fail(f"the job did not start training: {st}")


async def _until_state(cluster: LocalCluster, node: str, state: str, timeout_s: float) -> float:
    """Seconds until the scheduler's status shows ``node`` in ``state`` (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        st = await cluster.status(timeout_s=1.0)
        if st and st["members"].get(node) == state:
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    pytest.fail(f"{node} not {state} within {timeout_s} s: {st and st['members']}")


async def _trains_on(cluster: LocalCluster, worker: str, more: int = 20, timeout_s: float = 30) -> None:
    """Until ``worker`` has reported ``more`` updates beyond its count now: the job went on."""
    async def updates() -> int:
        return int(((await cluster.status() or {}).get("workers", {}).get(worker) or {}).get("updates", 0))

    target, deadline = await updates() + more, time.monotonic() + timeout_s
    while await updates() < target:
        assert time.monotonic() < deadline, f"{worker} did not train on"
        await asyncio.sleep(0.1)


def _report(tmp: Path) -> dict:
    return json.loads((tmp / "run" / "report.json").read_text())


def _events(report: dict, node: str) -> list[str]:
    return [e["event"] for e in report["membership"] if e["node"] == node]


@pytest.mark.parametrize("consistency", ["async", "sync"])
async def test_a_killed_worker_does_not_end_a_ps_job(tmp_path, consistency):
    """SIGKILL of a worker mid-job: the scheduler drops it within the heartbeat bound, the shards stop waiting for
    it (sync rounds), and the survivor trains on (then the test finishes the job); the report names the lost
    worker. In async mode the data goes first come first served: the range the dead worker held is handed out
    again."""
    policy = "hogbatch" if consistency == "async" else "static"
    cfg = write_config(tmp_path, consistency=consistency, policy=policy, target=0.0, epochs=200, max_seconds=120,
                       optimizer=SLOW)
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster)
        cluster.kill("gpu0", signal.SIGKILL)
        detected = await _until_state(cluster, "gpu0", "lost", 10)
        await _trains_on(cluster, "cpu0")
        await cluster.finish("the survivor trained on")
        report = await cluster.train(timeout_s=60)
        assert cluster.worker_exits == {"gpu0": -signal.SIGKILL}
        assert all(p.returncode == 0 for n, p in cluster.procs.items() if n != "gpu0")
    # 3 intervals of silence, plus the last heartbeat's age, a tick and this poll on a shared machine.
    assert detected < 4 * HB + 1.0, detected
    assert _events(report, "gpu0") == ["lost"], report["membership"]
    assert "the survivor trained on" in report["final"]["stop_reason"], report["final"]
    if consistency == "async":
        assert report["work_redone"] > 0
    assert report["final"]["elapsed_s"] > report["membership"][0]["t"]  # it went on after the loss
    shard_log = (tmp_path / "run" / "logs" / "ps0.log").read_text()
    assert "gpu0" in shard_log and "drop" in shard_log


async def test_a_hung_worker_is_dropped_and_the_job_completes(tmp_path):
    """SIGSTOP of a worker (a hang): it is lost within the heartbeat bound and the job goes on and completes
    without it."""
    cfg = write_config(tmp_path, target=0.0, epochs=200, max_seconds=120, optimizer=SLOW)
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster)
        cluster.kill("gpu0", signal.SIGSTOP)
        try:
            detected = await _until_state(cluster, "gpu0", "lost", 10)
            await _trains_on(cluster, "cpu0")
            await cluster.finish("the job went on without gpu0")
            code = await asyncio.wait_for(cluster.procs["scheduler"].wait(), 60)
        finally:
            cluster.kill("gpu0", signal.SIGCONT)
        assert code == 0, cluster.log_tail("scheduler", 30)
    assert detected < 4 * HB + 1.0, detected
    report = _report(tmp_path)
    assert _events(report, "gpu0") == ["lost"] and "without gpu0" in report["final"]["stop_reason"]


async def test_fewer_live_workers_than_min_workers_fails_the_job(tmp_path):
    """[train] min_workers = 2 and one of the two workers killed: the job fails, naming the killed worker first
    and the rule in the scheduler's log."""
    cfg = write_config(tmp_path, target=1.0, epochs=1000, max_seconds=120, extra_train="min_workers = 2")
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster)
        cluster.kill("gpu0", signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(JobFailed) as info:
            await cluster.train(timeout_s=60)
        waited = time.monotonic() - t0
    assert info.value.node == "gpu0" and "then scheduler exited with code 1" in str(info.value), info.value
    assert "only 1 of 2 workers remain (cpu0) after gpu0 lost" in cluster.log_tail("scheduler", 40)
    assert "min_workers = 2" in str(info.value)
    assert waited < 4 * HB + 10


async def test_a_restarted_worker_rejoins_a_ps_job(tmp_path):
    """[job] restarts = {cpu_worker = 1}: cpu0 (the worker that evaluates) killed mid-job is started again by the
    launcher, rejoins with a new process, pulls the current parameters and the job reaches its target."""
    cfg = write_config(tmp_path, target=0.95, epochs=200, max_seconds=120, optimizer=SLOW)
    cfg.write_text(cfg.read_text().replace("join_timeout_s = 60", "join_timeout_s = 60\nrestarts = { cpu_worker = 1 }"))
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster)
        old = cluster.procs["cpu0"].pid
        cluster.kill("cpu0", signal.SIGKILL)
        report = await cluster.train(timeout_s=150)
        assert cluster.procs["cpu0"].pid != old and cluster.procs["cpu0"].returncode == 0
        assert [(r["node"], r["attempt"], r["exit_code"]) for r in cluster.restarts] == [("cpu0", 1, -signal.SIGKILL)]
        assert cluster.worker_exits == {}
    assert "restarted" in _events(report, "cpu0"), report["membership"]
    assert report["final"]["best_reported_accuracy"] >= 0.95
    assert (tmp_path / "run" / "logs" / "cpu0.1.log").read_text().count("joined") >= 1


async def test_a_restarted_ring_member_rejoins_a_new_ring_generation(tmp_path):
    """Allreduce with [job] restarts: w1 killed mid-run is restarted, joins a new ring generation with the
    survivors, resyncs from them and the job reaches its target with identical replicas."""
    cfg = ring_config(tmp_path, workers=2, target=0.95, epochs=200, max_seconds=120)
    cfg.write_text(cfg.read_text().replace("join_timeout_s = 60", "join_timeout_s = 60\nrestarts = { cpu_worker = 1 }"))
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster, ("w0", "w1"), updates=10)
        cluster.kill("w1", signal.SIGKILL)
        report = await cluster.train(timeout_s=150)
        assert [r["node"] for r in cluster.restarts] == ["w1"]
    gens = report["rings"]
    assert gens[-1]["members"] == ["w0", "w1"] and "w1 joined" in gens[-1]["why"], gens
    assert "restarted" in _events(report, "w1"), report["membership"]
    assert report["final"]["test_accuracy"] >= 0.95
    finals = [report["series"][w][-1] for w in ("w0", "w1")]
    assert finals[0]["ring_generation"] == finals[1]["ring_generation"] == gens[-1]["generation"]
    assert finals[0]["params_crc32"] == finals[1]["params_crc32"]


def _slow_heartbeats(tmp_path: Path) -> Path:
    """A long job whose heartbeat interval is long: a frozen peer is not declared lost during the test, so that
    the scheduler's own stop cannot be what ends the worker."""
    cfg = write_config(tmp_path, target=1.0, epochs=1000, max_seconds=120)
    cfg.write_text(cfg.read_text().replace("heartbeat_interval_s = 0.5", "heartbeat_interval_s = 3.0"))
    return cfg


async def _sigterm_cpu0_while_frozen(cluster: LocalCluster, frozen: str, settle_s: float,
                                     victim: str = "cpu0") -> tuple[int, float]:
    """Freeze ``frozen`` (SIGSTOP), let ``victim`` block on it for ``settle_s``, SIGTERM ``victim``: its exit code
    and how long it took to exit. ``frozen`` is thawed afterwards, also on failure."""
    cluster.kill(frozen, signal.SIGSTOP)
    try:
        await asyncio.sleep(settle_s)
        t0 = time.monotonic()
        cluster.kill(victim, signal.SIGTERM)
        code = await asyncio.wait_for(cluster.procs[victim].wait(), 30)
        return code, time.monotonic() - t0
    finally:
        cluster.kill(frozen, signal.SIGCONT)


async def test_a_worker_blocked_on_a_frozen_shard_stops_at_once_on_sigterm(tmp_path):
    """ps1 frozen (SIGSTOP): cpu0's asynchronous push to it can never complete. SIGTERM makes cpu0 give up the
    push and exit 0 within about 2 s (its goodbye to ps1 waits 1 s), not after its 60 s request timeout."""
    cfg = _slow_heartbeats(tmp_path)
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster)
        # every push reaches ps1 (both shards hold chunks): after 0.5 s cpu0 is blocked
        code, waited = await _sigterm_cpu0_while_frozen(cluster, "ps1", settle_s=0.5)
    assert code == 0 and waited < 3.0, (code, waited)
    log = (tmp_path / "run" / "logs" / "cpu0.log").read_text()
    assert "push_abandoned" in log


async def test_a_worker_blocked_on_a_frozen_scheduler_stops_promptly_on_sigterm(tmp_path):
    """The scheduler frozen (SIGSTOP): cpu0's next progress report can never be answered. SIGTERM makes cpu0 give
    it up and exit 0 after its bounded goodbyes (the final report and the leave, 2 s each), not after the report's
    10 s timeout and more."""
    cfg = _slow_heartbeats(tmp_path)
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster)
        # reports are due every 0.3 s: after 1 s cpu0 is waiting for one
        code, waited = await _sigterm_cpu0_while_frozen(cluster, "scheduler", settle_s=1.0)
    assert code == 0 and waited < 6.0, (code, waited)


async def test_a_frozen_ring_member_is_dropped_and_the_ring_goes_on(tmp_path):
    """Allreduce, three members; w1 frozen (SIGSTOP) mid-run. The survivors give up the step they were blocked
    in as soon as the scheduler re-forms the ring without w1 (within the heartbeat bound, not the collective
    timeout), resync and train on to the target with identical replicas. Thawed afterwards, w1 learns it was
    dropped (its heartbeat is refused) and stops on its own, exit 0."""
    cfg = ring_config(tmp_path, workers=3, target=0.95, epochs=200, max_seconds=120)
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster, ("w0", "w1", "w2"), updates=10)
        cluster.kill("w1", signal.SIGSTOP)
        try:
            detected = await _until_state(cluster, "w1", "lost", 10)
            t0 = time.monotonic()
            # the survivors train again in the re-formed ring: their updates grow past what they were
            before = (await cluster.status())["workers"]
            for _ in range(100):
                st = (await cluster.status())["workers"]
                if all(st[w]["updates"] > before[w]["updates"] for w in ("w0", "w2")):
                    break
                await asyncio.sleep(0.05)
            recovered = time.monotonic() - t0
        finally:
            cluster.kill("w1", signal.SIGCONT)
        code = await asyncio.wait_for(cluster.procs["scheduler"].wait(), 150)
        assert code == 0, cluster.log_tail("scheduler", 30)
        assert await asyncio.wait_for(cluster.procs["w1"].wait(), 15) == 0, cluster.log_tail("w1", 30)
    assert detected < 4 * HB + 1.0, detected
    assert recovered < 5.0, recovered  # far below the collective timeout (request_timeout_s, 60 s)
    report = _report(tmp_path)
    gens = report["rings"]
    assert gens[-1]["members"] == ["w0", "w2"] and "w1" in gens[-1]["why"], gens
    assert _events(report, "w1")[0] == "lost", report["membership"]
    assert report["final"]["test_accuracy"] >= 0.95
    finals = [report["series"][w][-1] for w in ("w0", "w2")]
    assert finals[0]["params_crc32"] == finals[1]["params_crc32"]


@pytest.mark.parametrize("frozen", ["accel0", "ps1"])
async def test_a_stage_worker_blocked_on_a_frozen_peer_stops_at_once_on_sigterm(tmp_path, frozen):
    """A pipeline job (cpu0 runs the embedding stage, accel0 the MLP); accel0 frozen: cpu0 waits for its
    gradients forever; ps1 frozen: cpu0's push to it is never answered. SIGTERM makes cpu0 give the wait up and
    exit 0 at once (a frozen shard: after the last push's 1 s grace and the 1 s goodbye), not after the 60 s
    request timeout. Heartbeats are slow, so that the frozen peer is not declared lost meanwhile."""
    from hmp.job import loads


    pipeline_config(tmp_path, epochs=200, max_seconds=60.0, workers=("cpu0", "accel0"), join_wait_s=1.0)
    path = tmp_path / "pipe.toml"
    path.write_text(path.read_text().replace("heartbeat_interval_s = 0.5", "heartbeat_interval_s = 3.0"))
    async with LocalCluster(loads(path.read_text(), str(path)), grace_s=5) as cluster:
        for _ in range(600):
            st = await cluster.status()
            if st and st.get("pipeline", {}).get("max_step", 0) > 3:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the pipeline did not start training: {st}")
        code, waited = await _sigterm_cpu0_while_frozen(cluster, frozen, settle_s=1.0)
    assert code == 0, (tmp_path / "run" / "logs" / "cpu0.log").read_text()[-3000:]
    assert waited < (3.0 if frozen == "ps1" else 1.5), waited
    if frozen == "ps1":
        assert "push_abandoned" in (tmp_path / "run" / "logs" / "cpu0.log").read_text()


async def test_a_ring_member_blocked_on_a_frozen_member_stops_promptly_on_sigterm(tmp_path):
    """Allreduce, two members; w1 frozen: w0's next all-reduce can never complete. SIGTERM makes w0 give its
    step 1 s to carry its stop vote, then abandon the ring and exit 0, not after the collective timeout (60 s).
    Heartbeats are slow, so that w1 is not declared lost meanwhile (which would re-form the ring)."""
    cfg = ring_config(tmp_path, workers=2, target=1.0, epochs=1000, max_seconds=120)
    cfg.write_text(cfg.read_text().replace("heartbeat_interval_s = 0.5", "heartbeat_interval_s = 3.0"))
    async with LocalCluster(cfg, grace_s=5) as cluster:
        await _until_training(cluster, ("w0", "w1"), updates=10)
        code, waited = await _sigterm_cpu0_while_frozen(cluster, "w1", settle_s=0.5, victim="w0")
    assert code == 0 and waited < 3.5, (code, waited)
    assert "ring_abandoned" in (tmp_path / "run" / "logs" / "w0.log").read_text()


async def test_a_pipeline_job_goes_on_after_a_shard_restart(tmp_path):
    """A pipeline job with [job] restarts = {ps = 1}: ps1 killed mid-run is restarted from its checkpoint at a new
    address; the stage workers learn it from the scheduler's shards message, send their pushes in flight again
    to the new address and train on to the end (max_seconds); the report lists the restart."""
    from hmp.job import loads


    pipeline_config(tmp_path, epochs=200, max_seconds=8.0, workers=("cpu0", "accel0"), join_wait_s=1.0)
    path = tmp_path / "pipe.toml"
    path.write_text(path.read_text().replace("join_timeout_s = 60", "join_timeout_s = 60\nrestarts = { ps = 1 }")
                    .replace("chunk_bytes = 65536", "chunk_bytes = 65536\ncheckpoint_every = 5"))
    async with LocalCluster(loads(path.read_text(), str(path)), grace_s=5) as cluster:
        for _ in range(600):
            st = await cluster.status()
            # past the shards' first checkpoints: a shard restarted with --resume needs one
            if st and st.get("pipeline", {}).get("max_step", 0) > 12:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the pipeline did not start training: {st}")
        cluster.kill("ps1", signal.SIGKILL)
        report = await cluster.train(timeout_s=60)
        assert [r["node"] for r in cluster.restarts] == ["ps1"]
        codes = {n: p.returncode for n, p in cluster.procs.items()}
        assert all(c == 0 for c in codes.values()), codes
    assert [r["node"] for r in report["shard_restarts"]] == ["ps1"], report["shard_restarts"]
    logs = tmp_path / "run" / "logs"
    assert all("shard_moved" in (logs / f"{w}.log").read_text() for w in ("cpu0", "accel0"))
    t_restart = report["shard_restarts"][0]["t"]
    series = report["series"]["cpu0"]
    before = max(e["updates"] for e in series if e["t"] <= t_restart)
    assert series[-1]["updates"] > before + 3, (before, series[-1])  # it trained on after the restart
