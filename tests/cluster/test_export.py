"""The model a job hands back (hmp.export): model.pt + model.json written and loaded on a real model, its
errors, and real short jobs whose model.pt reproduces the report's final evaluation exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hmp import job
from hmp.cluster import LocalCluster
from hmp.export import MODEL_FILE, PARAMETERS, load_model, model_info
from hmp.ps.lr_schedule import lr_at
from hmp.train.evaluate import evaluate

from tests.support import REPORT_SCHEMA, digits_job_text, free_port, schema_errors, write_config


def ring_config(tmp: Path, target: float) -> Path:
    text = digits_job_text(tmp, name="export-ring", consistency="allreduce", target=target, epochs=40) + f"""
[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"
[[nodes]]
id = "cpu0"
role = "cpu_worker"
batch_size = 32
[[nodes]]
id = "cpu1"
role = "cpu_worker"
batch_size = 32
"""
    path = tmp / "ring.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", ["ps", "allreduce"])
async def test_a_jobs_model_reproduces_its_reports_final_accuracy(tmp_path: Path, kind: str) -> None:
    """A real short job (5 daemons, or a 2-worker ring) stopped by its target: model.pt, loaded with load_model
    and evaluated on the job's test split, gives exactly the report's final test accuracy; that accuracy meets
    the target the job stopped on (the stop and the final evaluation agree), and the report says which
    parameters were exported. The workers' series show the learning rate (a warm-up, then a step schedule)."""
    schedule = 'name = "sgd"\nlr = 0.05\nmomentum = 0.9\nschedule = "step"\nwarmup_steps = 20\nstep_size = 200\ngamma = 0.5'
    target = 0.93
    path = (write_config(tmp_path, target=target, optimizer=schedule) if kind == "ps"
            else ring_config(tmp_path, target))
    if kind == "allreduce":
        path.write_text(path.read_text().replace('name = "sgd"\nlr = 0.05\nmomentum = 0.9', schedule))
    cfg = job.load(path)
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=200)
    final = report["final"]
    run = cfg.report_dir
    assert schema_errors(report, REPORT_SCHEMA) == []  # the report's keys are documented (docs/report.md)
    assert schema_errors(json.loads((run / "report.json").read_text()), REPORT_SCHEMA) == []
    assert (run / MODEL_FILE).exists(), f"no model.pt written; final = {final}"
    assert final["model"] == str(run / MODEL_FILE)
    assert final["parameters"] in PARAMETERS
    assert final["parameters"] == ("ring" if kind == "allreduce" else
                                   "at_stop" if final["stop_reason"].startswith("target") else "end")
    info = model_info(run)
    assert info["parameters"] == final["parameters"] and info["metrics"]["test_accuracy"] == final["test_accuracy"]
    data = job.dataset(cfg)
    again = evaluate(load_model(run), data.x_test, data.y_test)
    assert again["test_accuracy"] == final["test_accuracy"]
    assert again["test_loss"] == pytest.approx(final["test_loss"], rel=1e-5)
    if final["stop_reason"].startswith("target accuracy"):
        assert final["test_accuracy"] >= target, final  # the stop rule's evaluation is the final one
    points = [p for pts in report["series"].values() for p in pts if "lr" in p]
    assert points, "no lr in the workers' series"
    scheduled = {lr_at(s, cfg.optimizer) for s in range(20)} | {0.05 * 0.5**k for k in range(30)}
    assert all(any(p["lr"] == pytest.approx(v, rel=1e-9) for v in scheduled) for p in points)
    if kind == "allreduce":  # the ring's step is its updates: the last update's rate, exactly
        assert all(p["lr"] == lr_at(max(0, int(p["updates"]) - 1), cfg.optimizer) for p in points)
