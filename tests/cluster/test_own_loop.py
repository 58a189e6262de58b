"""Your loop, our gradient exchange (docs/own_loop.md): a training loop of the test's own joins a job as
its ``user_worker`` (``hmp.Worker`` / ``hmp.SyncWorker``), next to daemons a LocalCluster started."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.nn import functional as F

import hmp
from hmp.cluster import LocalCluster

from tests.support import ROOT, daemon_env, digits_job_text, free_port, nodes_toml, scheduler_node


def job_config(tmp: Path, *nodes: tuple, consistency: str = "async", epochs: int = 3, extra: str = "") -> Path:
    """A digits job of ``nodes`` (the scheduler added) that runs its epochs (no accuracy target). Heartbeats every
    2 s: on two loaded cores a daemon's final evaluation may hold its loop up for seconds."""
    text = digits_job_text(tmp, name="own", consistency=consistency, target=0.0, epochs=epochs, max_seconds=60,
                           train_extra="batch_size = 32") + extra + nodes_toml(scheduler_node(), *nodes)
    text = re.sub(r"(?m)^heartbeat_interval_s = .*$", "heartbeat_interval_s = 2.0", text)
    path = tmp / "job.toml"
    path.write_text(text)
    return path


SHARDS = (("ps0", "ps"), ("ps1", "ps"))
PS = "\n[ps]\nchunk_bytes = 16384\n"


async def own_loop(worker: hmp.Worker) -> int:
    """The test's training loop: forward, loss, backward, step; returns the steps it took."""
    async for x, y in worker.batches():
        loss = F.cross_entropy(worker.model(x), y)
        loss.backward()
        if not await worker.step(loss):
            break
    return worker.steps


def own_sync_loop(worker: hmp.SyncWorker) -> int:
    for x, y in worker.batches():
        loss = F.cross_entropy(worker.model(x), y)
        loss.backward()
        if not worker.step(loss):
            break
    return worker.steps


@pytest.mark.timeout(90)
async def test_async_ps_job_trains_in_the_users_loop(tmp_path):
    cfg = job_config(tmp_path, *SHARDS, ("mine", "user_worker"), extra=PS)
    async with LocalCluster(cfg) as cluster:
        assert "mine" not in cluster.procs  # the launcher starts every node but the user's
        async with hmp.Worker(cluster.cfg, "mine") as worker:
            assert (worker.index, worker.workers, worker.batch_size) == (0, 1, 32)
            assert worker.running
            steps = await own_loop(worker)
        assert not worker.running
        report = await cluster.train(timeout_s=60)
    # 3 epochs of 1437 training rows in batches of 32 (the last of each epoch shorter)
    assert steps == 3 * 45
    assert report["final"]["test_accuracy"] > 0.8
    mine = report["workers"]["mine"]
    assert mine["samples"] == 3 * 1437 and mine["updates"] == steps
    # worker 0 evaluates, inside step() and at the end, as a built-in worker 0 does
    assert report["series"]["mine"][-1]["test_accuracy"] > 0.8
    assert Path(worker.log_path).read_text().count("user_loop_admitted") == 1


@pytest.mark.timeout(90)
async def test_sync_wrapper_in_threads_with_a_builtin_worker_in_sync_rounds(tmp_path):
    """Two plain (not async) loops on threads of this process and a built-in CPU worker share sync rounds."""
    cfg = job_config(tmp_path, *SHARDS, ("u0", "user_worker"), ("u1", "user_worker"), ("cpu0", "cpu_worker"),
                     consistency="sync", epochs=5, extra=PS)
    async with LocalCluster(cfg) as cluster:
        def run(node_id: str) -> int:
            with hmp.SyncWorker(cluster.cfg, node_id) as worker:
                return own_sync_loop(worker)

        steps = await asyncio.gather(asyncio.to_thread(run, "u0"), asyncio.to_thread(run, "u1"))
        report = await cluster.train(timeout_s=60)
    assert set(report["workers"]) == {"u0", "u1", "cpu0"}
    # each trains its third of the rows (15 batches) for 5 epochs, every step one of everyone's in a sync round
    assert steps == [5 * 15, 5 * 15]
    assert {w["updates"] for w in report["workers"].values()} == {5 * 15}
    assert report["final"]["test_accuracy"] > 0.75


