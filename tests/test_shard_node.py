"""A PS shard's rules for replies still being sent and for non-finite pushes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hmp.errors import RemoteError, RequestError
from hmp.job import load
from hmp.messages import Join, Pull, Push, Report, Welcome, Work
from hmp.nodes.ps_shard import PSShardNode
from hmp.ps.shard_core import ShardCore

from .cluster_util import write_config


class _SlowTracker:
    """A tracked send libzmq is still busy with for ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.until = asyncio.get_running_loop().time() + seconds

    @property
    def done(self) -> bool:
        return asyncio.get_running_loop().time() >= self.until


class _FakeServer:
    """Stands in for a shard's Server: each reply stays "in flight" for ``hold_s`` (None: sent at
    once); a reply with ``stuck_rid`` never gets room to be handed over."""

    def __init__(self, hold_s: float | None = None, stuck_rid: int | None = None) -> None:
        self.hold_s, self.stuck_rid = hold_s, stuck_rid

    async def send(self, peer, msg, track=False):
        if msg.rid == self.stuck_rid:  # this peer stopped reading
            await asyncio.Event().wait()
        return None if self.hold_s is None else _SlowTracker(self.hold_s)


def _shard(tmp_path, limits: str = "", **server) -> PSShardNode:
    """Shard ps0 of the test topology, with ``[limits]`` lines added and a fake server."""
    path = write_config(tmp_path)
    if limits:
        path.write_text(path.read_text() + f"\n[limits]\n{limits}\n")
    node = PSShardNode(load(path), "ps0")
    node.server = _FakeServer(**server)
    return node


async def test_concurrent_pushes_both_wait_for_replies_still_being_sent(tmp_path):
    node = _shard(tmp_path, hold_s=0.05)  # every reply stays "in flight" for 50 ms
    key = next(iter(node.core.chunks))
    g = torch.ones_like(node.core.chunks[key].param)
    loop = asyncio.get_running_loop()
    node._replies_in_flight.append((_SlowTracker(0.05), loop.time() + 60))  # an earlier reply references the chunk
    t0 = loop.time()
    applied = {}
    apply = node.core.apply

    def record(worker, keys, grads, samples):
        applied[worker] = loop.time() - t0
        return apply(worker, keys, grads, samples)

    node.core.apply = record
    await asyncio.gather(*(node.on_push(Push(sender=w, rid=1, keys=(key,), grads=(g,)), b"peer")
                           for w in ("cpu0", "gpu0")))
    # neither update ran while the earlier reply was in flight (handing the list to the first
    # caller let the second through at once); the first push's own reply waited for the second
    # update instead of holding it back
    assert min(applied.values()) >= 0.045


async def test_a_push_with_nan_is_refused_and_changes_nothing(tmp_path):
    node = _shard(tmp_path)
    keys = sorted(node.core.chunks)[:2]
    before = {k: node.core.chunks[k].param.clone() for k in keys}
    grads = [torch.ones_like(node.core.chunks[k].param) for k in keys]
    grads[1][3] = float("nan")
    with pytest.raises(RequestError) as info:
        await node.on_push(Push(sender="cpu0", rid=1, keys=tuple(keys), grads=tuple(grads)), b"peer")
    assert info.value.code == "non_finite" and f"chunk {keys[1]}" in str(info.value)
    for k in keys:  # not even the finite first chunk was applied
        assert torch.equal(node.core.chunks[k].param, before[k])
    assert node.core.version == 0


def test_finite_check_accepts_huge_finite_values_whose_sum_overflows():
    """The fast test (the sum) overflows on huge finite values; the exact check then lets them pass."""
    huge = torch.full((8,), 3e38)
    assert not torch.isfinite(huge.sum())
    ShardCore.check_finite([0], [huge], "push")  # no error


