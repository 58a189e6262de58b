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
from hmp.nodes.scheduler import SchedulerNode

from tests.support import Daemons, check_sections, write_config


async def test_a_resumed_job_trains_only_the_remaining_epochs_and_appends_to_its_report(tmp_path):
    path = write_config(tmp_path, consistency="async", target=0.0, epochs=2, policy="hogbatch")
    path.write_text(path.read_text() + "\n[shm]\nenabled = false\n")
    n_train = len(job.dataset(load(path)).y_train)

    async def part(resume: bool, logs) -> dict:
        cfg = load(path)
        scheduler = SchedulerNode(cfg, "scheduler", resume=resume)
        with Daemons(path, logs) as d:
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
