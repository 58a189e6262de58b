"""Receive-side guards on real sockets: over-long messages read in bounded turns and refused, frames over
MAXMSGSIZE dropped before they are buffered, and refused memory given back."""

from __future__ import annotations

import pathlib
import platform
import subprocess
import sys
import time

import pytest
import zmq

from hmp.transport.codec import Limits
from hmp.transport.guard import Overlong, PartReader, max_frame_bytes, overlong_error, release_memory


@pytest.fixture
def pair():
    """A ROUTER bound on loopback and a DEALER connected to it, closed afterwards."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    dealer.close()
    router.close()
    ctx.term()


def _read_all(reader: PartReader, router: zmq.Socket, turns: int = 100):
    """Read until a message (or an Overlong) comes back, one budget per turn; returns it and the turns taken."""
    assert router.poll(5000)
    for turn in range(1, turns + 1):
        reader.turn()
        got = reader.read()
        if got is not None:
            return got, turn
        assert reader.mid_message
    raise AssertionError("no message within the turns")


def test_messages_within_the_limit_come_back_whole(pair):
    router, dealer = pair
    reader = PartReader.for_limits(router, copied=2, limits=Limits(max_frames=4))
    dealer.send_multipart([b"header", b"a", b"bb", b"ccc", b"dddd"])
    got, turns = _read_all(reader, router)
    assert isinstance(got, list) and turns == 1
    assert type(got[0]) is bytes and got[1] == b"header"  # routing id and header copied
    assert [bytes(f.buffer) for f in got[2:]] == [b"a", b"bb", b"ccc", b"dddd"]  # data frames zero-copy


def test_an_over_long_message_is_read_in_bounded_turns_and_refused(pair):
    """6,000 empty frames (a cost the scheduler once paid in one 372 ms callback) are read 1,000 parts per
    turn and come back as an Overlong keeping only the routing id and header; the next message is clean."""
    router, dealer = pair
    limits = Limits(max_frames=100)
    reader = PartReader.for_limits(router, copied=2, limits=limits, parts_per_turn=1000)
    dealer.send_multipart([b"header", *([b""] * 6000)])
    dealer.send_multipart([b"next", b"x"])
    got, turns = _read_all(reader, router)
    assert isinstance(got, Overlong) and got.parts == 6002 and turns == 7  # 6,002 parts at 1,000 a turn
    assert len(got.head) == 2 and got.head[1] == b"header"
    err = overlong_error(got, 2, limits)
    assert err.code == "too_large" and "6000 data frames exceed the limit of 100" in str(err)
    got, _ = _read_all(reader, router)
    assert got[1] == b"next" and bytes(got[2].buffer) == b"x"
    assert reader.overlong == 1


def test_the_turn_budget_spans_messages(pair):
    """The budget is per turn, not per message: a stream of small messages stops at it too, in the middle of
    a message if need be, and the next turn goes on from there."""
    router, dealer = pair
    reader = PartReader(router, copied=2, max_parts=10, parts_per_turn=10)
    for i in range(8):
        dealer.send_multipart([b"m%d" % i, b"x", b"y"])  # 4 parts each with the routing id
    time.sleep(0.2)
    per_turn = []
    got_all = []
    while len(got_all) < 8:
        reader.turn()
        turn = []
        while (got := reader.read()) is not None:
            turn.append(got)
        per_turn.append(len(turn))
        got_all += turn
    assert per_turn == [2, 3, 2, 1]  # 32 parts at 10 a turn: the 3rd and 6th messages span two turns
    assert [m[1] for m in got_all] == [b"m%d" % i for i in range(8)]
    assert all(bytes(m[2].buffer) == b"x" and bytes(m[3].buffer) == b"y" for m in got_all)


def test_an_overlong_keeps_the_header_even_when_only_the_routing_id_is_copied(pair):
    """A server whose header arrives as a zmq.Frame (copied=1) still gets routing id and header back."""
    router, dealer = pair
    reader = PartReader.for_limits(router, copied=1, limits=Limits(max_frames=3), head=2)
    dealer.send_multipart([b"header", b"", b"", b"", b""])
    got, _ = _read_all(reader, router)
    assert isinstance(got, Overlong) and got.parts == 6 and len(got.head) == 2
    assert type(got.head[0]) is bytes and bytes(got.head[1].buffer) == b"header"
    assert "4 data frames exceed the limit of 3" in str(overlong_error(got, 2, Limits(max_frames=3)))


def test_bad_reader_arguments_are_refused(pair):
    with pytest.raises(ValueError, match="max_parts"):
        PartReader(pair[0], copied=2, max_parts=1)


def test_a_frame_over_maxmsgsize_drops_the_connection_before_it_is_buffered():
    """With MAXMSGSIZE from max_frame_bytes (set before bind), a frame over it never arrives (libzmq
    drops the connection at its length prefix), while one at the largest allowed size does."""
    limits = Limits(max_header_bytes=1 << 16)
    frame_bytes = 1 << 20
    cap = max_frame_bytes(limits, frame_bytes)
    assert cap == frame_bytes + 4096
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, cap)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    senders = []
    try:
        for size in (cap + 1, cap):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            senders.append(dealer)
            dealer.send_multipart([b"h", bytes(size)])
        assert router.poll(5000)
        got = router.recv_multipart()
        assert len(got[2]) == cap
        assert not router.poll(300)  # the larger one was dropped, not merely late
    finally:
        for s in senders:
            s.close()
        router.close()
        ctx.term()


_REFUSE_AND_RELEASE = r"""
import asyncio, sys
import torch
from hmp.errors import RemoteError
from hmp.messages import Ack, Kind, Tensors
from hmp.transport.codec import Limits
from hmp.transport import Client, Server, tune_malloc
from hmp.transport.guard import release_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

