"""One EndpointSettings configures a daemon's server and its clients; endpoints given none take the process's."""

from __future__ import annotations

import pytest

from hmp.errors import RemoteError
from hmp.messages import Ack, Heartbeat, Kind
from hmp.transport import Client, EndpointSettings, Server, TransportMetrics, set_process_settings


async def test_one_settings_object_configures_a_server_and_its_clients(tcp_address):
    """The server and the clients share the job's token and metrics; a client with the token changed is
    refused; a client opened with no settings speaks for the job while they are the process's."""
    metrics = TransportMetrics()
    job = EndpointSettings(job_token="j" * 32, metrics=metrics, timeout_s=5.0)

    async def heartbeat(msg, peer):
        return Ack(detail=msg.sender)

    async with Server(tcp_address, {Kind.HEARTBEAT: heartbeat}, name="srv", settings=job) as srv:
        async with Client(srv.address, name="w", settings=job) as c:
            assert (await c.request(Heartbeat())).detail == "w"
        async with Client(srv.address, name="stranger", settings=job.but(job_token="")) as c:
            with pytest.raises(RemoteError) as info:
                await c.request(Heartbeat())
            assert info.value.code == "unauthorized"
        set_process_settings(job)
        try:
            async with Client(srv.address, name="ring") as c:  # no settings: the process's
                assert (await c.request(Heartbeat())).detail == "ring"
        finally:
            set_process_settings(None)
        async with Client(srv.address, name="late") as c:  # reset: open again, so refused
            with pytest.raises(RemoteError):
                await c.request(Heartbeat())
    assert metrics.served == {Heartbeat: 2} and metrics.server_errors == {"unauthorized": 2}
    assert metrics.latency[Heartbeat].count == 3  # w, stranger (answered, if refused), ring; not late
    assert metrics.client_errors == {(Heartbeat, "unauthorized"): 1}
