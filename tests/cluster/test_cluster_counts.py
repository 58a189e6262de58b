"""Topologies by count, end to end: a ``[cluster]`` job with command-line overrides through ``hmp-launch`` (its
scheduler port picked, the run folder's config.toml showing what ran), and a ring by count through the API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hmp import job
from hmp.cluster import LocalCluster
from tests.support import digits_job_text, free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(Path(sys.executable).parent / "hmp-launch")  # the console script of the environment under test


def launch(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    """``hmp-launch ARGS``; on a timeout the launcher gets SIGTERM (it stops its daemons) rather than SIGKILL."""
    proc = subprocess.Popen([LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"hmp-launch ran over {timeout_s} s: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_job_by_count_with_overrides_trains_and_its_run_folder_says_what_ran(tmp_path):
    """[cluster] ps = 1, cpu_workers = 1, no scheduler port; the command line makes it 2 shards and 2 workers and
    changes the learning rate. The job trains its 2 epochs on that topology, and <report_dir>/config.toml (what
    the daemons read) holds the overridden values, the nodes written out and the port hmp-launch picked."""
    text = digits_job_text(tmp_path, name="counts", target=0.0, epochs=5) + """
[ps]
chunk_bytes = 16384
[cluster]
ps = 1
cpu_workers = 1
cpu_batch_size = 32
"""
    path = tmp_path / "job.toml"
    path.write_text(text)
    overrides = ["cluster.cpu_workers=2", "cluster.ps=2", "optimizer.lr=0.1", "train.epochs=2",
                 "job.heartbeat_interval_s=1"]  # a slower heartbeat: a loaded machine loses no node
    done = launch(str(path), *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final test accuracy" in done.stdout, done.stdout
    run = tmp_path / "run"
    report = json.loads((run / "report.json").read_text())
    assert sorted(report["workers"]) == ["cpu0", "cpu1"]
    assert len(report["sharding"]["bytes_per_shard"]) == 2
    assert report["final"]["stop_reason"] == "epochs done", report["final"]
    copy = (run / "config.toml").read_text()
    assert "command-line overrides: " + " ".join(overrides) in copy
    raw = tomllib.loads(copy)
    assert raw["optimizer"]["lr"] == 0.1 and raw["train"]["epochs"] == 2 and "cluster" not in raw
    assert [(n["id"], n["role"]) for n in raw["nodes"]] == [
        ("scheduler", "scheduler"), ("ps0", "ps"), ("ps1", "ps"), ("cpu0", "cpu_worker"), ("cpu1", "cpu_worker")]
    port = int(raw["nodes"][0]["bind"].rpartition(":")[2])
    assert port > 0 and all(n["bind"] == "tcp://127.0.0.1:0" for n in raw["nodes"][1:])
    again = job.load(run / "config.toml")  # what the daemons read loads as it is
    assert again.optimizer.lr == 0.1 and [n.batch_size for n in again.workers] == [32, 32]


async def test_a_ring_by_count_through_the_api(tmp_path):
    """consistency = "allreduce" with [cluster] cpu_workers = 2 and a fixed scheduler port: no PS (the default
    there), a 2-member ring that trains and exports its model."""
    text = digits_job_text(tmp_path, name="ring-counts", consistency="allreduce", target=0.0, epochs=2) + f"""
[cluster]
cpu_workers = 2
scheduler_port = {free_port()}
"""
    path = tmp_path / "ring.toml"
    path.write_text(text)
    cfg = job.load(path)
    assert [n.id for n in cfg.nodes] == ["scheduler", "cpu0", "cpu1"]
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=60)
    assert sorted(report["workers"]) == ["cpu0", "cpu1"]
    assert report["final"]["parameters"] == "ring" and report["final"]["model"]
