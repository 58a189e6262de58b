"""What an endpoint is configured with, as one frozen object: a daemon builds one at start
(:meth:`hmp.nodes.base.Node.run`) and every Server and Client it opens shares it, instead of each
constructor taking a dozen keywords and reading process-wide globals. The process default
(:func:`set_process_settings`) is the one hook left for endpoints opened by code that is not handed the
daemon's settings (the ring, the PS client): it is set once per daemon and reset when it stops."""

from __future__ import annotations

import dataclasses
from typing import Any

from hmp.transport.codec import DEFAULT_FRAME_BYTES, DEFAULT_LIMITS, Limits
from hmp.transport.metrics import TransportMetrics
from hmp.transport.security import Curve
from hmp.transport.shm import Arena


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointSettings:
    """What a Server or Client needs beyond its address and name (docs/protocol.md)."""

    #: message limits, both sides (a client refuses to send what such a receiver would refuse)
    limits: Limits = DEFAULT_LIMITS
    frame_bytes: int = DEFAULT_FRAME_BYTES
    #: the job's identity (docs/protocol.md, "Trust"): stamped on every message a client sends; a server
    #: refuses a message whose token differs ``unauthorized``; "": open
    job_token: str = ""
    #: CURVE keys (:mod:`hmp.transport.security`); None: plain
    security: Curve | None = None
    #: shared memory (docs/shm.md): an Arena, True (the process arena, a client shaking hands before its
    #: first request), False (never), or None (the process arena, a client shaking hands before the
    #: first request that carries its memory)
    shm: Arena | bool | None = None
    #: what the endpoints count for the metrics endpoint (None: nothing)
    metrics: TransportMetrics | None = None
    #: a client's request timeout (seconds)
    timeout_s: float = 30.0
    #: send and receive high-water mark (None: SEND_HWM, and hwm_for(limits, frame_bytes) receiving)
    hwm: int | None = None
    #: the zmq context to open sockets in (None: the process's, hmp.transport.channel.context)
    ctx: Any = None

    def but(self, **changes: Any) -> EndpointSettings:
        """These settings with the ``changes`` that are not None (``security=False``: plain)."""
        given = {k: v for k, v in changes.items() if v is not None}
        curve = given.pop("security", True)
        if curve is not True:  # True, like None: these settings' keys
            given["security"] = curve or None
        return dataclasses.replace(self, **given) if given else self


_process = EndpointSettings()


def set_process_settings(settings: EndpointSettings | None) -> None:
    """The settings of this process's endpoints that are given none (None: the defaults, open and plain)."""
    global _process
    _process = settings or EndpointSettings()


def process_settings() -> EndpointSettings:
    """What :func:`set_process_settings` set."""
    return _process


def resolve(settings: EndpointSettings | None, changes: dict[str, Any]) -> EndpointSettings:
    """An endpoint's settings: ``settings`` (None: the process's) with its keyword ``changes``."""
    return (process_settings() if settings is None else settings).but(**changes)
