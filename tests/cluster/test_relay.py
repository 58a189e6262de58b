"""The relay through which a launcher reaches a daemon in an emulated host (hmp/launcher/relay.py): a Unix socket
forwarded to a TCP address, over which hmp's client speaks to hmp's server as it would over TCP."""

from __future__ import annotations

import asyncio
import sys

from hmp.messages import Kind, Status
from hmp.transport.endpoint import Client, Server


async def test_a_client_on_the_relays_unix_socket_reaches_the_tcp_server(tmp_path):
    async def on_status(msg, peer):
        return Status(state={"answered": "over tcp"})

    async with Server("tcp://127.0.0.1:0", {Kind.STATUS: on_status}, name="scheduler", job_token="t") as server:
        path = tmp_path / "scheduler.sock"
        relay = await asyncio.create_subprocess_exec(sys.executable, "-m", "hmp.launcher.relay", str(path),
                                                     server.address, stdin=asyncio.subprocess.PIPE)
        try:
            async with Client(f"ipc://{path}", name="launcher", timeout_s=30, job_token="t") as client:
                for _ in range(2):  # one connection, several requests
                    reply = await client.request(Status(), timeout_s=30)
                    assert reply.state == {"answered": "over tcp"}
            relay.stdin.close()  # the launcher is done (or died): the relay ends
            assert await asyncio.wait_for(relay.wait(), 30) == 0
        finally:
            if relay.returncode is None:
                relay.kill()
                await relay.wait()
