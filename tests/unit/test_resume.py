"""Resuming a job: the pure checks."""

from __future__ import annotations

import json

import pytest

from hmp.scheduler.core import SchedulerCore
from tests.support import running_scheduler, scheduler_config


def test_a_resumed_core_goes_on_from_the_saved_cursor_counters_and_report():
    core = running_scheduler(tolerate=True, epochs=3, n_train=100)
    assert (core.work("cpu0", 60, 1.0).start, core.work("gpu0", 60, 1.0).count) == (0, 40)  # epoch 0 used up
    core.work("cpu0", 30, 2.0)  # epoch 1, [0, 30): held by cpu0 when the scheduler stops
    core.work("gpu0", 10, 2.0)  # epoch 1, [30, 40): held by gpu0
    core.report("cpu0", {"samples": 130.0, "updates": 9.0, "epoch": 1.0, "test_accuracy": 0.5}, False, 2.5)
    state = json.loads(json.dumps(core.state_dict(3.0)))  # what scheduler.json holds
    resumed = SchedulerCore(scheduler_config(epochs=3), n_train=100, tolerate_worker_loss=True)
    resumed.resume(state, "ckpt/scheduler.json")
    assert resumed.time_offset == pytest.approx(3.0) and resumed.best_accuracy == 0.5
    assert resumed.resumed_progress["cpu0"] == {"samples": 130.0, "updates": 9.0, "epoch": 1.0}
    (entry,) = resumed.run_report.resumes
    assert entry["from"] == "ckpt/scheduler.json" and (entry["epoch"], entry["cursor"], entry["elapsed_s"]) == (1, 40, 3.0)
    resumed.start(10.0)
    for s in ("ps0", "ps1"):
        resumed.join(s, "ps", f"tcp://{s}", 1, 10.0)
    welcome = resumed.join("cpu0", "cpu_worker", "tcp://cpu0", 2, 10.0)
    assert welcome.info.resume["updates"] == 9.0 and welcome.info.start_epoch == 1
    resumed.join("gpu0", "gpu_worker", "tcp://gpu0", 2, 10.0)
    # The ranges held are handed out again first, then the cursor goes on: epoch 0 is not trained again.
    given = [resumed.work("gpu0", 50, 11.0) for _ in range(3)]
    assert [(w.epoch, w.start, w.count) for w in given] == [(1, 0, 30), (1, 30, 10), (1, 40, 50)]
    resumed.report("cpu0", {"samples": 140.0}, False, 12.0)
    points = resumed.run_report.workers["cpu0"]["series"]
    assert [p["t"] for p in points] == [2.5, 5.0]  # the report's clock runs on from the first part's 3 s
    with pytest.raises(ValueError, match="format"):
        SchedulerCore(scheduler_config(), n_train=100).resume({**state, "format": 7}, "x")
