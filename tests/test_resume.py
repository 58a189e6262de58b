"""``--resume`` continues a job: the scheduler's epochs, work cursor, the workers' counters and the report
(issue 13: "--resume continues step and epoch counters and appends to the report").

The core first (no sockets): its saved state round-trips through JSON and a resumed core hands out the
next examples, not the first ones, with its report's clock running on. Then a whole job on loopback run
in two parts: two epochs, then, resumed with the epochs raised to four, only the two remaining ones.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from hmp import job
from hmp.config import load
from hmp.errors import ConfigError
from hmp.nodes.scheduler import SchedulerNode
from hmp.scheduler.core import SchedulerCore

from .cluster_util import write_config
from .test_replication import check_sections
from .test_scheduler_core import _cfg, _running
from .test_shard_restart import _Daemons


def test_a_resumed_core_goes_on_from_the_saved_cursor_counters_and_report():
    core = _running(tolerate=True, epochs=3, n_train=100)
    assert (core.work("cpu0", 60, 1.0).start, core.work("gpu0", 60, 1.0).count) == (0, 40)  # epoch 0 used up
    core.work("cpu0", 30, 2.0)  # epoch 1, [0, 30): held by cpu0 when the scheduler stops
    core.work("gpu0", 10, 2.0)  # epoch 1, [30, 40): held by gpu0
    core.report("cpu0", {"samples": 130.0, "updates": 9.0, "epoch": 1.0, "test_accuracy": 0.5}, False, 2.5)
    state = json.loads(json.dumps(core.state_dict(3.0)))  # what scheduler.json holds
    resumed = SchedulerCore(_cfg(epochs=3), n_train=100, tolerate_worker_loss=True)
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
        SchedulerCore(_cfg(), n_train=100).resume({**state, "format": 7}, "x")


async def test_a_resumed_job_trains_only_the_remaining_epochs_and_appends_to_its_report(tmp_path):
    path = write_config(tmp_path, consistency="async", target=0.0, epochs=2, policy="hogbatch")
    path.write_text(path.read_text() + "\n[shm]\nenabled = false\n")
    n_train = len(job.dataset(load(path)).y_train)

    async def part(resume: bool, logs) -> dict:
        cfg = load(path)
        scheduler = SchedulerNode(cfg, "scheduler", resume=resume)
        with _Daemons(path, logs) as d:
            for s in ("ps0", "ps1"):
                d.start("ps", s, *(["--resume"] if resume else []))
            d.start("cpu_worker", "cpu0")
            d.start("gpu_worker", "gpu0")
            task = asyncio.create_task(scheduler.run())
            try:
                rc = await asyncio.wait_for(asyncio.shield(task), 90)
            finally:
                scheduler.stopping.set()
                await asyncio.wait_for(task, 15)
            assert rc == 0 and not scheduler.failed
            for n in ("ps0", "ps1", "cpu0", "gpu0"):
                assert await asyncio.to_thread(d.procs[n].wait, 20) == 0, d.log(n)[-2000:]
        return json.loads((tmp_path / "run" / "report.json").read_text())

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = await part(False, tmp_path / "one")
    assert first["final"]["stop_reason"] == "epochs done" and first["resumed"] == []
    assert (tmp_path / "ckpt" / "scheduler.json").exists()
    first_t = first["final"]["elapsed_s"]
    # The same job with four epochs, resumed: the shards from their checkpoints, the scheduler from its state.
    path.write_text(path.read_text().replace("epochs = 2", "epochs = 4"))
    second = await part(True, tmp_path / "two")
    (resume,) = second["resumed"]
    assert (resume["epoch"], resume["cursor"]) in ((1, n_train), (2, 0)) and resume["elapsed_s"] == pytest.approx(first_t, abs=0.5)
    assert second["final"]["stop_reason"] == "epochs done"
    for w in ("cpu0", "gpu0"):
        series = second["series"][w]
        before = [p for p in series if p["t"] <= resume["elapsed_s"]]
        after = [p for p in series if p["t"] > resume["elapsed_s"]]
        assert before == first["series"][w]  # the first part's points, kept
        assert after and all(p["epoch"] >= 2 for p in after), [p["epoch"] for p in after]  # epochs 0-1 not again
        assert all(a["samples"] <= b["samples"] for a, b in zip(series, series[1:]))  # counters go on
    check_sections(second, ("resumed", "final", "series"))
    # Every example of the four epochs trained exactly once over the two parts.
    assert sum(second["workers"][w]["samples"] for w in ("cpu0", "gpu0")) == 4 * n_train


def test_an_unreadable_scheduler_state_is_a_config_error_naming_it(tmp_path):
    cfg = load(write_config(tmp_path))
    state = job.checkpoint_dir(cfg) / "scheduler.json"
    state.parent.mkdir(parents=True)
    state.write_text("{ not json")
    with pytest.raises(ConfigError) as err:
        SchedulerNode(cfg, "scheduler", resume=True)
    assert str(state) in str(err.value) and "--resume" in str(err.value)
    state.unlink()
    assert SchedulerNode(cfg, "scheduler", resume=True).core.time_offset == 0.0  # none saved: from zero
