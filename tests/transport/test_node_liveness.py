"""Liveness between nodes in one process."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from hmp.job import load
from hmp.nodes.base import Node
from tests.support import write_config


class _Probe(Node):
    """A node whose main() spawns the given background tasks and then waits to be stopped."""

    def __init__(self, cfg, tasks):
        super().__init__(cfg, "cpu0")
        self.tasks, self.cancelled, self.cleaned_up = tasks, [], False

    async def main(self) -> None:
        for name, coro in self.tasks(self):
            self.spawn(coro, name=name)
        try:
            await asyncio.sleep(3600)
        finally:
            self.cleaned_up = True


async def _sleeper(node: _Probe, name: str) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        node.cancelled.append(name)
        raise


async def test_a_background_task_that_raises_fails_the_node_at_once(tmp_path):
    """spawn(): a task that raises logs its traceback, cancels main() and the other tasks, closes the server and exits 1."""
    async def report_loop():
        await asyncio.sleep(0.05)
        raise ValueError("evaluation exploded")

    cfg = load(write_config(tmp_path))
    with capture_logs() as logs:
        node = _Probe(cfg, lambda n: [("sleeper", _sleeper(n, "sleeper")), ("reports", report_loop())])
        t0 = time.monotonic()
        code = await asyncio.wait_for(node.run(), 20)
    assert code == 1 and time.monotonic() - t0 < 5
    assert node.cleaned_up and node.cancelled == ["sleeper"] and node.server._chan is None
    assert "reports: ValueError: evaluation exploded" == node.failed
    failed = [e for e in logs if e["event"] == "task_failed"]
    assert failed and failed[0]["task"] == "reports" and isinstance(failed[0]["exc_info"], ValueError)


async def test_fail_from_a_background_task_cancels_main_and_tasks_end_with_main(tmp_path):
    """fail() from another task (a heartbeat loop that lost the scheduler) cancels main() now; a clean return
    cancels what is still running; spawn() outside a running node refuses."""
    async def lose_scheduler(node):
        await asyncio.sleep(0.05)
        node.fail("scheduler lost: test")

    cfg = load(write_config(tmp_path))
    node = _Probe(cfg, lambda n: [("sleeper", _sleeper(n, "sleeper")), ("heartbeat", lose_scheduler(n))])
    assert await asyncio.wait_for(node.run(), 20) == 1
    assert node.cleaned_up and node.cancelled == ["sleeper"] and node.failed == "scheduler lost: test"

    class Quick(_Probe):
        async def main(self):
            self.spawn(_sleeper(self, "left over"), name="left over")
            await asyncio.sleep(0.01)

    quick = Quick(cfg, lambda n: [])
    assert await asyncio.wait_for(quick.run(), 20) == 0
    assert quick.cancelled == ["left over"]

    async def nothing():
        pass

    with pytest.raises(RuntimeError, match="not running"):
        quick.spawn(nothing(), name="late")
