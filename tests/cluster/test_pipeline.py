"""Pipeline runtime: the sans-IO stage split, then real pipeline jobs on loopback (train, re-plan)."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from hmp.cluster import LocalCluster
from hmp.models import click_model, deep_mlp
from hmp.placement.problem import NOT_MEASURED

from tests.support import pipeline_config

CLICK = (click_model, dict(fields=4, buckets=50, dim=8, hidden=(32, 16)), lambda n: torch.randint(0, 50, (n, 4)))
MLP = (deep_mlp, dict(in_features=12, width=24, depth=4, classes=5), lambda n: torch.randn(n, 12))


# ----------------------------------------------------------------------------- real jobs


async def test_click_pipeline_trains_and_reports_plan_and_stage_throughputs(tmp_path):
    """The scheduler profiles and plans the click model into two stages (embeddings on cpu workers, the MLP on
    the accel worker), the stages train it over hmp to well above chance, and the report shows the plan, the
    predicted and measured throughput of each stage, the cost and the provenance of each type."""
    cfg = pipeline_config(tmp_path)
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=90)
    assert report["final"]["test_accuracy"] >= 0.68, report["final"]
    pipe = report["pipeline"]
    assert len(pipe["profile"]) == 6
    assert pipe["plans"][0]["layers"]["0:FieldEmbedding"] == "cpu"
    assert pipe["plans"][0]["layers"]["5:Linear"] == "accel"
    # On a busy 2-core machine a worker may miss heartbeats and be re-planned around, then back: the plan that
    # ran last is the same two-stage plan.
    plan = pipe["plans"][-1]
    assert plan["layers"] == pipe["plans"][0]["layers"]
    assert [s["workers"] for s in plan["stages"]] == [["cpu0", "cpu1"], ["accel0"]]
    assert plan["stages"][0]["provenance"] == "measured"
    assert plan["stages"][1]["provenance"].startswith(NOT_MEASURED)  # the label reports print for scaled types
    assert plan["cost"] > 0 and plan["predicted_throughput"] > 0
    for s, m in zip(plan["stages"], plan["measured"]):
        assert s["predicted_samples_per_s"] > 0 and m["samples_per_s"] > 0 and m["compute_samples_per_s"] > 0
    w = report["workers"]
    assert w["cpu0"]["samples"] > 0 and w["cpu1"]["samples"] > 0
    assert w["accel0"]["samples"] == pytest.approx(w["cpu0"]["samples"] + w["cpu1"]["samples"], rel=0.1)
    assert report["final"]["stop_reason"].startswith("epochs done")


async def _wait_for(cluster, pred, timeout_s=30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        st = await cluster.status()
        if st and pred(st):
            return st
        await asyncio.sleep(0.2)
    raise AssertionError(f"condition not met within {timeout_s} s; status: {st}")


async def test_replans_when_a_worker_joins_late_and_when_one_leaves(tmp_path):
    """cpu1 is held back (SIGSTOP) so the first plan runs without it; when it joins the loop re-plans with it in
    the embedding stage; when accel0 leaves (SIGTERM) the loop re-plans onto the cpu workers alone, training goes
    on from the step it had reached, and the job finishes with every plan in the report."""
    # The re-plans below are over ~8 s after training starts (max_seconds counts from there); the job then
    # ends at max_seconds. (Not finish() right after them: the shards' accuracy swings between ~0.55 and ~0.72
    # within a second in plans 2-3, an open problem described in docs/pipeline.md.)
    cfg = pipeline_config(tmp_path, epochs=200, max_seconds=15.0, join_wait_s=1.0)
    async with LocalCluster(cfg) as cluster:
        cluster.kill("cpu1", signal.SIGSTOP)
        try:
            st = await _wait_for(cluster, lambda s: s.get("pipeline", {}).get("max_step", 0) > 3)
            assert st["pipeline"]["plan"] == 1
            assert [s["workers"] for s in st["pipeline"]["stages"]] == [["cpu0"], ["accel0"]]
        finally:
            cluster.kill("cpu1", signal.SIGCONT)
        st = await _wait_for(cluster, lambda s: s["pipeline"]["plan"] >= 2)
        assert [s["workers"] for s in st["pipeline"]["stages"]] == [["cpu0", "cpu1"], ["accel0"]]
        step = (await _wait_for(cluster, lambda s: s["pipeline"]["max_step"] > st["pipeline"]["max_step"] + 3))
        cluster.kill("accel0", signal.SIGTERM)
        st = await _wait_for(cluster, lambda s: s["pipeline"]["plan"] >= 3)
        assert [s["resource"] for s in st["pipeline"]["stages"]] == ["cpu"]
        await _wait_for(cluster, lambda s: s["pipeline"]["max_step"] > step["pipeline"]["max_step"] + 5)
        report = await cluster.train(timeout_s=60)
    plans = report["pipeline"]["plans"]
    assert report["pipeline"]["replans"] == 2 and [p["plan"] for p in plans] == [1, 2, 3]
    assert plans[1]["workers_available"] == {"cpu": 2, "accel": 1}
    assert plans[2]["workers_available"] == {"cpu": 2, "accel": 0}
    assert set(plans[2]["layers"].values()) == {"cpu"}
    assert plans[2]["start_step"] >= plans[1]["start_step"] > 0
    assert all(m["samples_per_s"] > 0 for p in plans for m in p["measured"])
    assert report["final"]["test_accuracy"] >= 0.68
    assert all(p.returncode == 0 for p in cluster.procs.values())
