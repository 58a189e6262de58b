"""The runtime model and its calibration (hmp.placement.calibration): the documented formulas by hand,
CPU sharing, and fits that recover known costs from measurements the model itself generates."""

from __future__ import annotations

import pytest

from hmp.placement.calibration import (StageLoad)
from hmp.placement.problem import NOT_MEASURED
from tests.support import pipeline_config

pytestmark = pytest.mark.timeout(60)

MS = 1e-3
TWO_STAGES = [StageLoad("cpu", 1 * MS, workers=2, param_bytes=1e6), StageLoad("accel", 3 * MS, workers=1, param_bytes=2e5)]


@pytest.mark.timeout(120)
async def test_a_pipeline_job_reports_its_calibrated_prediction(tmp_path):
    """A real click pipeline job (tests/test_pipeline.py's config): once its workers have reported a few steps
    the loop calibrates the runtime model on them; the plan's entry keeps both predictions, the fitted costs
    and the measurements, and the scaled accel type gets a compute scale from its real worker."""
    from hmp.cluster import LocalCluster

    # 6 epochs of 4000 samples at batch 512: ~45 steps, past the calibration minimum (8 steps, 1 s)
    async with LocalCluster(pipeline_config(tmp_path, epochs=6, samples=4000)) as cluster:
        report = await cluster.train(timeout_s=90)
    pipe = report["pipeline"]
    assert all(set(lay["micro_batch_ms"]) == {"cpu", "accel"} for lay in pipe["profile"])
    assert pipe["calibrate"] == "predict"
    # (a worker that misses heartbeats on the loaded machine causes a re-plan: some plan ran long enough)
    plan = next(p for p in pipe["plans"] if "calibration" in p)
    cal = plan["calibration"]
    assert plan["predicted_throughput"] == plan["predicted_samples_per_s"] == cal["predicted"]["samples_per_s"]
    assert plan["predicted_before_calibration"] == plan["runtime_model"]["samples_per_s"] > 0
    assert plan["cost_model_throughput"] > 0 and plan["planned_throughput"] > 0
    assert set(cal["costs"]["compute_scale"]) == {s["resource"] for s in plan["stages"]}
    assert cal["costs"]["source"].startswith("calibrated on") and cal["at_s"] > 0
    assert len(cal["measured"]) == len(plan["stages"]) and all(m["busy_ms"] > 0 for m in cal["measured"])
    assert all(s["predicted_samples_per_s"] == plan["predicted_throughput"] for s in plan["stages"])
    assert pipe["runtime_costs"]["source"].startswith("calibrated on")
    # the scaled type stays labelled as such (calibrate = "predict" changes no plan's problem)
    assert all(s["provenance"].startswith(NOT_MEASURED) for s in plan["stages"] if s["resource"] == "accel")
