"""A node's event loop keeps heartbeating through slow work, and a background task that dies fails its node at once."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from hmp.cluster import JobFailed, LocalCluster
from hmp.job import load

from tests.support import free_port, write_config


# ----------------------------------------------------------------------------- real daemons

async def test_steps_and_evaluations_longer_than_three_heartbeats_do_not_lose_the_worker(tmp_path):
    """A worker whose every step and evaluation outlasts three heartbeat intervals keeps heartbeating: the job
    completes and the scheduler declares no node lost."""
    interval = 0.3
    path = write_config(tmp_path, workers="cpu", target=0.0, epochs=1, max_seconds=120)
    text = (path.read_text()
            .replace("heartbeat_interval_s = 0.5", f"heartbeat_interval_s = {interval}")
            # ~13 M parameters at batch 1024: seconds of forward/backward per step on one core.
            .replace('name = "digits_mlp"', 'name = "deep_mlp"\nargs = { in_features = 64, width = 2048, depth = 4 }')
            .replace("batch_size = 16", "batch_size = 1024")
            .replace("chunk_bytes = 16384", "chunk_bytes = 1048576"))
    path.write_text(text)
    cluster = LocalCluster(load(path), grace_s=5)
    async with cluster:
        report = await cluster.train(timeout_s=240)
    assert all(p.returncode == 0 for p in cluster.procs.values())
    series = report["series"]["cpu0"]
    step_s = max(p["busy_s"] / p["updates"] for p in series if p.get("updates"))
    assert step_s > 3 * interval, f"a step took {step_s:.2f} s: too fast to test anything"
    assert report["workers"]["cpu0"]["updates"] == 2  # 1437 examples at batch 1024, one epoch
    scheduler_log = (tmp_path / "run" / "logs" / "scheduler.log").read_text()
    assert "node_lost" not in scheduler_log and "worker_lost" not in scheduler_log


def _pipeline_job_whose_evaluation_fails(tmp) -> str:
    """A one-stage [placement] job on npz data whose test set holds labels the model's 2 outputs cannot score:
    training runs, the last stage's evaluation raises (cross_entropy: target out of bounds)."""
    rng = np.random.default_rng(0)
    x, x_test = rng.normal(size=(512, 8)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32)
    np.savez(tmp / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int64), x_test=x_test,
             y_test=np.arange(64, dtype=np.int64) % 4)
    text = f"""
[job]
name = "evalfail"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end

[model]
name = "deep_mlp"
args = {{ in_features = 8, width = 16, depth = 1, classes = 2 }}

[data]
kind = "npz"
path = "{tmp / 'data.npz'}"

[train]
batch_size = 64
epochs = 1000
max_seconds = 120
eval_every_s = 0.3
report_interval_s = 0.3

[placement]
enabled = true
planner = "greedy"
micro_batches = 2
min_throughput = 1.0
join_wait_s = 1.0
profile_repeats = 1
resources = [{{ name = "cpu", price_per_hour = 0.1 }}]

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"

[[nodes]]
id = "ps0"
role = "ps"

[[nodes]]
id = "cpu0"
role = "cpu_worker"
resource = "cpu"
"""
    path = tmp / "job.toml"
    path.write_text(text)
    return str(path)


async def test_a_stage_worker_whose_evaluation_raises_fails_at_once(tmp_path):
    """A stage worker's report loop that dies (its evaluation raises) fails the node at once, with the exception in
    its log, instead of leaving the job idle until max_seconds (120 s here)."""
    cluster = LocalCluster(load(_pipeline_job_whose_evaluation_fails(tmp_path)), grace_s=5)
    async with cluster:
        t0 = time.monotonic()
        with pytest.raises(JobFailed) as info:
            await cluster.train(timeout_s=100)
        waited = time.monotonic() - t0
    assert all(p.returncode is not None for p in cluster.procs.values())
    assert info.value.node == "cpu0" and cluster.procs["cpu0"].returncode == 1, str(info.value)
    assert waited < 60, f"the job went on for {waited:.0f} s"
    events = [json.loads(line) for line in (tmp_path / "run" / "logs" / "cpu0.log").read_text().splitlines()
              if line.startswith("{")]
    failed = [e for e in events if e["event"] == "task_failed"]
    assert failed and failed[0]["task"] == "reports", events[-5:]
    assert "out of bounds" in failed[0]["exception"]
