"""What a process's endpoints count for its metrics endpoint (docs/metrics.md): plain numbers kept per
peer, kind and error code, cheap enough to update per message; :mod:`hmp.metrics` reads them when scraped."""

from __future__ import annotations

import bisect
import weakref
from typing import Any

from hmp.errors import EndpointClosed, PeerLost, ProtocolError, RemoteError, RequestTimeout


class LatencyHistogram:
    """Durations (seconds) counted in the fixed buckets :data:`BOUNDS`, with their sum: what a Prometheus
    histogram exports, kept as plain numbers so that an observation costs a bisect and two additions."""

    #: upper bounds (seconds, inclusive) of the buckets; one more bucket above the last counts the rest
    BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
              10.0, 30.0)
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BOUNDS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.BOUNDS, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(upper bound, observations <= it), ..., (inf, all)]``: Prometheus's ``le`` buckets."""
        out, total = [], 0
        for bound, n in zip((*self.BOUNDS, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out


#: Distinct label values each of TransportMetrics's per-peer and per-code tables keeps; later ones are
#: counted under "other" (a token holder may claim any sender id: the tables must not grow with that).
MAX_LABEL_VALUES = 256


def _bounded(table: dict[str, Any], key: str) -> str:
    return key if key in table or len(table) < MAX_LABEL_VALUES else "other"


class TransportMetrics:
    """What the endpoints whose settings name it count (``EndpointSettings.metrics``). Everything is read on
    the event loop's thread (:func:`hmp.metrics.snapshot`), so plain dicts and ints do.

    Per peer: ``peers[id] = [bytes_in, bytes_out, requests_in, requests_out, shm_bytes_out]``, data-frame
    bytes (the header is not counted, as in ``stats``) received from and sent to node ``id``, and the bytes
    of this process's requests to it that went by shared-memory reference instead: a server counts requests in and
    replies out under the sender id of the requests; a client counts requests out and replies in under
    the id in its server's replies (its address until the first one), folded in here when it closes,
    read from its ``stats`` while it is open (nothing added per message on the client side).
    """

    def __init__(self) -> None:
        self.peers: dict[str, list[int]] = {}
        #: requests a server of this process accepted, by message class (resolved to its kind when read)
        self.served: dict[type, int] = {}
        #: error replies a server of this process sent (or, for one-way messages, would have), by code
        self.server_errors: dict[str, int] = {}
        #: round trips of answered requests (a reply or an error reply) of this process's clients, by class
        self.latency: dict[type, LatencyHistogram] = {}
        #: requests of this process's clients that failed, by (message class, code): the error reply's
        #: code, or timeout, closed, peer_lost
        self.client_errors: dict[tuple[type, str], int] = {}
        self.clients: weakref.WeakSet[Any] = weakref.WeakSet()  # hmp.transport.Client
        self.servers: weakref.WeakSet[Any] = weakref.WeakSet()  # hmp.transport.Server

    def peer(self, peer_id: str) -> list[int]:
        key = _bounded(self.peers, peer_id or "?")
        rec = self.peers.get(key)
        if rec is None:
            rec = self.peers[key] = [0, 0, 0, 0, 0]
        return rec

    def server_error(self, code: str) -> None:
        key = _bounded(self.server_errors, code)
        self.server_errors[key] = self.server_errors.get(key, 0) + 1

    def observe(self, cls: type, seconds: float) -> None:
        """The round trip of one answered request of class ``cls``."""
        hist = self.latency.get(cls)
        if hist is None:
            hist = self.latency[cls] = LatencyHistogram()
        hist.observe(seconds)

    def client_failed(self, cls: type, exc: BaseException) -> None:
        if isinstance(exc, (RemoteError, ProtocolError)):
            code = exc.code
        else:
            code = {RequestTimeout: "timeout", EndpointClosed: "closed", PeerLost: "peer_lost"}.get(type(exc),
                                                                                                   "other")
        key = (cls, code)
        if key not in self.client_errors and len(self.client_errors) >= MAX_LABEL_VALUES:
            key = (cls, "other")
        self.client_errors[key] = self.client_errors.get(key, 0) + 1

    def client_closed(self, client: Any) -> None:
        """Fold a closing client's counts into its peer's (they would vanish with it)."""
        self.clients.discard(client)
        rec = self.peer(client.peer_label)
        st = client.stats
        rec[0] += st["bytes_in"]
        rec[1] += st["bytes_out"]
        rec[3] += st["requests"]
        rec[4] += st["shm_bytes_out"]