@pytest.mark.timeout(90)
async def test_ring_of_a_users_loop_and_a_builtin_member(tmp_path):
    """The user's member uses the built-in members' buckets, op numbers and stop votes: one ring, bit-identical
    replicas, and both stop after the same step."""
    ring = "\n[collective]\nbucket_bytes = 16384\nsmall_bytes = 4096\npiece_bytes = 4096\n"
    cfg = job_config(tmp_path, ("w0", "cpu_worker"), ("mine", "user_worker"), consistency="allreduce", epochs=4,
                     extra=ring)
    async with LocalCluster(cfg) as cluster:
        async with hmp.Worker(cluster.cfg, "mine") as worker:
            assert (worker.index, worker.workers) == (1, 2)
            steps = await own_loop(worker)
        report = await cluster.train(timeout_s=60)
    w0, mine = report["workers"]["w0"], report["workers"]["mine"]
    assert steps == mine["updates"] == w0["updates"] == 4 * (1437 // 64)
    finals = {w: report["series"][w][-1] for w in ("w0", "mine")}
    assert finals["mine"]["params_crc32"] == finals["w0"]["params_crc32"]
    assert report["final"]["test_accuracy"] > 0.85  # rank 0's (the built-in member's) final evaluation


@pytest.mark.timeout(90)
async def test_a_stop_reaches_a_user_blocked_in_step(tmp_path):
    """A sync round waits for a worker that never steps; the job's finish ends the step at once."""
    cfg = job_config(tmp_path, ("ps0", "ps"), ("u0", "user_worker"), ("u1", "user_worker"), consistency="sync",
                     epochs=50)
    async with LocalCluster(cfg) as cluster:
        async with hmp.Worker(cluster.cfg, "u0") as u0, hmp.Worker(cluster.cfg, "u1"):
            x, y = await anext(u0.batches())
            F.cross_entropy(u0.model(x), y).backward()
            step = asyncio.ensure_future(u0.step())
            await asyncio.sleep(1.0)
            assert not step.done()  # the round waits for u1
            t0 = time.monotonic()
            await cluster.finish("test done")
            assert await asyncio.wait_for(step, 10) is False
            assert time.monotonic() - t0 < 3.0
            assert [b async for b in u0.batches()] == []  # a stopped worker hands out no more batches
        report = await cluster.train(timeout_s=60)
    assert set(report["workers"]) == {"u0", "u1"}


@pytest.mark.timeout(120)
def test_the_docs_example_runs_as_a_script(tmp_path):
    text = (ROOT / "conf" / "own_loop.toml").read_text()
    text = text.replace("tcp://127.0.0.1:47120", f"tcp://127.0.0.1:{free_port()}")
    text = text.replace('report_dir = "runs/{name}"', f'report_dir = "{tmp_path / "run"}"')
    text = text.replace("epochs = 8", "epochs = 3").replace("heartbeat_interval_s = 0.5", "heartbeat_interval_s = 2.0")
    config = tmp_path / "own_loop.toml"
    config.write_text(text)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "own_loop.py"), str(config)], cwd=ROOT, env=daemon_env(),
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(out.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.85, out.stdout
    assert "workers in the report: mine" in out.stdout


@pytest.mark.timeout(90)
async def test_a_loop_that_raises_leaves_as_failed_and_the_job_goes_on(tmp_path):
    """Elastic rules: the user's worker that fails is dropped as a crashed one is, while min_workers remain."""
    cfg = job_config(tmp_path, *SHARDS, ("cpu0", "cpu_worker"), ("mine", "user_worker"), epochs=3, extra=PS)
    async with LocalCluster(cfg) as cluster:
        with pytest.raises(ZeroDivisionError):
            async with hmp.Worker(cluster.cfg, "mine") as worker:
                async for x, y in worker.batches():
                    F.cross_entropy(worker.model(x), y).backward()
                    await worker.step()
                    if worker.steps == 5:
                        1 / 0  # noqa: B018 - the user's bug
        assert worker.failed and "ZeroDivisionError" in worker.failed
        report = await cluster.train(timeout_s=60)
    left = [m for m in report["membership"] if m["node"] == "mine"]
    assert [m["event"] for m in left] == ["failed"] and "ZeroDivisionError" in left[0]["why"]
    assert report["workers"]["mine"]["updates"] <= 5
    assert report["workers"]["cpu0"]["updates"] == 3 * 23  # its half of the rows, every epoch


@pytest.mark.timeout(90)
async def test_a_ring_of_two_plain_loops_on_threads(tmp_path):
    """Two SyncWorker members of one ring, on two threads of this process; the first stops the ring early."""
    cfg = job_config(tmp_path, ("u0", "user_worker"), ("u1", "user_worker"), consistency="allreduce", epochs=3)
    async with LocalCluster(cfg) as cluster:
        def run(node_id: str, stop_after: int) -> int:
            with hmp.SyncWorker(cluster.cfg, node_id) as worker:
                for x, y in worker.batches():
                    F.cross_entropy(worker.model(x), y).backward()
                    if worker.steps == stop_after or not worker.step():
                        break  # u0 closes: its stop vote ends u1's loop after the same step
                return worker.steps

        steps = await asyncio.gather(asyncio.to_thread(run, "u0", 10), asyncio.to_thread(run, "u1", -1))
        report = await cluster.train(timeout_s=60)
    assert steps == [10, 10]
    finals = [report["series"][w][-1] for w in ("u0", "u1")]
    assert finals[0]["params_crc32"] == finals[1]["params_crc32"]
    assert "test_accuracy" in report["final"]  # rank 0 (u0) evaluated the replica when the ring stopped