async def main():
    tune_malloc()
    async def ok(msg, peer):
        return Ack()
    async with Server("tcp://127.0.0.1:0", {Kind.TENSORS: ok}, limits=Limits(max_message_bytes=16 << 20),
                      frame_bytes=4 << 20) as srv, \
            Client(srv.address, limits=Limits(max_message_bytes=1 << 30), frame_bytes=4 << 20) as client:
        await client.request(Tensors(name="warm", tensors=(torch.ones(8),)))
        big = torch.ones(256 << 20, dtype=torch.uint8)  # the sender's; kept all along, in the baseline
        base = rss_mib()
        try:
            await client.request(Tensors(name="big", tensors=(big,)), timeout_s=60)
            code = "accepted"
        except RemoteError as exc:
            code = exc.code
        if sys.argv[1] == "server":  # the server gives it back by itself, on a later callback
            for _ in range(500):
                if srv.stats["memory_releases"]:
                    break
                await asyncio.sleep(0.01)
            held, released = rss_mib(), srv.stats["memory_releases"]
        else:
            held = rss_mib()
            released = release_memory()
        print(code, released, round(base), round(held), round(rss_mib()))
        del big

asyncio.run(main())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_memory_of_a_refused_message_is_given_back():
    """A 256 MiB message over a 16 MiB limit is refused as too_large; the receive buffers that tune_malloc
    keeps mapped on purpose go back to the OS with release_memory() (RSS within 64 MiB of before)."""
    code, released, base, held, after = _refuse_and_release("caller")
    assert code == "too_large" and released in ("True", "False")
    assert int(after) - int(base) < 64, f"RSS {base} MiB before, {held} MiB after the refusal, {after} MiB released"
    assert release_memory() in (True, False)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_server_gives_the_memory_of_a_refused_large_message_back_by_itself():
    """The same refusal with nobody calling release_memory: the server calls it once, after the refused frames
    are dropped, and the RSS is back within 64 MiB of before."""
    code, released, base, held, after = _refuse_and_release("server")
    assert code == "too_large" and released == "1"
    assert int(held) - int(base) < 64, f"RSS {base} MiB before, {held} MiB after the server's release"


def _refuse_and_release(who: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _REFUSE_AND_RELEASE, who], capture_output=True, text=True,
                         timeout=120, cwd=str(pathlib.Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1].split()  # (log lines go first)
