"""A worker that cannot start tells the scheduler before it ever joins (``failed: ...``): the scheduler core
judges at once, counting the workers not joined yet as still due, instead of waiting out join_timeout_s."""

from __future__ import annotations

from hmp.scheduler.membership import MemberState as S

from tests.support import scheduler_core


def test_a_worker_that_fails_before_joining_is_dropped_while_min_workers_remain():
    core = scheduler_core(tolerate=True, min_workers=1, join_timeout_s=60.0)
    core.leave("gpu0", "failed: cannot start: CUDA is not available on this machine", 0.5)
    assert core.failed is None  # cpu0 has not joined yet, but is still due
    assert core.membership["gpu0"].state == S.LEFT
    assert [(e["node"], e["event"]) for e in core.run_report.membership] == [("gpu0", "failed")]


def test_a_worker_that_fails_before_joining_fails_the_job_at_once_below_min_workers():
    core = scheduler_core(tolerate=True, min_workers=2, join_timeout_s=60.0)
    core.leave("gpu0", "failed: cannot start: CUDA is not available on this machine", 0.5)
    assert core.failed is not None and "min_workers = 2" in core.failed and "gpu0" in core.failed
