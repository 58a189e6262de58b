"""A user worker (docs/own_loop.md) whose job's scheduler never answers: joining gives up within
``join_timeout_s`` with a clear error, and the worker's thread ends."""

from __future__ import annotations

import re
import time

import pytest

import hmp

from tests.support import digits_job_text, free_port, nodes_toml


@pytest.mark.timeout(60)
def test_joining_a_job_nobody_runs_fails_in_bounded_time(tmp_path):
    text = re.sub(r"(?m)^join_timeout_s = .*$", "join_timeout_s = 2", digits_job_text(tmp_path, name="own"))
    path = tmp_path / "job.toml"
    path.write_text(text + nodes_toml(("scheduler", "scheduler", f'bind = "tcp://127.0.0.1:{free_port()}"'),
                                      ("ps0", "ps"), ("mine", "user_worker")))
    worker = hmp.SyncWorker(path, "mine")
    t0 = time.monotonic()
    with pytest.raises(hmp.HmpError, match="mine was not admitted to the job: .*RequestTimeout"):
        worker.start()
    assert time.monotonic() - t0 < 2 + 15  # the join timeout, plus building the model and a retry's wait
    assert not worker.running
    assert worker.failed and "RequestTimeout" in worker.failed
    worker.close()  # nothing left to close: returns at once
    assert "node_failed" in open(worker.log_path).read()
