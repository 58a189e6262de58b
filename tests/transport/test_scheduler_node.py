"""The scheduler shell over real endpoints: its handlers behind a Server, nodes talking to it through Clients.

The rules themselves are the core's (tests/test_scheduler_core.py); these check that the shell turns
the core's decisions into the right replies and error codes, and that a held join waits in the shell.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from hmp.errors import RemoteError
from hmp.job import load
from hmp.messages import Heartbeat, Join, Report, Welcome, Work
from hmp.nodes.scheduler import SchedulerNode
from hmp.transport.endpoint import Client, Server

from tests.support import write_config


@contextlib.asynccontextmanager
async def _scheduler(tmp_path):
    """A scheduler node's handlers served on a loopback port (no monitor: no clock runs out), and a
    function that opens a client speaking as a given node id."""
    node = SchedulerNode(load(write_config(tmp_path)), "scheduler")
    server = Server("tcp://127.0.0.1:0", node.handlers(), name="scheduler")
    await server.start()
    clients: list[Client] = []

    async def as_node(node_id: str) -> Client:
        c = Client(server.address, name=node_id, timeout_s=10)
        await c.connect()
        clients.append(c)
        return c

    try:
        yield node, as_node
    finally:
        for c in clients:
            await c.close()
        await server.close(grace_s=0.5)


async def test_scheduler_refuses_reports_and_work_requests_from_non_workers(tmp_path):
    """A shard (any non-worker) cannot report progress or take work units (bad_role); a stranger gets unknown_node."""
    async with _scheduler(tmp_path) as (node, as_node):
        ps0 = await as_node("ps0")
        for msg in (Report(metrics={"samples": 5.0}, done=True), Work(count=16)):
            with pytest.raises(RemoteError) as info:
                await ps0.request(msg)
            assert info.value.code == "bad_role"
        with pytest.raises(RemoteError) as info:
            await (await as_node("intruder")).request(Heartbeat(step=0))
        assert info.value.code == "unknown_node"
        assert "ps0" not in node.core.run_report.workers


async def test_only_the_newest_held_join_of_a_worker_is_answered(tmp_path):
    """A worker re-sends its join while the shards are not ready; when they have joined, only the
    newest join is welcomed, the older one is refused."""
    async with _scheduler(tmp_path) as (node, as_node):
        cpu0 = await as_node("cpu0")
        join = Join(role="cpu_worker", address="tcp://cpu0", pid=1)
        first = asyncio.ensure_future(cpu0.request(join))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(cpu0.request(join))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()  # held
        for shard in ("ps0", "ps1"):
            reply = await (await as_node(shard)).request(Join(role="ps", address=f"tcp://{shard}", pid=2))
            assert isinstance(reply, Welcome)
        with pytest.raises(RemoteError) as info:
            await first
        assert info.value.code == "bad_request"
        welcome = await second
        assert isinstance(welcome, Welcome)
        assert welcome.info.shards == (("ps0", "tcp://ps0"), ("ps1", "tcp://ps1"))
        assert welcome.info.worker_index == 0
        assert node.status()["members"]["cpu0"] == "live"
