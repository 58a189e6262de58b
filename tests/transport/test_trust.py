"""Trust checks on endpoints in one process."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from structlog.testing import capture_logs

from hmp.errors import RemoteError
from hmp.messages import Ack, Heartbeat, Kind
from hmp.transport.endpoint import Client, Server
from tests.support import curve_keys

TOKEN = "a" * 32


async def test_a_storm_of_bad_messages_logs_a_few_lines_with_counts():
    """1000 malformed messages (and 200 with a wrong token) are logged as one line per code at once, then one
    summary line per code with the count; the server keeps answering."""
    async def heartbeat(msg, peer):
        return Ack()

    with capture_logs() as logs:
        async with Server("tcp://127.0.0.1:0", {Kind.HEARTBEAT: heartbeat}, name="target", job_token=TOKEN) as srv:
            srv.warnings.interval_s = 0.5
            ctx = zmq.Context.instance()
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            try:
                raw.connect(srv.address)
                for i in range(1000):
                    raw.send(b"\xc1 not msgpack %d" % i)
                async with Client(srv.address, name="other-job", job_token="b" * 32, timeout_s=5) as wrong, \
                        Client(srv.address, name="w", job_token=TOKEN, timeout_s=5) as good:
                    for _ in range(200):
                        await wrong.send(Heartbeat())  # one-way: refused, never answered
                    assert isinstance(await good.request(Heartbeat()), Ack)  # during the storm: still served
                    deadline = time.monotonic() + 10  # (closing a client drops what it has not sent yet)
                    while srv.stats["errors"] < 1200 and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.8)  # one summary interval
                    assert isinstance(await good.request(Heartbeat()), Ack)
            finally:
                raw.close(linger=0)
    assert srv.stats["errors"] == 1200 and srv.stats["unauthorized"] == 200
    bad = [e for e in logs if e["event"] == "bad_message"]
    refused = [e for e in logs if e["event"] == "unauthorized"]
    assert 2 <= len(bad) <= 4, bad
    assert 2 <= len(refused) <= 4, refused
    assert sum(e.get("count", 1) for e in bad) == 1000
    assert sum(e.get("count", 1) for e in refused) == 200
    assert any(e.get("count", 0) >= 900 for e in bad)


async def test_curve_binds_sender_ids_to_keys_and_a_wrong_key_fails_within_the_handshake_timeout(tmp_path):
    """With CURVE: a known key is served and speaks only for its own name (or its own clients' names); a key
    outside the key folder, and a client holding another job's server key, fail with HandshakeFailed naming the
    address within the handshake timeout; the refusal is in the server's log; the server keeps serving."""
    from hmp.transport.security import Curve, HandshakeFailed

    job = curve_keys(tmp_path / "job", "ps0", "cpu0", clients=("probe",))
    other = curve_keys(tmp_path / "other", "cpu0")

    async def heartbeat(msg, peer):
        return Ack(detail=msg.sender)

    with capture_logs() as logs:
        server_curve = Curve.load(job, "ps0", handshake_timeout_s=1.0)
        async with Server("tcp://127.0.0.1:0", {Kind.HEARTBEAT: heartbeat}, name="ps0", security=server_curve) as srv:
            mine = Curve.load(job, "cpu0", serve=False, handshake_timeout_s=1.0)
            async with Client(srv.address, name="cpu0", security=mine, timeout_s=10) as c:
                assert (await c.request(Heartbeat())).detail == "cpu0"
                assert (await c.request(Heartbeat(sender="cpu0-eval"))).detail == "cpu0-eval"
                for claimed in ("ps0", "probe", "scheduler"):
                    with pytest.raises(RemoteError) as info:
                        await c.request(Heartbeat(sender=claimed))
                    assert info.value.code == "unauthorized" and "'cpu0'" in info.value.remote_message
            stranger = Curve.load(other, "cpu0", serve=False, handshake_timeout_s=1.0)
            unknown_key = Curve(stranger.key_dir, "cpu0", stranger.public, stranger.secret, mine.server_public, None,
                                {}, 1.0)  # the job's server key, but a client key the job never issued
            for curve in (unknown_key, stranger):
                t0 = time.monotonic()
                async with Client(srv.address, name="cpu0", security=curve, timeout_s=30) as c:
                    with pytest.raises(HandshakeFailed) as failed:
                        await c.request(Heartbeat())
                assert time.monotonic() - t0 < 1.0 + 1.5
                assert srv.address in str(failed.value) and "CURVE handshake" in str(failed.value)
            async with Client(srv.address, name="probe", security=Curve.load(job, "probe", serve=False),
                              timeout_s=10) as c:
                assert (await c.request(Heartbeat())).detail == "probe"  # still serving
    refused = [e for e in logs if e["event"] == "curve_refused"]
    assert refused and refused[0]["peer"] == "127.0.0.1" and refused[0]["code"] == "unknown_key"
    assert refused[0]["public_key"] == unknown_key.public.decode()
    failed = [e for e in logs if e["event"] == "curve_handshake_failed" and e.get("node") == "ps0"]
    assert failed and "another job's server.key" in failed[0]["error"]  # the wrong server key, seen by the server
