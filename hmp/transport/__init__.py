"""hmp's network: the wire codec (pure: :mod:`.codec`), asyncio ZeroMQ endpoints (:class:`Server`,
:class:`Client`, configured by one :class:`EndpointSettings`) and shared memory between peers on one
host (:mod:`.shm`, docs/shm.md). The endpoints are built from a socket driven by the loop
(:mod:`.channel`), trust checks (:mod:`.trust`), the shared-memory handshake (:mod:`.shm_link`) and
traffic counters (:mod:`.metrics`); docs/protocol.md says what they promise on the wire."""

from hmp.transport.channel import context, hwm_for, tune_malloc, wait_sent
from hmp.transport.client import Client
from hmp.transport.metrics import LatencyHistogram, TransportMetrics
from hmp.transport.server import Handler, Reply, Server
from hmp.transport.settings import EndpointSettings, process_settings, set_process_settings
from hmp.transport.trust import Authorize

__all__ = ["Authorize", "Client", "EndpointSettings", "Handler", "LatencyHistogram", "Reply", "Server",
           "TransportMetrics", "context", "hwm_for", "process_settings", "set_process_settings", "tune_malloc",
           "wait_sent"]
