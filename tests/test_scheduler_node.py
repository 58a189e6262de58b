"""The scheduler's role and join checks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hmp.errors import RemoteError, RequestError
from hmp.job import load
from hmp.messages import Join, Pull, Push, Report, Welcome, Work
from hmp.nodes.scheduler import SchedulerNode

from .cluster_util import write_config


async def test_scheduler_refuses_reports_and_work_requests_from_non_workers(tmp_path):
    """A shard's id (or any non-worker) cannot report progress or take work units."""
    node = SchedulerNode(load(write_config(tmp_path)), "scheduler")
    for msg in (Report(sender="ps0", metrics={"samples": 5.0}, done=True), Work(sender="ps0", count=16)):
        handler = node.on_report if isinstance(msg, Report) else node.on_work
        with pytest.raises(RequestError) as info:
            await handler(msg, b"peer")
        assert info.value.code == "bad_role"
    assert "ps0" not in node.report.workers


async def test_only_the_newest_held_join_of_a_worker_is_answered(tmp_path):
    """A worker re-sends its join while the shards are not ready; when they are, only the newest
    join is admitted (once), the older one is refused."""
    node = SchedulerNode(load(write_config(tmp_path)), "scheduler")
    first = asyncio.ensure_future(node.on_join(Join(sender="cpu0", role="cpu_worker", address="a", pid=1), b"p"))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(node.on_join(Join(sender="cpu0", role="cpu_worker", address="a", pid=1), b"p"))
    await asyncio.sleep(0.01)
    for shard in ("ps0", "ps1"):
        node.members[shard].address, node.members[shard].state = f"tcp://{shard}", "joined"
    node.shards_ready.set()
    with pytest.raises(RequestError):
        await first
    assert isinstance(await second, Welcome)
