"""Transport tests on real ZeroMQ sockets (tcp://127.0.0.1 and ipc://): no mocks."""

from __future__ import annotations

import asyncio
import contextvars
import os
import pathlib
import platform
import shutil
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from hmp.errors import EndpointClosed, PeerLost, ProtocolError, RemoteError, RequestError, RequestTimeout
from hmp.messages import Ack, Error, Heartbeat, Kind, Pull, RingPiece, Tensors
from hmp.transport import eager as eager_start
from hmp.transport.codec import DTYPES, Limits, decode, encode
from hmp.transport import Client, Reply, Server, hwm_for, wait_sent


async def echo(msg, peer):
    return msg


async def refuse(msg, peer):
    raise RequestError(f"cannot pull {msg.keys}", code="unknown_key")


async def slow(msg, peer):
    await asyncio.sleep(5)
    return Ack()


HANDLERS = {Kind.TENSORS: echo, Kind.PULL: refuse, Kind.HEARTBEAT: slow}


@pytest.fixture(params=["tcp", "ipc"])
async def server(request, tcp_address, ipc_address):
    addr = tcp_address if request.param == "tcp" else ipc_address
    async with Server(addr, HANDLERS, name="S[0]") as srv:
        yield srv


async def test_every_dtype_round_trips_through_a_live_endpoint_pair(server):
    """Tensors of every dtype and several shapes go out and come back bit-exact over tcp and ipc."""
    tensors = tuple(torch.arange(12).reshape(3, 4).to(d) for d in DTYPES.values()) + (torch.tensor(1.5), torch.empty(0, 2))
    async with Client(server.address, name="W[0]") as client:
        reply = await client.request(Tensors(name="all", tensors=tensors))
    assert reply.sender == "S[0]"
    for got, want in zip(reply.tensors, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


async def test_256_mib_tensor_arrives_bit_exact(tcp_address):
    """A 256 MiB tensor crosses a real TCP socket bit-exact (split into 1 MiB frames and reassembled)."""
    got = asyncio.get_running_loop().create_future()

    async def keep(msg, peer):
        got.set_result(msg.tensors[0].clone())  # the view dies with its frames; keep a copy for the check
        return Ack()

    g = torch.Generator().manual_seed(7)
    big = torch.randint(-(2**31), 2**31 - 1, (64 * 1024 * 1024,), dtype=torch.int32, generator=g)
    async with Server(tcp_address, {Kind.TENSORS: keep}) as srv, Client(srv.address, frame_bytes=1 << 20) as client:
        await client.request(Tensors(name="big", tensors=(big,)), timeout_s=120)
    assert torch.equal(await got, big)


async def test_handler_errors_become_error_replies(server):
    """A RequestError in a handler reaches the client as RemoteError with its code; an unserved kind as unknown_op."""
    async with Client(server.address) as client:
        with pytest.raises(RemoteError) as info:
            await client.request(Pull(keys=(9,)))
        assert info.value.code == "unknown_key" and "cannot pull (9,)" in str(info.value)
        with pytest.raises(RemoteError) as info:
            await client.request(Ack())
        assert info.value.code == "unknown_op"


async def test_request_timeout_is_bounded(tcp_address):
    """A request without a reply in time raises RequestTimeout instead of hanging."""
    async with Server(tcp_address, HANDLERS) as srv, Client(srv.address) as client:
        with pytest.raises(RequestTimeout):
            await client.request(Heartbeat(), timeout_s=0.2)


GARBAGE = [
    [b"\x00\x01\x02"],
    [b""],
    [msgpack.packb({"version": 1})],
    [msgpack.packb({"version": 9, "kind": "pull", "sender": "", "rid": 77, "fields": {}, "tensors": []})],
    [msgpack.packb({"version": 1, "kind": "nuke", "sender": "", "rid": 78, "fields": {}, "tensors": []})],
    [msgpack.packb({"version": 1, "kind": "tensors", "sender": "", "rid": 79, "fields": {"name": "x"},
                    "tensors": [{"field": "tensors", "dtype": "float32", "shape": [1000], "frames": 1}]}), b"abc"],
]


async def test_live_server_answers_garbage_with_errors_and_keeps_serving(server):
    """Garbage from a raw zmq socket gets error replies when its request id is readable (and
    nothing when it is not: rid 0 is never answered) while a good client is served."""
    ctx = zmq.asyncio.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        async with Client(server.address) as good:
            for frames in GARBAGE:
                await raw.send_multipart(frames)
                ok = await good.request(Tensors(name="still", tensors=(torch.ones(3),)))
                assert torch.equal(ok.tensors[0], torch.ones(3))
            rids = []
            for _ in GARBAGE[3:]:
                reply = decode(await asyncio.wait_for(raw.recv_multipart(), 5))
                assert isinstance(reply, Error)
                rids.append(reply.rid)
            assert rids == [77, 78, 79]  # the first three had no readable rid: no reply
            assert await raw.poll(100) == 0
    finally:
        raw.close(linger=0)
    assert server.stats["errors"] >= len(GARBAGE)


async def test_oversized_message_is_refused(tcp_address):
    """A message over the configured byte limit gets a too_large error reply; the server goes on."""
    limits = Limits(max_message_bytes=1024)
    async with Server(tcp_address, HANDLERS, limits=limits) as srv, Client(srv.address) as client:
        with pytest.raises(RemoteError) as info:
            await client.request(Tensors(name="x", tensors=(torch.zeros(1000),)))
        assert info.value.code == "too_large"
        ok = await client.request(Tensors(name="x", tensors=(torch.zeros(10),)))
        assert ok.tensors[0].numel() == 10


async def test_thousand_concurrent_requests_each_get_their_own_reply(tcp_address):
    """1,000 requests in flight from several clients are each answered with their own payload."""
    async with Server(tcp_address, HANDLERS) as srv:
        clients = [Client(srv.address, name=f"W[{i}]") for i in range(4)]
        for c in clients:
            await c.connect()
        try:
            async def one(i):
                c = clients[i % len(clients)]
                r = await c.request(Tensors(name=str(i), tensors=(torch.full((4,), float(i)),), step=i), timeout_s=30)
                return r.name == str(i) and r.step == i and bool((r.tensors[0] == i).all())
            results = await asyncio.gather(*(one(i) for i in range(1000)))
        finally:
            for c in clients:
                await c.close()
    assert all(results) and len(results) == 1000


async def test_close_finishes_inflight_and_refuses_new(tcp_address):
    """Closing a server lets in-flight handlers finish within the grace period; no task is leaked."""
    done = asyncio.Event()

    async def work(msg, peer):
        await asyncio.sleep(0.2)
        done.set()
        return Ack(detail="finished")

    srv = Server(tcp_address, {Kind.TENSORS: work})
    await srv.start()
    async with Client(srv.address) as client:
        pending = asyncio.create_task(client.request(Tensors(name="x", tensors=())))
        await asyncio.sleep(0.05)
        await srv.close(grace_s=2)
        assert done.is_set()
        reply = await pending
        assert reply.detail == "finished"
    assert not srv._inflight


# ----------------------------------------------------------------------------- performance paths

def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_tracker_covers_every_zero_copy_frame():
    """A tracked send stays pending while its big frame is unsent, even when its last frame is small (copied)."""
    port = _free_tcp_port()
    got = asyncio.get_running_loop().create_future()

    async def keep(msg, peer):
        got.set_result([t.clone() for t in msg.tensors])

    big, tiny = torch.arange(1 << 18, dtype=torch.float32), torch.tensor([7.0])  # 1 MiB, then 4 bytes
    async with Client(f"tcp://127.0.0.1:{port}") as client:  # nobody listens yet: the message waits in libzmq
        tracker = await client.send(Tensors(name="x", tensors=(big, tiny)), track=True)
        await asyncio.sleep(0.05)
        assert tracker is not None and not tracker.done
        async with Server(f"tcp://127.0.0.1:{port}", {Kind.TENSORS: keep}):
            await wait_sent(tracker, timeout_s=10)
            out = await asyncio.wait_for(got, 10)
    assert torch.equal(out[0], big) and torch.equal(out[1], tiny)


async def test_blocked_sends_keep_their_order():
    """Sends that find the queue full wait and go out in the order they were made, none lost."""
    port = _free_tcp_port()
    steps: list[int] = []
    done = asyncio.Event()

    async def count(msg, peer):
        steps.append(msg.step)
        if len(steps) == 40:
            done.set()

    async with Client(f"tcp://127.0.0.1:{port}", hwm=5) as client:
        senders = [asyncio.create_task(client.send(Heartbeat(step=i))) for i in range(40)]
        await asyncio.sleep(0.05)
        assert sum(t.done() for t in senders) < 40  # the queue is full: some sends are waiting
        async with Server(f"tcp://127.0.0.1:{port}", {Kind.HEARTBEAT: count}, hwm=5):
            await asyncio.wait_for(asyncio.gather(*senders), 10)
            await asyncio.wait_for(done.wait(), 10)
    assert steps == list(range(40))


async def test_single_frame_64_mib_tensor_round_trips(tcp_address):
    """A 64 MiB tensor travels as one frame (the default frame size) and comes back bit-exact."""
    t = torch.randint(0, 1 << 30, (16 << 20,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    assert len(encode(Tensors(name="big", tensors=(t,)))) == 2
    async with Server(tcp_address, HANDLERS) as srv, Client(srv.address) as client:
        reply = await client.request(Tensors(name="big", tensors=(t,)), timeout_s=60)
    assert torch.equal(reply.tensors[0], t)


async def test_eager_handlers_get_their_own_context_and_can_suspend(tcp_address):
    """Eager handlers see a fresh context per request, and one that suspends still replies (eager on and off)."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    seen = []

    async def handler(msg, peer):
        seen.append(var.get())
        var.set(msg.name)  # must not leak into the next request's handler
        if msg.step:
            await asyncio.sleep(0.01)
        return Ack(detail=var.get())

    for eager in (True, False):
        seen.clear()
        async with Server(tcp_address, {Kind.TENSORS: handler}, eager=eager) as srv, Client(srv.address) as client:
            for i, step in enumerate((0, 1, 0, 1)):
                reply = await client.request(Tensors(name=f"r{i}", tensors=(), step=step))
                assert reply.detail == f"r{i}"
        assert seen == ["unset"] * 4


async def test_close_cancels_suspended_eager_handlers_after_grace(tcp_address):
    """A handler still suspended when the grace period ends is cancelled (its finally runs); no task is left."""
    cleaned = asyncio.Event()

    async def stuck(msg, peer):
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.set()

    srv = Server(tcp_address, {Kind.TENSORS: stuck})
    await srv.start()
    async with Client(srv.address) as client:
        pending = asyncio.create_task(client.request(Tensors(name="x", tensors=()), timeout_s=5))
        await asyncio.sleep(0.05)
        await srv.close(grace_s=0.1)
        assert cleaned.is_set() and not srv._inflight
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)


_FAULT_PROBE = """
import resource, sys, zmq, torch
from hmp.transport import tune_malloc
applied = tune_malloc() if sys.argv[1] == "tuned" else False
ctx = zmq.Context()
rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
port = rx.bind_to_random_port("tcp://127.0.0.1")
tx.connect(f"tcp://127.0.0.1:{port}")
payload = memoryview(torch.ones(16 << 20).numpy()).cast("B")  # 64 MiB: one frame
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tx.send(payload, copy=False)
    frame = rx.recv(copy=False)
    assert len(frame) == len(payload)
    del frame
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, min(faults[1:]))
"""


def test_tune_malloc_lets_large_frames_reuse_memory():
    """After tune_malloc(), receiving a 64 MiB frame again costs few page faults instead of one per 4 KiB page."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("tune_malloc acts on glibc only")
    out = subprocess.run([sys.executable, "-c", _FAULT_PROBE, "tuned"], capture_output=True, text=True, timeout=60,
                         cwd=str(pathlib.Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    assert applied == "True"
    assert int(faults) < 2048, f"{faults} page faults for a 64 MiB frame (16384 would be one per page)"


async def test_a_handler_may_start_a_timeout_before_it_first_suspends(tcp_address):
    """Handlers start eagerly; one whose first await is inside asyncio.wait_for (the scheduler's
    join, a shard's sync push) must work: from Python 3.12 a timeout needs a current Task."""
    released = asyncio.Event()

    async def waits(msg, peer):
        await asyncio.wait_for(released.wait(), 5)
        return Ack(detail="released")

    async with Server(tcp_address, {Kind.TENSORS: waits}) as srv:
        async with Client(srv.address) as client:
            pending = asyncio.create_task(client.request(Tensors(name="x", tensors=()), timeout_s=5))
            await asyncio.sleep(0.05)
            released.set()
            assert (await pending).detail == "released"


async def test_close_tells_the_sender_of_a_cancelled_handler(tcp_address):
    """A request still being handled when close() gives up on it gets a shutting_down error at
    once, instead of the sender waiting out its own timeout."""
    async def stuck(msg, peer):
        await asyncio.sleep(30)

    srv = Server(tcp_address, {Kind.TENSORS: stuck})
    await srv.start()
    async with Client(srv.address) as client:
        pending = asyncio.create_task(client.request(Tensors(name="x", tensors=()), timeout_s=20))
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await srv.close(grace_s=0.1)
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(pending, 5)
        assert info.value.code == "shutting_down" and loop.time() - t0 < 5


async def test_one_way_messages_get_no_reply(tcp_address):
    """rid 0 is a one-way message (protocol.md): served, never answered."""
    async with Server(tcp_address, {Kind.TENSORS: echo}) as srv:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.address)
        try:
            await sock.send_multipart(encode(Tensors(name="one-way", tensors=()), rid=0, sender="raw"))
            await sock.send_multipart(encode(Tensors(name="request", tensors=()), rid=5, sender="raw"))
            reply = decode(await asyncio.wait_for(sock.recv_multipart(), 5))
            assert reply.rid == 5 and reply.name == "request"
            assert await sock.poll(200) == 0  # and nothing else comes
        finally:
            sock.close()
            ctx.term()


# ----------------------------------------------------------------------------- one reply path

class _Raw:
    """A raw DEALER socket speaking the wire format directly (to send rid 0 and broken messages)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def send(self, msg, rid: int) -> None:
        await self.sock.send_multipart(encode(msg, rid=rid, sender="raw"))

    async def recv(self):
        return decode(await asyncio.wait_for(self.sock.recv_multipart(), 5))

    async def nothing_more(self, ms: int = 150) -> bool:
        return await self.sock.poll(ms) == 0

    def close(self) -> None:
        self.sock.close(linger=0)


async def boom(msg, peer):
    raise ValueError("a handler bug")


async def test_one_way_messages_get_no_error_replies_either(tcp_address):
    """rid 0 is never answered: not a handler's RequestError, a handler bug, an unserved kind or
    a message that does not decode; the same failures with a rid are answered."""
    async with Server(tcp_address, {Kind.PULL: refuse, Kind.HEARTBEAT: boom}) as srv:
        raw = _Raw(srv.address)
        bad_version = msgpack.packb({"version": 9, "kind": "pull", "sender": "", "rid": 0, "fields": {}, "tensors": []})
        try:
            await raw.send(Pull(keys=(1,)), rid=0)  # RequestError
            await raw.send(Heartbeat(), rid=0)  # handler bug: internal
            await raw.send(Tensors(name="x", tensors=()), rid=0)  # unknown_op
            await raw.sock.send_multipart([bad_version])  # decode error
            assert await raw.nothing_more()
            assert srv.stats["unanswered_one_way_errors"] == 4
            for rid, msg in ((11, Pull(keys=(1,))), (12, Heartbeat()), (13, Tensors(name="x", tensors=()))):
                await raw.send(msg, rid=rid)
                reply = await raw.recv()
                assert isinstance(reply, Error) and reply.rid == rid
        finally:
            raw.close()


async def test_refused_one_way_messages_of_a_kind_that_asks_are_answered_with_rid_0(tcp_address):
    """RingPiece.refusals_answered: a refused one-way ring piece (a handler's RequestError, or a
    kind the server does not serve) comes back as an error of rid 0, which the client hands to
    on_refused; a served one is not answered; a refused one-way heartbeat still gets nothing."""
    refusals: list[RemoteError] = []
    got = asyncio.Event()

    async def ring(msg, peer):
        if msg.op < 0:
            raise RequestError("no such op", "bad_piece")
        got.set()
        return Ack()

    def piece(op: int) -> RingPiece:
        return RingPiece(ring=1, op=op, step=0, part=0, values=torch.ones(3))

    async with Server(tcp_address, {Kind.RING: ring, Kind.HEARTBEAT: refuse}) as srv, \
            Server("tcp://127.0.0.1:0", {Kind.HEARTBEAT: refuse}) as other:
        async with Client(srv.address, timeout_s=5, on_refused=refusals.append) as c, \
                Client(other.address, timeout_s=5, on_refused=refusals.append) as c2:
            await c.send(piece(1))  # served: no answer
            await asyncio.wait_for(got.wait(), 5)
            await c.send(Heartbeat())  # refused, but heartbeats do not ask: no answer
            await c.send(piece(-1))
            await c2.send(piece(2))  # a kind the server does not serve
            deadline = time.monotonic() + 5
            while len(refusals) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # nothing else comes
            assert sorted(e.code for e in refusals) == ["bad_piece", "unknown_op"], refusals
            assert c.stats["one_way_refused"] == 1 and c2.stats["one_way_refused"] == 1
            assert isinstance(await c.request(piece(3)), Ack)  # requests are answered as ever
        assert srv.stats["answered_one_way_errors"] == 1 and srv.stats["unanswered_one_way_errors"] == 1
        assert other.stats["answered_one_way_errors"] == 1


async def test_a_closing_server_answers_requests_but_not_one_way_messages(tcp_address):
    """While a server closes, new requests get shutting_down (with their rid); one-way messages
    nothing; the request whose handler is cancelled at the end of the grace period gets
    shutting_down too, but a one-way one does not."""
    started = asyncio.Event()

    async def stuck(msg, peer):
        started.set()
        await asyncio.sleep(30)

    srv = Server(tcp_address, {Kind.TENSORS: stuck, Kind.HEARTBEAT: slow})
    await srv.start()
    raw = _Raw(srv.address)
    try:
        await raw.send(Tensors(name="one-way", tensors=()), rid=0)
        await asyncio.wait_for(started.wait(), 5)
        started.clear()
        await raw.send(Tensors(name="request", tensors=()), rid=21)
        await asyncio.wait_for(started.wait(), 5)
        closing = asyncio.create_task(srv.close(grace_s=0.5))
        await asyncio.sleep(0.05)
        await raw.send(Heartbeat(), rid=0)
        await raw.send(Heartbeat(), rid=22)
        first = await raw.recv()
        assert isinstance(first, Error) and first.code == "shutting_down" and first.rid == 22
        await closing
        second = await raw.recv()  # the cancelled handler of request 21
        assert isinstance(second, Error) and second.code == "shutting_down" and second.rid == 21
        assert await raw.nothing_more()
    finally:
        raw.close()


async def test_closing_a_client_fails_its_pending_requests(tcp_address):
    """Requests pending when their client closes fail at once with EndpointClosed."""
    async with Server(tcp_address, HANDLERS) as srv:
        client = Client(srv.address)
        await client.connect()
        pending = [asyncio.create_task(client.request(Heartbeat(), timeout_s=20)) for _ in range(3)]
        await asyncio.sleep(0.05)
        await client.close()
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5)
        assert all(isinstance(r, EndpointClosed) for r in results)
        with pytest.raises(EndpointClosed):
            await client.request(Heartbeat())


async def test_pending_requests_fail_with_peer_lost_when_the_peer_goes(tcp_address):
    """The endpoint has no liveness detection of its own (the nodes' heartbeats do that): when a
    server vanishes without answering, fail_pending(PeerLost) ends the waits at once."""
    srv = Server(tcp_address, HANDLERS)
    await srv.start()
    async with Client(srv.address) as client:
        pending = [asyncio.create_task(client.request(Heartbeat(), timeout_s=20)) for _ in range(2)]
        await asyncio.sleep(0.05)
        srv._chan.close()  # the peer's socket is gone, no goodbye (as when its process dies)
        assert client.fail_pending(PeerLost("server lost")) == 2
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5)
        assert all(isinstance(r, PeerLost) for r in results)
    srv._chan = None


class _TearingSocket(zmq.Socket):
    """A DEALER whose pipe is torn down after ``tear_at`` parts of a message (as when the peer's
    connection drops mid-message): that part fails with EHOSTUNREACH."""

    tear_at: int | None = None
    parts = 0

    def send(self, data, flags=0, copy=True, track=False, **kw):
        self.parts += 1
        if self.tear_at is not None and self.parts == self.tear_at:
            self.tear_at = None
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        return super().send(data, flags, copy=copy, track=track, **kw)


async def test_a_send_torn_mid_message_raises_peer_lost_and_the_next_message_is_clean(tcp_address):
    """PeerLost on a torn send: the message's other parts are handed over so that libzmq drops
    them, and the next message arrives whole (the peer never sees the torn one)."""
    seen = []

    async def keep(msg, peer):
        seen.append(msg.name)
        return Ack()

    ctx = _TearingContext()
    async with Server(tcp_address, {Kind.TENSORS: keep}) as srv:
        client = Client(srv.address, ctx=ctx)
        await client.connect()
        try:
            assert isinstance(client._chan.sock, _TearingSocket)
            client._chan.sock.tear_at = 2  # the header went out, the first data frame fails
            with pytest.raises(PeerLost):
                await client.send(Tensors(name="torn", tensors=(torch.ones(4), torch.ones(4))))
            reply = await client.request(Tensors(name="next", tensors=(torch.ones(2),)), timeout_s=5)
            assert isinstance(reply, Ack) and seen == ["next"]
        finally:
            await client.close()
            ctx.term()


class _TearingContext(zmq.Context):
    _socket_class = _TearingSocket

    def socket(self, socket_type, socket_class=None, **kw):
        return super().socket(socket_type, socket_class=_TearingSocket, **kw)


async def test_a_tracked_reply_reports_when_libzmq_let_go(tcp_address):
    """A handler returning Reply(msg, on_sent) hears once its buffers are free: True when sent,
    at once for a one-way request (not answered), False when the server closed first."""
    calls = []
    big = torch.ones(1 << 20)  # 4 MiB: zero-copy (over pyzmq's copy threshold)

    async def tracked(msg, peer):
        return Reply(Tensors(name=msg.name, tensors=(big,)), lambda sent: calls.append((msg.name, sent)))

    async with Server(tcp_address, {Kind.TENSORS: tracked}) as srv:
        async with Client(srv.address) as client:
            reply = await client.request(Tensors(name="a", tensors=()))
            assert torch.equal(reply.tensors[0], big)
            for _ in range(100):
                if calls:
                    break
                await asyncio.sleep(0.01)
            assert calls == [("a", True)]
            await client.send(Tensors(name="one-way", tensors=()))
            await asyncio.sleep(0.05)
            assert calls[-1] == ("one-way", True)


# ----------------------------------------------------------------------------- backpressure, no spinning

def _cpu_seconds_over(seconds: float):
    """CPU time this process (event loop and libzmq threads) spends while the caller sleeps."""
    async def measure():
        t0 = time.process_time()
        await asyncio.sleep(seconds)
        return time.process_time() - t0
    return measure()


async def test_a_server_at_its_inflight_cap_stops_reading_and_resumes(tcp_address):
    """With max_inflight=2, two suspended handlers stop the reader: further requests wait
    unread (in libzmq, not in handlers), the loop does not spin meanwhile, and releasing the
    handlers lets the rest in, every request answered."""
    release = asyncio.Event()
    started = []

    async def hold(msg, peer):
        started.append(msg.step)
        await release.wait()
        return Ack(detail=str(msg.step))

    async with Server(tcp_address, {Kind.HEARTBEAT: hold}, max_inflight=2) as srv:
        async with Client(srv.address) as client:
            pending = [asyncio.create_task(client.request(Heartbeat(step=i), timeout_s=10)) for i in range(6)]
            await asyncio.sleep(0.1)
            assert started == [0, 1] and not srv.reading and srv.stats["requests"] == 2
            assert await _cpu_seconds_over(0.3) < 0.1  # paused: no busy loop on the readable FD
            release.set()
            replies = await asyncio.wait_for(asyncio.gather(*pending), 5)
            assert [r.detail for r in replies] == [str(i) for i in range(6)]
            assert sorted(started) == list(range(6)) and srv.reading and srv.stats["paused"] >= 1


async def test_blocked_sends_and_tracker_waits_do_not_spin():
    """A send waiting for room and a wait for a tracked send sleep until something changes:
    waiting costs next to no CPU (uvloop makes sub-0.5 ms sleeps a spin)."""
    port = _free_tcp_port()
    async with Client(f"tcp://127.0.0.1:{port}", hwm=2) as client:  # nobody listens: nothing leaves
        tracker = await client.send(Tensors(name="x", tensors=(torch.ones(1 << 18),)), track=True)
        senders = [asyncio.create_task(client.send(Heartbeat(step=i))) for i in range(10)]
        waiter = asyncio.create_task(wait_sent(tracker, timeout_s=30))
        await asyncio.sleep(0.05)
        assert not waiter.done() and sum(t.done() for t in senders) < 10
        assert await _cpu_seconds_over(0.5) < 0.15
        got = []

        async def count(msg, peer):
            got.append(msg.kind)

        async with Server(f"tcp://127.0.0.1:{port}", {Kind.TENSORS: count, Kind.HEARTBEAT: count}):
            await asyncio.wait_for(asyncio.gather(waiter, *senders), 10)


def test_high_water_marks_follow_memory_not_message_counts():
    assert hwm_for(Limits(queue_bytes=1 << 30), 64 << 20) == 16
    assert hwm_for(Limits(queue_bytes=1 << 30), 1 << 20) == 1024
    assert hwm_for(Limits(queue_bytes=1 << 20), 64 << 20) == 16  # the floor


# ----------------------------------------------------------------------------- eager start, every interpreter

_EAGER_PROBE = r"""
import asyncio, contextvars, importlib.util, sys
spec = importlib.util.spec_from_file_location("eager", sys.argv[1])
eager = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eager)
var = contextvars.ContextVar("var", default="unset")

async def handler(name, suspend, log):
    log.append(("first", name, var.get(), asyncio.current_task() is not None))
    var.set(name)
    if suspend:
        await asyncio.sleep(0.01)
    log.append(("rest", name, var.get()))
    return name

async def main(native):
    loop, log = asyncio.get_running_loop(), []
    tasks = []
    def cb():
        for name, suspend in (("a", False), ("b", True), ("c", False)):
            tasks.append(eager.start_eager(handler(name, suspend, log), loop, native=native))
        log.append(("callback done",))
    loop.call_soon(cb)
    await asyncio.sleep(0.05)
    assert [t is None for t in tasks] == [True, False, True], tasks
    assert tasks[1].result() == "b"
    # every first step ran inside the callback, before it returned; each in a fresh context
    assert log[:5] == [("first", "a", "unset", native), ("rest", "a", "a"), ("first", "b", "unset", native),
                       ("first", "c", "unset", native), ("rest", "c", "c")], log
    assert log[5:] == [("callback done",), ("rest", "b", "b")], log
    assert var.get() == "unset"
    # a suspended one can be cancelled
    def cb2():
        tasks.append(eager.start_eager(asyncio.sleep(30), loop, native=native))
    loop.call_soon(cb2)
    await asyncio.sleep(0)
    tasks[-1].cancel()
    try:
        await tasks[-1]
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("not cancelled")
    if native:  # a timeout may start before the first suspension
        async def timed():
            await asyncio.wait_for(asyncio.sleep(0.01), 1)
            return "ok"
        box = []
        loop.call_soon(lambda: box.append(eager.start_eager(timed(), loop, native=True)))
        await asyncio.sleep(0.05)
        assert box[0].result() == "ok"

for native in ([False, True] if eager.NATIVE else [False]):
    asyncio.run(main(native))
print("ok", sys.version_info[:2], eager.NATIVE)
"""


def _find_python(version: str) -> str | None:
    """An interpreter of ``version`` ("3.12") that runs: on PATH, or installed by pyenv (whose
    PATH shims refuse versions not selected)."""
    root = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv"))
    installed = sorted(map(str, root.glob(f"versions/{version}*/bin/python{version}")))
    candidates = [shutil.which(f"python{version}"), *installed]
    for exe in filter(None, candidates):
        ok = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True,
                            timeout=30)
        if ok.returncode == 0 and ok.stdout.strip() == str(tuple(map(int, version.split(".")))):
            return exe
    return None


@pytest.mark.parametrize("version", ["current", "3.12", "3.13"])
def test_eager_start_on_every_interpreter(version):
    """The eager start's two paths: the 3.11 one (a first step outside any Task, then _Resume) and
    3.12+'s native eager Task, which CI (3.11) never takes; run under each interpreter found here
    (the helper is stdlib-only, loaded by path; on 3.12+ both paths run)."""
    exe = sys.executable if version == "current" else _find_python(version)
    if exe is None:
        pytest.skip(f"no Python {version} on this machine: its eager-start branch is not exercised here")
    probe = subprocess.run([exe, "-c", _EAGER_PROBE, str(pathlib.Path(eager_start.__file__))], capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("ok")


async def test_a_server_with_a_job_token_refuses_other_tokens_before_any_handler(tcp_address):
    """A server with a job token answers a message without it or with another `unauthorized` (naming the sender,
    never a token) before its handler or ``authorize`` runs; ``authorize`` then refuses what it names; the
    right token is served, and the server keeps serving everyone."""
    called = []

    async def heartbeat(msg, peer):
        called.append(msg.sender)
        return Ack(detail=msg.sender)

    def authorize(msg, peer):
        return None if msg.sender != "mallory" else "mallory may not send heartbeats"

    async with Server(tcp_address, {Kind.HEARTBEAT: heartbeat}, job_token="t" * 32, authorize=authorize) as srv:
        for token in ("", "u" * 32):
            async with Client(srv.address, name="stranger", job_token=token, timeout_s=5) as c:
                with pytest.raises(RemoteError) as info:
                    await c.request(Heartbeat())
            assert info.value.code == "unauthorized" and "'stranger'" in info.value.remote_message
            assert "t" * 32 not in info.value.remote_message and "u" * 32 not in info.value.remote_message
        async with Client(srv.address, name="mallory", job_token="t" * 32, timeout_s=5) as c:
            with pytest.raises(RemoteError) as info:
                await c.request(Heartbeat())
        assert info.value.code == "unauthorized" and info.value.remote_message == "mallory may not send heartbeats"
        async with Client(srv.address, name="w", job_token="t" * 32, timeout_s=5) as c:
            reply = await c.request(Heartbeat())
            assert reply.detail == "w" and reply.job_token == ""  # replies never carry the token
        assert called == ["w"] and srv.stats["unauthorized"] == 3
    async with Server(tcp_address, {Kind.HEARTBEAT: heartbeat}) as open_srv:  # no token: open
        async with Client(open_srv.address, name="any", job_token="x", timeout_s=5) as c:
            assert (await c.request(Heartbeat())).detail == "any"


async def test_an_ipc_address_a_live_server_holds_is_in_use(ipc_address):
    """Binding an ipc:// path a live server holds fails EADDRINUSE (its peers are not taken over); a stale file
    left behind is replaced."""
    async with Server(ipc_address, {}, name="first") as first:
        with pytest.raises(zmq.ZMQError) as info:
            await Server(ipc_address, {}, name="second").start()
        assert info.value.errno == zmq.EADDRINUSE and first.reading
    pathlib.Path(ipc_address.removeprefix("ipc://")).touch()  # a stale socket file
    async with Server(ipc_address, {Kind.TENSORS: echo}, name="again") as srv, Client(srv.address) as client:
        assert isinstance(await client.request(Tensors(name="x", tensors=())), Tensors)


# ----------------------------------------------------------------------------- hostile input: frame counts

async def test_a_message_of_too_many_frames_is_refused_as_it_is_read(tcp_address):
    """A request of 6,000 empty data frames to a server allowing 100 is refused too_large with its rid (the
    header is kept, the extra frames dropped as they are read), and the server goes on serving everyone."""
    async with Server(tcp_address, HANDLERS, limits=Limits(max_frames=100), name="S[0]") as srv:
        raw = _Raw(srv.address)
        try:
            header = encode(Tensors(name="many", tensors=()), rid=91, sender="raw")[0]
            await raw.sock.send_multipart([header, *([b""] * 6000)])
            reply = await raw.recv()
            assert isinstance(reply, Error) and reply.rid == 91 and reply.code == "too_large"
            assert "6000 data frames exceed the limit of 100" in reply.message
            async with Client(srv.address, limits=Limits(max_frames=100)) as good:
                ok = await good.request(Tensors(name="fine", tensors=tuple(torch.ones(1) for _ in range(100))))
                assert len(ok.tensors) == 100
            await raw.send(Tensors(name="again", tensors=()), rid=92)
            assert (await raw.recv()).name == "again"
        finally:
            raw.close()
        assert srv.stats["errors"] == 1


async def test_a_reply_of_too_many_frames_fails_its_request_at_once(tcp_address):
    """A reply of more frames than the client allows fails the request it answers with too_large (not its
    timeout); the client's next request is served as usual."""
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with Client(f"tcp://127.0.0.1:{port}", limits=Limits(max_frames=10), timeout_s=30) as client:
            async def serve(extra: int) -> None:
                peer, request = (await asyncio.wait_for(router.recv_multipart(), 5))[:2]
                rid = decode([request]).rid
                await router.send_multipart([peer, encode(Ack(), rid=rid, sender="raw")[0], *([b""] * extra)])

            for extra, want in ((5000, "too_large"), (0, "ok")):
                server = asyncio.create_task(serve(extra))
                t0 = time.monotonic()
                try:
                    reply = await client.request(Heartbeat())
                    got = "ok" if isinstance(reply, Ack) else type(reply).__name__
                except ProtocolError as exc:
                    got = exc.code
                    assert "5000 data frames exceed the limit of 10" in str(exc)
                await server
                assert got == want and time.monotonic() - t0 < 5
    finally:
        router.close(linger=0)


async def test_messages_past_the_turns_part_budget_are_all_read(tcp_address):
    """One-way messages of 8 parts each fill the reader's per-turn part budget exactly at a message boundary;
    every one is still served, without any further traffic to wake the reader."""
    seen = []

    async def count(msg, peer):
        seen.append(msg.name)

    async with Server(tcp_address, {Kind.TENSORS: count}) as srv:
        raw = _Raw(srv.address)
        try:
            for i in range(1000):  # routing id, header and 6 one-element tensors: 8 parts
                await raw.send(Tensors(name=str(i), tensors=tuple(torch.ones(1) for _ in range(6))), rid=0)
            for _ in range(500):
                if len(seen) == 1000:
                    break
                await asyncio.sleep(0.01)
            assert seen == [str(i) for i in range(1000)]
        finally:
            raw.close()
