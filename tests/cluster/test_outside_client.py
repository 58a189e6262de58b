"""A client outside the topology finds the shards through the scheduler's ``discover`` answer and uses the PS
with bare messages only (docs/protocol.md, "Taking part from outside the topology"): no hmp model code."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from hmp.cluster import LocalCluster
from hmp.errors import RemoteError
from hmp.messages import Discover, Params, Pull, Push, Status
from hmp.transport.endpoint import Client

from tests.support import write_config



@pytest.mark.timeout(120)
async def test_discovery_then_pull_and_push_by_chunk_key(tmp_path):
    cfg_path = write_config(tmp_path, target=0.0, epochs=200, max_seconds=60)
    async with LocalCluster(cfg_path) as cluster:
        sched = cluster.cfg.scheduler
        async with Client(sched.bind, name="monitor", timeout_s=10, job_token=cluster.job_token) as c:
            for _ in range(200):  # until every shard has joined
                ps = (await c.request(Discover())).ps
                if ps.get("shards"):
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the scheduler's discover answer never listed the shards")
            # status stays for the topology and the launcher: an outsider with the token is refused
            with pytest.raises(RemoteError, match="unauthorized"):
                await c.request(Status())
        chunks = {key: (dtype, start, numel) for key, dtype, start, numel in ps["chunks"]}
        # The parameters tile the flat buffer exactly, and so do the chunks; every chunk has one owner.
        total = sum(numel for _, _, _, numel, _ in ps["parameters"])
        assert total == sum(n for _, _, n in chunks.values())
        assert all(math.prod(shape) == numel for _, _, _, numel, shape in ps["parameters"])
        owned = sorted(k for keys in ps["assignment"].values() for k in keys)
        assert owned == sorted(chunks)
        assert [sid for sid, _ in ps["shards"]] == ["ps0", "ps1"]

        shard_id, address = ps["shards"][0]
        keys = tuple(ps["assignment"]["0"])
        async with Client(address, name="outsider", timeout_s=10, job_token=cluster.job_token) as c:
            before = await c.request(Pull(keys=keys))
            assert isinstance(before, Params) and before.keys == keys
            for k, v in zip(keys, before.values):
                dtype, _, numel = chunks[k]
                assert str(v.dtype) == f"torch.{dtype}" and v.numel() == numel
            # A zero gradient is still an update: the shard's version moves.
            grads = tuple(torch.zeros(chunks[k][2], dtype=torch.float32) for k in keys)
            after = await c.request(Push(keys=keys, grads=grads, samples=0))
            assert isinstance(after, Params) and after.version > before.version
        await cluster.finish("test done")
        report = await cluster.train(timeout_s=60)
    assert "test_accuracy" in report["final"]
