"""The PS shard shell over real endpoints: its handlers behind a Server, workers talking to it
through Clients. Replies carry copies of the chunks, so they never show a later update; SSP waits
and sync rounds time out; checkpoints are written off the loop from a snapshot; non-finite pushes
are refused.

The rules themselves are the core's (tests/test_shard_core.py, tests/unit/test_shard_push.py).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from hmp.errors import RemoteError, RequestError
from hmp.job import load
from hmp.messages import Pull, Push
from hmp.nodes.ps_shard import PSShardNode
from hmp.ps.shard_core import ShardCore

from tests.support import serving, write_config


def _node(tmp_path, limits: str = "", chunk_bytes: int = 0, **config) -> PSShardNode:
    """Shard ps0 of the test topology (workers cpu0 and gpu0), with ``[limits]`` lines added."""
    path = write_config(tmp_path, **config)
    if chunk_bytes:
        path.write_text(path.read_text().replace("chunk_bytes = 16384", f"chunk_bytes = {chunk_bytes}"))
    if limits:
        path.write_text(path.read_text() + f"\n[limits]\n{limits}\n")
    return PSShardNode(load(path), "ps0")


def _grads(node: PSShardNode, keys, value: float = 1.0) -> tuple[torch.Tensor, ...]:
    return tuple(torch.full_like(node.core.chunks[k].param, value) for k in keys)


async def test_a_reply_never_carries_values_of_a_later_update(tmp_path):
    """Over inproc:// a zero-copy reply would be the shard's own chunk memory on the receiving
    side: a pulled value must stay what it was when pulled, after later pushes too. (The model is
    one chunk here, over pyzmq's 64 KiB copy threshold, so a send without the copy is zero-copy.)"""
    node = _node(tmp_path, chunk_bytes=1 << 20)
    keys = tuple(sorted(node.core.chunks))
    assert keys and node.core.chunks[keys[0]].param.numel() * 4 > 1 << 16
    async with serving(node, f"inproc://shard-{uuid.uuid4().hex}") as as_worker:
        cpu, gpu = await as_worker("cpu0"), await as_worker("gpu0")
        before = [node.core.chunks[k].param.clone() for k in keys]
        pulled = await gpu.request(Pull(keys=keys))
        first = await cpu.request(Push(keys=keys, grads=_grads(node, keys)))
        after_first = [node.core.chunks[k].param.clone() for k in keys]
        await asyncio.gather(*(cpu.request(Push(keys=keys, grads=_grads(node, keys, 3.0))) for _ in range(3)))
        assert node.core.version == 4
        for got, want in zip(pulled.values, before, strict=True):
            assert torch.equal(got, want)  # the values when pulled, not the current ones
        for got, want in zip(first.values, after_first, strict=True):
            assert torch.equal(got, want)  # still the first update's values after three more
        assert first.version == 1 and not torch.equal(first.values[0], node.core.chunks[keys[0]].param)


async def test_concurrent_pushes_each_get_their_own_updates_values(tmp_path):
    """Two pushes in flight at once: each reply is the values right after its own update."""
    node = _node(tmp_path, optimizer='name = "sgd"\nlr = 1.0')
    key = next(iter(node.core.chunks))
    start = node.core.chunks[key].param.clone()
    async with serving(node) as as_worker:
        cpu, gpu = await as_worker("cpu0"), await as_worker("gpu0")
        replies = await asyncio.gather(cpu.request(Push(keys=(key,), grads=_grads(node, (key,), 1.0))),
                                       gpu.request(Push(keys=(key,), grads=_grads(node, (key,), 10.0))))
    by_version = {r.version: r.values[0] for r in replies}
    assert set(by_version) == {1, 2}
    final = node.core.chunks[key].param
    assert torch.equal(by_version[2], final)
    first_delta = (start - by_version[1])[0].item()
    assert min(abs(first_delta - 1.0), abs(first_delta - 10.0)) < 1e-4  # the first update alone, not both


async def test_ssp_push_too_far_ahead_times_out(tmp_path):
    """SSP: a worker more than `staleness` updates ahead waits for the slowest, and gets a
    timeout error once request_timeout_s has passed without it catching up."""
    node = _node(tmp_path, limits="request_timeout_s = 0.3", consistency="ssp", extra_train="staleness = 0")
    keys = tuple(sorted(node.core.chunks)[:1])
    async with serving(node) as as_worker:
        cpu, gpu = await as_worker("cpu0"), await as_worker("gpu0")
        await cpu.request(Push(keys=keys, grads=_grads(node, keys)))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(RemoteError) as info:
            await cpu.request(Push(keys=keys, grads=_grads(node, keys)))
        assert info.value.code == "timeout" and 0.25 < loop.time() - t0 < 5
        assert node.core.version == 1  # the refused push was not applied
        # a waiting push goes on as soon as the slowest catches up
        waiting = asyncio.create_task(cpu.request(Push(keys=keys, grads=_grads(node, keys))))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await gpu.request(Push(keys=keys, grads=_grads(node, keys)))
        assert (await asyncio.wait_for(waiting, 5)).version == 3


async def test_sync_round_times_out_when_a_worker_never_pushes(tmp_path):
    """Sync: a push waits for every live worker; after request_timeout_s its sender gets a
    timeout error naming the missing worker; a complete round answers every member."""
    node = _node(tmp_path, limits="request_timeout_s = 0.3", consistency="sync")
    keys = tuple(sorted(node.core.chunks)[:2])
    async with serving(node) as as_worker:
        cpu, gpu = await as_worker("cpu0"), await as_worker("gpu0")
        with pytest.raises(RemoteError) as info:
            await cpu.request(Push(keys=keys, grads=_grads(node, keys)))
        assert info.value.code == "timeout" and "gpu0" in str(info.value)
        # cpu0 still counts as a member of the unfinished round: gpu0's push completes it
        reply = await gpu.request(Push(keys=keys, grads=_grads(node, keys, 3.0)))
    assert reply.version == 1 and node.core.version == 1
    assert torch.equal(reply.values[0], node.core.chunks[keys[0]].param)


async def test_a_checkpoint_is_a_snapshot_written_off_the_loop(tmp_path):
    """The checkpoint holds the state when it began, even though a push is applied while the
    file is being written in a thread."""
    node = _node(tmp_path)
    keys = tuple(sorted(node.core.chunks)[:2])
    writing = asyncio.create_task(node.checkpoint())
    await asyncio.sleep(0)  # the snapshot is taken; the write runs in a thread
    await node.on_push(Push(sender="cpu0", rid=1, keys=keys, grads=_grads(node, keys)), b"peer")
    await writing
    (tmp_path / "other").mkdir()
    restored = _node(tmp_path / "other")
    restored.core.load(node.checkpoint_path)
    assert restored.core.version == 0 and node.core.version == 1
    assert not torch.equal(restored.core.chunks[keys[0]].param, node.core.chunks[keys[0]].param)
    assert node.stats["checkpoints"] == 1


async def test_a_push_with_nan_is_refused_and_changes_nothing(tmp_path):
    node = _node(tmp_path)
    keys = tuple(sorted(node.core.chunks)[:2])
    before = {k: node.core.chunks[k].param.clone() for k in keys}
    grads = list(_grads(node, keys))
    grads[1][3] = float("nan")
    with pytest.raises(RequestError) as info:
        await node.on_push(Push(sender="cpu0", rid=1, keys=keys, grads=tuple(grads)), b"peer")
    assert info.value.code == "non_finite" and f"chunk {keys[1]}" in str(info.value)
    for k in keys:  # not even the finite first chunk was applied
        assert torch.equal(node.core.chunks[k].param, before[k])
    assert node.core.version == 0


def test_finite_check_accepts_huge_finite_values_whose_sum_overflows():
    """The fast test (the sum) overflows on huge finite values; the exact check then lets them pass."""
    huge = torch.full((8,), 3e38)
    assert not torch.isfinite(huge.sum())
    ShardCore.check_finite([0], [huge], "push")  # no error


def test_sweep_jobs_do_not_refuse_a_diverged_members_nan(tmp_path):
    """In a sweep each member owns its slice; one member's NaN must not stop the others."""
    path = write_config(tmp_path)
    path.write_text(path.read_text() + '\n[sweep]\nmembers = [{lr = 0.05}, {lr = 1e6}]\n')
    assert not PSShardNode(load(path), "ps0").core.reject_nonfinite
    assert PSShardNode(load(write_config(tmp_path)), "ps0").core.reject_nonfinite
