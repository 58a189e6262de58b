"""Allreduce jobs end to end: real daemons on loopback, no PS, the workers' ring (docs/collective.md)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hmp.cluster import LocalCluster
from tests.support import ring_config

BIN = str(Path(sys.executable).parent / "hmp-launch")  # the console script of the environment under test


def test_allreduce_job_trains_digits_through_hmp_launch(tmp_path):
    """bin/hmp-launch trains the digits MLP with four workers and no PS to >= 95% (on one host: buckets above
    small_bytes by halving-doubling, docs/collective.md); the replicas end bit-identical."""
    proc = subprocess.run([BIN, str(ring_config(tmp_path, workers=4))], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["consistency"] == "allreduce" and report["sharding"] == {}
    assert report["final"]["test_accuracy"] >= 0.95 and report["final"]["evaluated_by"] == "w0"
    assert [r["generation"] for r in report["rings"]] == [1]
    finals = [report["series"][w][-1] for w in ("w0", "w1", "w2", "w3")]
    assert finals[0]["updates"] > 0 and len({f["updates"] for f in finals}) == 1  # lockstep: the same steps
    assert len({f["params_crc32"] for f in finals}) == 1  # identical replicas, bit for bit
    logs = [(tmp_path / "run" / "logs" / f"w{i}.log").read_text() for i in range(4)]
    assert all('"large_buckets": "halving"' in log for log in logs), "halving-doubling not picked on one host"


async def test_allreduce_job_through_the_api_with_three_workers_survives_a_killed_member(tmp_path):
    """Three workers; rank 0 (the one that evaluates) is SIGKILLed mid-run. The scheduler loses it within the
    heartbeat bound and re-forms the ring from the survivors, who drop the failed step, resync and train on to the
    target, the new rank 0 evaluating; their replicas end identical; the report lists both ring generations."""
    cfg = ring_config(tmp_path, workers=3, target=0.95, epochs=200, max_seconds=90)
    async with LocalCluster(cfg) as cluster:
        for _ in range(300):
            st = await cluster.status()
            if st and all(w.get("updates", 0) > 10 for w in st.get("workers", {}).values()) and \
                    len(st.get("workers", {})) == 3:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the ring did not start training: {st}")
        cluster.kill("w0", signal.SIGKILL)
        code = await asyncio.wait_for(cluster.procs["scheduler"].wait(), 120)
        assert code == 0, cluster.log_tail("scheduler", 40)
        for w in ("w1", "w2"):
            assert await asyncio.wait_for(cluster.procs[w].wait(), 30) == 0, cluster.log_tail(w, 40)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    gens = report["rings"]
    assert [g["generation"] for g in gens] == [1, 2] and gens[1]["members"] == ["w1", "w2"], gens
    assert "w0" in gens[1]["why"]
    assert report["final"]["test_accuracy"] >= 0.95 and report["final"]["evaluated_by"] == "w1"
    finals = [report["series"][w][-1] for w in ("w1", "w2")]
    assert finals[0]["ring_generation"] == finals[1]["ring_generation"] == 2
    assert finals[0]["updates"] == finals[1]["updates"]
    assert finals[0]["params_crc32"] == finals[1]["params_crc32"]
