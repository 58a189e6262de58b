"""Exported models and reports: the pure parts (stop reasons, the report's schema)."""

from __future__ import annotations

import json

from hmp.train.stop_rule import TargetConfirmation, target_reason
from tests.support import REPORT_SCHEMA, ROOT, schema_errors


def schema_keys(schema: dict) -> set[str]:
    """Every property name the schema defines, at any depth."""
    keys = set(schema.get("properties", {}))
    for sub in [*schema.get("properties", {}).values(), *schema.get("patternProperties", {}).values()]:
        keys |= schema_keys(sub)
    for k in ("items", "additionalProperties"):
        if isinstance(schema.get(k), dict):
            keys |= schema_keys(schema[k])
    return keys


def test_every_key_of_the_schema_is_documented() -> None:
    """docs/report.md names every key docs/report.schema.json defines (in code spans: `key` or `{a, key}`), and
    both say version 1."""
    import re

    text = (ROOT / "docs" / "report.md").read_text()
    named = {w for span in re.findall(r"`([^`]+)`", text) for w in re.findall(r"[A-Za-z_<>0-9]+", span)}
    missing = sorted(k for k in schema_keys(REPORT_SCHEMA) if k not in named)
    assert not missing, f"keys of docs/report.schema.json not described in docs/report.md: {missing}"
    assert REPORT_SCHEMA["properties"]["schema_version"]["enum"] == [1] and "schema version 1" in text


def test_the_schema_check_finds_what_is_wrong() -> None:
    """The hand check fails where it should (a test that cannot fail proves nothing)."""
    good = {"schema_version": 1, "job": "j", "config": "c.toml", "consistency": "async", "policy": "static",
            "final": {"elapsed_s": 1.0, "stop_reason": "epochs done", "best_reported_accuracy": 0.5,
                      "test_accuracy": 0.5, "member0_accuracy": 0.4, "parameters": "end", "model": None},
            "sharding": {}, "pipeline": {}, "rings": [], "membership": [], "work_redone": 0, "shard_restarts": [],
            "workers": {}, "series": {"cpu0": [{"t": 0.3, "loss": float("nan"), "lr": 0.1}]}}
    assert schema_errors(good, REPORT_SCHEMA) == []
    bad = json.loads(json.dumps(good))
    bad["final"]["parameters"] = "latest"
    bad["series"]["cpu0"][0]["note"] = "text"
    bad["surprise"] = 1
    del bad["workers"]
    errors = schema_errors(bad, REPORT_SCHEMA)
    assert any("final.parameters: 'latest' not one of" in e for e in errors)
    assert any("series.cpu0[0].note: str" in e for e in errors)
    assert any("'surprise' is not in the schema" in e for e in errors)
    assert any("lacks 'workers'" in e for e in errors)


def test_target_rules_and_confirmation_gate() -> None:
    """The stop reason when metrics meet a target; one confirmation at a time, the next one eval_every_s
    after a rejection (a worker repeats its last evaluation in every report), rejections recorded."""
    class Train:
        target_accuracy, target_loss = 0.9, 0.0

    assert target_reason({"test_accuracy": 0.95}, Train) == "target accuracy 0.9 reached (0.9500)"
    assert target_reason({"test_accuracy": 0.85, "test_loss": 0.01}, Train) == ""
    Train.target_loss = 0.1
    assert target_reason({"test_accuracy": 0.85, "test_loss": 0.01}, Train) == "target test loss 0.1 reached (0.0100)"
    assert target_reason({}, Train) == "" and target_reason({"error": "x"}, Train) == ""
    gate = TargetConfirmation(retry_after_s=1.0)
    assert gate.offer(10.0) and not gate.offer(10.1)  # one in flight
    assert gate.judged("cand", {"test_accuracy": 0.5, "test_loss": 0.5}, Train, now=10.2, t=3.0) == ""
    assert not gate.offer(11.1) and gate.offer(11.3)
    assert gate.judged("cand", {"test_accuracy": 0.95}, Train, now=11.4, t=4.0).startswith("target accuracy")
    assert gate.rejections == 1 and gate.rejected == [{"t": 3.0, "candidate": "cand", "test_accuracy": 0.5,
                                                       "test_loss": 0.5}]
