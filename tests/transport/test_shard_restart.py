"""Shard restarts with nodes in one process."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tests.support import client_of, running, shard_grads, shard_job_config


# ----------------------------------------------------------------------------- a shard daemon, in this process
@pytest.mark.parametrize("consistency", ["sync", "ssp"])
async def test_a_retry_of_a_push_still_waiting_in_the_shard_is_applied_once(tmp_path, consistency):
    """A worker abandons a push that waits for its sync round or the SSP bound (a shard went down) and
    sends it again with the same seq: the retry is answered with the original's result, applied once."""
    from hmp.config import load
    from hmp.messages import Push
    from hmp.nodes.ps_shard import PSShardNode

    node = PSShardNode(load(shard_job_config(tmp_path, consistency=consistency, extra_train="staleness = 0")), "ps0")
    keys, grads = shard_grads(node)
    async with running(node), client_of(node, "cpu0") as cpu, client_of(node, "cpu0") as cpu_again, client_of(node, "gpu0") as gpu:
        if consistency == "ssp":  # cpu0 one update ahead: its next push waits for gpu0's
            await cpu.request(Push(keys=keys, grads=grads, seq=4))
        first = asyncio.create_task(cpu.request(Push(keys=keys, grads=grads, seq=5)))
        await asyncio.sleep(0.2)
        retry = asyncio.create_task(cpu_again.request(Push(keys=keys, grads=grads, seq=5)))
        await asyncio.sleep(0.2)
        assert not first.done() and not retry.done()
        await gpu.request(Push(keys=keys, grads=grads, seq=100))
        a, b = await asyncio.wait_for(asyncio.gather(first, retry), 5)
        expected = 1 if consistency == "sync" else 3  # sync: one round of both; ssp: cpu0 twice and gpu0 once
        assert node.core.version == expected and a.version == b.version
        assert node.core.last_seq["cpu0"] == 5 and node.stats["duplicates"] == 1
        assert all(torch.equal(x, y) for x, y in zip(a.values, b.values))
