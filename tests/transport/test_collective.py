"""hmp.collective: ring all-reduce (both algorithms, every dtype, 2-4 members, real processes and
sockets, failures) and gradient buckets on a real model.

Cost: the real-process tests share one group of 4 spawned members (torch imports once per
process); rings of 2, 3 and 4 of them are formed in turn as new generations. The in-process tests
run several members on one event loop, over real loopback sockets too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
import torch

from hmp.collective import Ring, RingBroken, RingError, RingHost
from hmp.errors import RemoteError
from hmp.messages import Kind, RingPiece
from hmp.transport.endpoint import Client, Server
from tests.support import check_ring_sum, ring_inputs, tensor_bits


# ============================================================================ validation

async def test_arguments_are_checked():
    """Bad tensors, decreasing ops and a missing connect() are refused before anything is sent."""
    with pytest.raises(ValueError):
        Ring(rank=2, addresses=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], generation=1)
    with pytest.raises(ValueError):
        Ring(rank=0, addresses=["tcp://127.0.0.1:1"], generation=1, piece_bytes=0)
    ring = Ring(rank=0, addresses=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], generation=1)
    with pytest.raises(RingError, match="connect"):
        await ring.all_reduce(torch.zeros(4), 0)
    with pytest.raises(TypeError, match="bool"):
        await ring.all_reduce(torch.zeros(4, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="1-D"):
        await ring.all_reduce(torch.zeros(2, 2), 1)
    with pytest.raises(ValueError, match="1-D"):
        await ring.all_reduce(torch.zeros(8)[::2], 1)
    solo = Ring(rank=0, addresses=["tcp://127.0.0.1:1"], generation=1)
    t = torch.arange(5.0)
    assert await solo.all_reduce(t, 3) is t and torch.equal(t, torch.arange(5.0))  # one member: itself
    with pytest.raises(ValueError, match="increase"):
        await solo.all_reduce(t, 3)
    assert ring.algorithm(torch.zeros(10)) == "small" and ring.algorithm(torch.zeros(1 << 20)) == "ring"
    assert ring.algorithm(torch.zeros(0)) == "none"
    with pytest.raises(ValueError, match="algorithm"):
        Ring(rank=0, addresses=["tcp://127.0.0.1:1"], generation=1, algorithm="tree")
    await ring.close()
    await solo.close()


# ============================================================================ in-process rings

class Local:
    """``n`` members on this event loop, each with its own Server (real loopback sockets) and RingHost."""

    def __init__(self) -> None:
        self.servers: list[Server] = []
        self.hosts: list[RingHost] = []
        self.rings: list[Ring] = []

    @classmethod
    async def start(cls, n: int, generation: int = 1, host_timeout_s: float = 5.0, **opts: Any) -> Local:
        self = cls()
        for i in range(n):
            host = RingHost(timeout_s=host_timeout_s)
            server = Server("tcp://127.0.0.1:0", {Kind.RING: host.on_piece}, name=f"m{i}")
            await server.start()
            self.hosts.append(host)
            self.servers.append(server)
        await self.form(generation, **opts)
        return self

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    async def form(self, generation: int, **opts: Any) -> None:
        old = self.rings
        self.rings = []
        for i, host in enumerate(self.hosts):
            ring = Ring(rank=i, addresses=self.addresses, generation=generation, name=f"m{i}", **opts)
            await ring.connect()
            host.install(ring)
            self.rings.append(ring)
        for ring in old:
            await ring.close()

    async def reduce(self, tensors: list[torch.Tensor], op: int) -> None:
        await asyncio.gather(*(r.all_reduce(t, op) for r, t in zip(self.rings, tensors)))

    async def close(self) -> None:
        for r in self.rings:
            await r.close()
        for s in self.servers:
            await s.close()


@contextlib.asynccontextmanager
async def local(n: int, **opts: Any):
    members = await Local.start(n, **opts)
    try:
        yield members
    finally:
        await members.close()


async def test_pieces_of_an_op_not_started_yet_wait_for_it():
    """A member that starts late finds its neighbours' pieces waiting (buffered, unanswered) and
    the op completes on everyone; pieces crossing ops started at different times stay apart."""
    async with local(3, piece_bytes=64, small_bytes=0, timeout_s=5.0) as m:
        xs = [ring_inputs("float32", 1000, r, 7) for r in range(3)]
        ts = [x.clone() for x in xs]

        async def late() -> None:
            await asyncio.sleep(0.3)
            await m.rings[2].all_reduce(ts[2], 0)

        await asyncio.gather(m.rings[0].all_reduce(ts[0], 0), m.rings[1].all_reduce(ts[1], 0), late())
        check_ring_sum(ts, "float32", 1000, 7, "late member")
        assert m.rings[2].stats["early_pieces"] > 0


@pytest.mark.parametrize("window", [None, 2], ids=["one-way", "window-2"])
@pytest.mark.parametrize("n", [3, 4], ids=["ring", "halving"])
async def test_concurrent_ops_window_and_staging_give_identical_results(window, n):
    """Six ops at once (ring or halving-doubling, and small) started in order, with one-way
    pieces (the default) or every piece a request (a window of 2 pieces); a staged ring (the CUDA
    path, run on CPU) copies piece by piece and gives the same bits as an unstaged one."""
    sizes = [(1000, "float32"), (7, "int64"), (4097, "bfloat16"), (3, "float64"), (2000, "int16"), (64, "uint8")]
    results: dict[bool, list[list[torch.Tensor]]] = {}
    for stage in (False, True):
        async with local(n, piece_bytes=128, small_bytes=300, window=window, timeout_s=5.0, stage=stage) as m:
            ts = [[ring_inputs(d, k, r, op) for r in range(n)] for op, (k, d) in enumerate(sizes)]
            algos = [m.rings[0].algorithm(t[0]) for t in ts]
            assert "small" in algos and ("ring" if n == 3 else "halving") in algos

            async def member(r: int) -> None:
                if r == 1:
                    await asyncio.sleep(0.05)
                await asyncio.gather(*(m.rings[r].all_reduce(ts[op][r], op) for op in range(len(sizes))))

            await asyncio.gather(*(member(r) for r in range(n)))
            for op, (k, d) in enumerate(sizes):
                check_ring_sum(ts[op], d, k, op, f"op {op} stage={stage}")
            results[stage] = ts
            if stage:
                st = m.rings[0].stats
                # per piece: the ring ops' pieces, plus one region per small op
                assert st["staged_in"] > len(sizes) and st["staged_in"] == st["staged_out"], st
    for op in range(len(sizes)):
        assert tensor_bits(results[True][op][0]) == tensor_bits(results[False][op][0]), f"op {op}: staging changed the bits"


async def test_abort_fails_the_running_op_and_every_later_one():
    """abort() ends an op that waits on a silent peer at once with the caller's exception; later
    ops raise it too; nothing hangs."""
    async with local(1) as m:  # a server for member 0; member 1's address has nobody behind it
        with socket_port() as port:
            dead = f"tcp://127.0.0.1:{port}"
        ring = Ring(rank=0, addresses=[m.addresses[0], dead], generation=2, name="m0", small_bytes=0, timeout_s=30)
        await ring.connect()
        m.hosts[0].install(ring)
        task = asyncio.ensure_future(ring.all_reduce(torch.ones(1000), 0))
        await asyncio.sleep(0.1)
        assert not task.done()
        lost = PeerGone("member 1 lost")
        ring.abort(lost)
        with pytest.raises(PeerGone):
            await asyncio.wait_for(task, 2)
        with pytest.raises(PeerGone):
            await ring.all_reduce(torch.ones(1000), 1)
        await ring.close()


class PeerGone(Exception):
    pass


@contextlib.contextmanager
def socket_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


async def test_a_refused_one_way_piece_fails_its_sender_at_once():
    """Member 1's tensor is one element longer: member 0 refuses the one-way step-0 piece member 1
    sends it (bad_piece). The refusal comes back (an error of rid 0) and member 1's op fails at
    once, naming member 0, rather than after the 30 s timeout."""
    async with local(2, piece_bytes=1 << 20, small_bytes=0, timeout_s=30.0) as m:
        t0 = time.monotonic()
        outs = await asyncio.gather(*(m.rings[r].all_reduce(torch.ones(3000 + r), 0) for r in range(2)),
                                    return_exceptions=True)
        assert time.monotonic() - t0 < 5, outs
        assert all(isinstance(e, RingBroken) for e in outs), outs
        assert outs[0].code == "bad_piece" and outs[0].blamed == 1, outs[0]
        assert outs[1].code == "bad_piece" and outs[1].blamed == 0, outs[1]
        assert "refused a piece" in str(outs[1]), outs[1]
        assert m.rings[0].stats["refused"] == 1


async def test_a_member_that_never_joins_the_op_is_named_within_the_timeout():
    """Member 2 is up but never calls all_reduce: members 0 and 1 raise RingBroken naming member 2
    within about timeout_s (no hang), and their ring is aborted for later ops."""
    async with local(3, piece_bytes=256, small_bytes=0, timeout_s=0.5) as m:
        t0 = time.monotonic()
        outs = await asyncio.gather(m.rings[0].all_reduce(torch.ones(3000), 0),
                                    m.rings[1].all_reduce(torch.ones(3000), 0), return_exceptions=True)
        took = time.monotonic() - t0
        assert all(isinstance(e, RingBroken) for e in outs), outs
        assert [e.blamed for e in outs] == [2, 2], outs
        assert took < 0.5 * 2 + 1.0, took
        with pytest.raises(RingBroken):
            await m.rings[0].all_reduce(torch.ones(3), 1)


async def test_an_aborted_rings_refusal_carries_its_blame_to_the_sender():
    """Member 1 gave up on member 2: its refusal of member 0's piece (ring_aborted) names member 2
    (the error reply's ``blamed``: its address), so member 0 blames member 2 too, not its innocent
    neighbour; a refusal that blames the receiver itself leaves the blame on the refusing member."""
    async with local(3, piece_bytes=256, small_bytes=0, timeout_s=5.0) as m:
        for generation, blamed, expected in ((1, 2, 2), (2, 0, 1)):
            if generation > 1:
                await m.form(generation, piece_bytes=256, small_bytes=0, timeout_s=5.0)
            m.rings[1].abort(RingBroken(f"gave up on member {blamed}", blamed=blamed, address=m.addresses[blamed]))
            with pytest.raises(RingBroken) as info:
                await asyncio.wait_for(m.rings[0].all_reduce(torch.ones(3000), 0), 3)
            e = info.value
            assert e.code == "ring_aborted" and e.blamed == expected and e.address == m.addresses[expected], e
            assert f"ring aborted [member={blamed}]" in str(e), e


async def test_halving_doubling_names_a_member_that_never_joins():
    """Four members, halving-doubling: member 3 never calls all_reduce. Member 1 (its partner at
    step 0) and member 2 (at step 1) name it within about timeout_s; member 0, whose partners
    are 2 and 1, fails too (it names one of them or, from their refusals, member 3)."""
    async with local(4, piece_bytes=256, small_bytes=0, timeout_s=0.5) as m:
        assert m.rings[0].algorithm(torch.ones(3000)) == "halving"
        t0 = time.monotonic()
        outs = await asyncio.gather(*(m.rings[r].all_reduce(torch.ones(3000), 0) for r in range(3)),
                                    return_exceptions=True)
        took = time.monotonic() - t0
        assert all(isinstance(e, RingBroken) for e in outs), outs
        assert outs[1].blamed == 3 and outs[2].blamed == 3, outs
        assert outs[0].blamed in (1, 2, 3), outs
        assert took < 0.5 * 3 + 1.0, took


async def test_ring_host_follows_generations_and_refuses_nonsense():
    """stale_ring for an old generation, a newer generation's piece waits for its install,
    unknown_ring after the host's timeout; stale_op, bad_piece and too_far_ahead replies leave the
    ring working; a mismatched piece inside a running op fails that op (RingBroken bad_piece)."""
    async with local(2, piece_bytes=64, small_bytes=0, timeout_s=2.0, max_ops_ahead=1, host_timeout_s=0.3) as m:
        await m.reduce([torch.ones(100), torch.ones(100)], 5)
        async with Client(m.addresses[0], name="probe", timeout_s=5) as c:
            def piece(**kw: Any) -> RingPiece:
                return RingPiece(**{"ring": 1, "op": 9, "step": 0, "part": 0, "values": torch.zeros(5), **kw})

            async def code_of(msg: RingPiece) -> str:
                with pytest.raises(RemoteError) as info:
                    await c.request(msg)
                return info.value.code

            assert await code_of(piece(ring=0)) == "stale_ring"
            assert await code_of(piece(ring=7)) == "unknown_ring"  # never installed: after 0.3 s
            assert await code_of(piece(op=5)) == "stale_op"
            assert await code_of(piece(op=4)) == "stale_op"
            assert await code_of(piece(step=2)) == "bad_piece"  # a ring of 2 has steps 0 and 1
            assert await code_of(piece(part=-1)) == "bad_piece"
            waiting = asyncio.ensure_future(c.request(piece(op=6)))  # early piece: waits for op 6
            await asyncio.sleep(0.05)
            assert await code_of(piece(op=7)) == "too_far_ahead"  # max_ops_ahead=1
            # Op 6 starts on member 0 alone: the probe's piece (wrong size) is inside it.
            op6 = asyncio.ensure_future(m.rings[0].all_reduce(torch.ones(100), 6))
            with pytest.raises(RemoteError) as info:
                await waiting
            assert info.value.code == "bad_piece"
            with pytest.raises(RingBroken) as broken:
                await op6
            assert broken.value.code == "bad_piece" and broken.value.blamed == 1
            # A newer generation's piece waits for the install, then is served (stale_op: op 0 < 6 here).
            later = asyncio.ensure_future(c.request(piece(ring=2, op=0, step=5)))
            await asyncio.sleep(0.05)
            await m.form(2, piece_bytes=64, small_bytes=0, timeout_s=2.0)
            with pytest.raises(RemoteError) as info:
                await later
            assert info.value.code == "bad_piece"  # routed to generation 2's ring, which has no step 5
            assert await code_of(piece(ring=1)) == "stale_ring"
        ts = [ring_inputs("float32", 333, r, 1) for r in range(2)]
        await m.reduce(ts, 0)
        check_ring_sum(ts, "float32", 333, 1, "after the probes")


# ============================================================================ real processes


KILL_TIMEOUT_S = 1.5


