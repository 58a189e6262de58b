"""A worker's stop, against real endpoints."""

from __future__ import annotations

import asyncio

from hmp.client import PSClient
from hmp.job import load, sharded_model
from hmp.messages import Kind
from hmp.nodes.worker import WorkerNode
from hmp.transport.endpoint import Server

from tests.support import write_config


async def test_shutting_down_answer_to_an_async_push_is_a_stop_not_a_failure(tmp_path, tcp_address):
    """A shard that shuts down before answering an async push answers `shutting_down`: the worker stops, not fails."""
    cfg = load(write_config(tmp_path))
    node = WorkerNode(cfg, "cpu0")
    arrived = asyncio.Event()

    async def on_push(msg, peer):  # a shard busy with the push when its shutdown comes
        arrived.set()
        await asyncio.sleep(3600)

    shards = [Server(tcp_address, {Kind.PUSH: on_push}, name=s.id) for s in cfg.shards]
    for s in shards:
        await s.start()
    ps = PSClient(sharded_model(cfg), [(s.name, s.address) for s in shards], name="cpu0", cfg=cfg, timeout_s=30)
    try:
        await ps.connect()
        push = asyncio.create_task(node.push_unless_stopped(ps, 16))
        await asyncio.wait_for(arrived.wait(), 10)
        await asyncio.gather(*(s.close(grace_s=0.1) for s in shards))  # cancels the handler: shutting_down
        assert await asyncio.wait_for(push, 10) is False
        assert node.stop_requested and not node.failed
    finally:
        await ps.close()
        for s in shards:
            await s.close(grace_s=0)
