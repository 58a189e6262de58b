"""The model a job hands back (hmp.export): model.pt + model.json written and loaded on a real model, its
errors, and real short jobs whose model.pt reproduces the report's final evaluation exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hmp import job
from hmp.cluster import LocalCluster
from hmp.export import MODEL_FILE, PARAMETERS, load_model, model_info
from hmp.ps.schedule import lr_at
from hmp.train.evaluate import evaluate

from tests.support import digits_job_text, free_port, write_config

DOCS = Path(__file__).resolve().parents[2] / "docs"
SCHEMA = json.loads((DOCS / "report.schema.json").read_text())
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value, schema: dict, where: str = "report") -> list[str]:
    """What of ``value`` breaks ``schema``: the JSON Schema subset docs/report.schema.json uses (type, enum,
    required, properties, patternProperties, additionalProperties, items), by hand (no jsonschema here)."""
    import re

    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types

        def fits(t: str) -> bool:
            if t == "integer":
                return isinstance(value, int) and not isinstance(value, bool) or (
                    isinstance(value, float) and value.is_integer())
            if t == "number":
                return isinstance(value, (int, float)) and not isinstance(value, bool)
            return isinstance(value, _TYPES[t])

        if not any(fits(t) for t in types):
            return [f"{where}: {type(value).__name__} {value!r:.60}, expected {types}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not one of {schema['enum']}")
    if isinstance(value, dict):
        errors += [f"{where}: lacks {k!r}" for k in schema.get("required", ()) if k not in value]
        props, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            sub = props.get(k) or next((p for pat, p in patterns.items() if re.search(pat, k)), None)
            if sub is None:
                if extra is False:
                    errors.append(f"{where}: key {k!r} is not in the schema (document it: docs/report.md)")
                    continue
                sub = extra if isinstance(extra, dict) else {}
            errors += schema_errors(v, sub, f"{where}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errors += schema_errors(v, schema["items"], f"{where}[{i}]")
    return errors


USER_MODELS = """
import torch
from torch import nn


class TwoTower(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.left, self.right = nn.Linear(64, width), nn.Linear(64, width)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.head(torch.cat([self.left(x).relu(), self.right(x).tanh()], 1))


def make(width=8):
    return TwoTower(width)
"""


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


@pytest.mark.cluster
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
    assert schema_errors(report, SCHEMA) == []  # the report's keys are documented (docs/report.md)
    assert schema_errors(json.loads((run / "report.json").read_text()), SCHEMA) == []
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