async def test_a_stream_of_pulls_cannot_hold_an_update_back(tmp_path):
    """Pulls arriving every 10 ms whose replies take 20 ms to send: an update waiting for the
    in-flight replies goes before the pulls that arrive meanwhile."""
    node = _shard(tmp_path, hold_s=0.02)
    key = next(iter(node.core.chunks))
    stop = asyncio.Event()

    async def pulls():
        while not stop.is_set():
            asyncio.ensure_future(node.on_pull(Pull(sender="gpu0", rid=2, keys=(key,)), b"peer"))
            await asyncio.sleep(0.01)

    puller = asyncio.ensure_future(pulls())
    await asyncio.sleep(0.05)
    g = torch.ones_like(node.core.chunks[key].param)
    try:
        await asyncio.wait_for(node.on_push(Push(sender="cpu0", rid=1, keys=(key,), grads=(g,)), b"peer"), 2)
    finally:
        stop.set()
        await puller
        await asyncio.sleep(0.05)
    assert node.core.version == 1


async def test_a_reply_that_is_never_sent_delays_an_update_only_until_the_timeout(tmp_path):
    node = _shard(tmp_path, limits="request_timeout_s = 0.2")
    loop = asyncio.get_running_loop()
    node._replies_in_flight.append((_SlowTracker(3600), loop.time() + 0.2))  # a peer that stopped reading
    key = next(iter(node.core.chunks))
    t0 = loop.time()
    await node.on_push(Push(sender="cpu0", rid=1, keys=(key,), grads=(torch.ones_like(node.core.chunks[key].param),)),
                       b"peer")
    assert node.core.version == 1 and 0.15 < loop.time() - t0 < 2
    assert not node._replies_in_flight


def test_sweep_jobs_do_not_refuse_a_diverged_members_nan(tmp_path):
    """In a sweep each member owns its slice; one member's NaN must not stop the others."""
    path = write_config(tmp_path)
    path.write_text(path.read_text() + '\n[sweep]\nmembers = [{lr = 0.05}, {lr = 1e6}]\n')
    assert not PSShardNode(load(path), "ps0").reject_nonfinite
    assert PSShardNode(load(write_config(tmp_path)), "ps0").reject_nonfinite


async def test_a_reply_stuck_before_libzmq_takes_it_delays_updates_only_until_the_timeout(tmp_path):
    """A reply waiting for room in a peer's full pipe counts as being sent, but only for
    request_timeout_s: then the update goes on, and so do other replies."""
    node = _shard(tmp_path, limits="request_timeout_s = 0.2", stuck_rid=99)
    key = next(iter(node.core.chunks))
    stuck = asyncio.ensure_future(node.on_pull(Pull(sender="gpu0", rid=99, keys=(key,)), b"slow"))
    await asyncio.sleep(0.01)
    g = torch.ones_like(node.core.chunks[key].param)
    try:
        await asyncio.wait_for(node.on_push(Push(sender="cpu0", rid=1, keys=(key,), grads=(g,)), b"p"), 2)
        await asyncio.wait_for(node.on_pull(Pull(sender="cpu0", rid=2, keys=(key,)), b"p"), 2)
        assert node.core.version == 1
    finally:
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)
    assert not node._sending


async def test_back_to_back_updates_do_not_starve_replies(tmp_path):
    """A reply waits only for the updates that were waiting when it came, not for later ones."""
    node = _shard(tmp_path, hold_s=0.005)
    key = next(iter(node.core.chunks))
    g = torch.zeros_like(node.core.chunks[key].param)
    stop = asyncio.Event()

    async def pusher():
        while not stop.is_set():
            await node.on_push(Push(sender="cpu0", rid=1, keys=(key,), grads=(g,)), b"p")

    task = asyncio.ensure_future(pusher())
    try:
        await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        for _ in range(5):
            t0 = loop.time()
            await asyncio.wait_for(node.on_pull(Pull(sender="gpu0", rid=2, keys=(key,)), b"q"), 2)
            assert loop.time() - t0 < 0.5
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
