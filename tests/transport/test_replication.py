"""Shard replication between nodes in one process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from hmp.config import load
from hmp.errors import RemoteError
from hmp.messages import Push, Replicas, Replicate, Status
from hmp.nodes.ps_shard import PSShardNode
from hmp.ps.sharding import initial_replicas
from tests.support import assert_cores_identical, client_of, running, write_config

ADAM = 'name = "adam"\nlr = 0.01'


SGD = 'name = "sgd"\nlr = 0.01'


# ----------------------------------------------------------------------------- shard daemons in this process
def _two_shards(tmp: Path, optimizer: str = ADAM, consistency: str = "async") -> tuple[PSShardNode, PSShardNode]:
    cfg = write_config(tmp, fixed_ps_ports=True, consistency=consistency, optimizer=optimizer)
    cfg.write_text(cfg.read_text().replace("[ps]\n", "[ps]\nreplicas = 2\n") + "\n[shm]\nenabled = false\n")
    c = load(cfg)
    return PSShardNode(c, "ps0"), PSShardNode(c, "ps1")


def _map(node: PSShardNode, groups: dict[str, tuple[str, str]], epoch: int) -> Replicas:
    shards = tuple((s.id, s.bind) for s in node.cfg.shards)
    return Replicas(groups=tuple((g, p, b) for g, (p, b) in groups.items()), shards=shards, epoch=epoch)


async def test_a_push_is_answered_once_the_backup_applied_it_and_a_promoted_backup_applies_a_retry_once(tmp_path):
    ps0, ps1 = _two_shards(tmp_path)
    keys = tuple(sorted(ps0.core.chunks))
    grads = tuple(torch.linspace(-1, 1, ps0.core.chunks[k].param.numel()) for k in keys)
    async with running(ps0), running(ps1), client_of(ps0, "scheduler") as sched0, client_of(ps1, "scheduler") as sched1, \
            client_of(ps0, "cpu0") as cpu, client_of(ps1, "cpu0") as cpu_at_ps1:
        start = _map(ps0, initial_replicas(["ps0", "ps1"]), 1)  # the scheduler's map once every shard joined
        await asyncio.gather(sched0.request(start), sched1.request(start))
        for seq in range(1, 6):
            await cpu.request(Push(keys=keys, grads=grads, samples=4, seq=seq))
            # Answered: the backup applied it before the reply was sent.
            assert_cores_identical(ps0.core, ps1.backups["ps0"])
        assert ps0.stats["forwards_applied"] == 5 and ps1.backups["ps0"].applied_forward == 5
        # ps0 is lost; the scheduler promotes ps1 for group ps0, which now has no backup.
        await sched1.request(_map(ps1, {"ps0": ("ps1", ""), "ps1": ("ps1", "")}, 2))
        assert "ps0" in ps1.cores and ps1.stats["promotions"] == 1
        # The worker's push 5 was in flight when ps0 died: re-sent to ps1 with the same seq, not applied again.
        reply = await cpu_at_ps1.request(Push(keys=keys, grads=grads, samples=4, seq=5))
        assert reply.version == 5 and ps1.cores["ps0"].version == 5 and ps1.stats["duplicates"] == 1
        reply = await cpu_at_ps1.request(Push(keys=keys, grads=grads, samples=4, seq=6))
        assert reply.version == 6  # a new one is applied, unreplicated
        assert torch.equal(reply.values[0], ps1.cores["ps0"].chunks[keys[0]].param)


async def test_forwards_are_applied_once_in_order_and_refused_from_strangers(tmp_path):
    ps0, ps1 = _two_shards(tmp_path, optimizer=SGD)
    keys = tuple(sorted(ps0.core.chunks))
    ones = tuple(torch.ones(ps0.core.chunks[k].param.numel()) for k in keys)
    fwd = lambda fseq, **kw: Replicate(group="ps0", fseq=fseq, keys=keys, grads=ones, worker="cpu0", seq=fseq,  # noqa: E731
                                       samples=1, **kw)
    async with running(ps1), client_of(ps1, "ps0") as primary, client_of(ps1, "cpu0") as stranger, client_of(ps1, "ps1") as itself:
        before = ps1.backups["ps0"].chunks[keys[0]].param.clone()
        await primary.request(fwd(1))
        again = await primary.request(fwd(1))  # the primary retried: acknowledged, not applied twice
        assert "applied already" in again.detail and ps1.backups["ps0"].version == 1
        assert torch.equal(ps1.backups["ps0"].chunks[keys[0]].param, before - 0.01)
        with pytest.raises(RemoteError) as gap:
            await primary.request(fwd(3))
        assert gap.value.code == "out_of_order" and "forward 3 out of order (last applied 1)" in str(gap.value)
        for client, who in ((stranger, "cpu0"), (itself, "ps1")):
            with pytest.raises(RemoteError) as refused:
                await client.request(fwd(2))
            assert refused.value.code == "unauthorized" and "only the group's primary ('ps0')" in str(refused.value)
        with pytest.raises(RemoteError) as bad_op:
            await primary.request(fwd(2, op="delete"))
        assert bad_op.value.code == "bad_request" and "op must be" in str(bad_op.value)
        with pytest.raises(RemoteError) as bad_shape:
            await primary.request(Replicate(group="ps0", fseq=2, keys=keys[:1], grads=(torch.ones(3),)))
        assert bad_shape.value.code == "bad_shape"
        with pytest.raises(RemoteError) as not_scheduler:  # only the scheduler says who serves what
            await stranger.request(_map(ps1, {"ps0": ("cpu0", ""), "ps1": ("ps1", "")}, 5))
        assert not_scheduler.value.code == "unauthorized" and ps1.replica_epoch == 0
        await primary.request(fwd(2))  # the daemon kept serving: the next forward in order is applied
        assert ps1.backups["ps0"].version == 2
        status = await stranger.request(Status())
        assert status.state["backup_of"] == ["ps0"] and status.state["primary_of"] == ["ps1"]
