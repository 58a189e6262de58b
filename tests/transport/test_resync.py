"""hmp.collective.resync: survivors of a broken ring agree on a step and on the most advanced member's state.
Three members on one event loop, each with its own server on loopback (real sockets)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from hmp.collective import Ring, RingHost
from hmp.collective.resync import OPS, resync
from hmp.messages import Kind
from hmp.transport.endpoint import Server


async def _ring(n: int):
    hosts = [RingHost(timeout_s=5.0) for _ in range(n)]
    servers = [Server("tcp://127.0.0.1:0", {Kind.RING: h.on_piece}, name=f"m{i}") for i, h in enumerate(hosts)]
    for s in servers:
        await s.start()
    rings = [Ring(rank=i, addresses=[s.address for s in servers], generation=2, name=f"m{i}", timeout_s=5.0,
                  small_bytes=64, piece_bytes=256) for i in range(n)]
    for r, h in zip(rings, hosts):
        await r.connect()
        h.install(r)
    return servers, rings


async def _close(servers, rings) -> None:
    for r in rings:
        await r.close()
    for s in servers:
        await s.close()


@pytest.mark.parametrize("steps", [(7, 7, 7), (6, 7, 7), (7, 6, 6), (6, 6, 7)])
async def test_survivors_end_at_the_most_advanced_members_state(steps):
    """Agreeing steps send nothing; otherwise the lowest-ranked member with the most steps sends its state
    (a few KiB here: the ring algorithm, several pieces) and the members behind restore it; everyone then
    reports the same step and source."""
    servers, rings = await _ring(3)
    try:
        states = [{"rank": r, "step": s, "params": bytes(range(256)) * (8 + r)} for r, s in enumerate(steps)]
        restored: list[dict | None] = [None, None, None]
        snapshots = [0, 0, 0]

        def snapshot(r):
            def f() -> bytes:
                snapshots[r] += 1
                return pickle.dumps(states[r])
            return f

        def restore(r):
            def f(blob: bytes) -> None:
                restored[r] = pickle.loads(blob)
            return f

        outs = await asyncio.wait_for(asyncio.gather(*(
            resync(ring, steps[r], snapshot(r), restore(r), first_op=10) for r, ring in enumerate(rings))), 20)
        best = max(steps)
        source = None if len(set(steps)) == 1 else steps.index(best)
        assert all(o.step == best and o.source == source and o.steps == steps for o in outs)
        for r in range(3):
            if source is None or steps[r] == best:
                assert restored[r] is None
            else:
                assert restored[r] == states[source]
            assert snapshots[r] == (1 if r == source else 0)
        # The ring goes on with the ops after the resync's.
        import torch
        ts = [torch.full((5,), float(r)) for r in range(3)]
        await asyncio.gather(*(ring.all_reduce(t, 10 + OPS) for ring, t in zip(rings, ts)))
        assert all(torch.equal(t, torch.full((5,), 3.0)) for t in ts)
    finally:
        await _close(servers, rings)
