"""Transport tests on real ZeroMQ sockets (tcp://127.0.0.1 and ipc://): no mocks."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from hmp.errors import RemoteError, RequestError, RequestTimeout
from hmp.messages import Ack, Error, Kind, Pull, Tensors
from hmp.transport.codec import DTYPES, Limits, decode, encode
from hmp.transport.endpoint import Client, Server


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
    async with Server(tcp_address, {Kind.TENSORS: keep}) as srv, Client(srv.address) as client:
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
        from hmp.messages import Heartbeat
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
    """Garbage from a raw zmq socket gets error replies (with the request id when readable) while a good client is served."""
    ctx = zmq.asyncio.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    try:
        async with Client(server.address) as good:
            for frames in GARBAGE:
                await raw.send_multipart(frames)
                reply = decode(await asyncio.wait_for(raw.recv_multipart(), 5))
                assert isinstance(reply, Error)
                ok = await good.request(Tensors(name="still", tensors=(torch.ones(3),)))
                assert torch.equal(ok.tensors[0], torch.ones(3))
            rids = []
            for frames in GARBAGE[3:]:
                await raw.send_multipart(frames)
                rids.append(decode(await asyncio.wait_for(raw.recv_multipart(), 5)).rid)
            assert rids == [77, 78, 79]
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
