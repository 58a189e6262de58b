"""A DEALER endpoint to one server: ``request()`` sends a message with a fresh ``rid`` and returns the
reply with that ``rid`` (many may be in flight; an ``Error`` reply raises :class:`RemoteError`, none in
time :class:`RequestTimeout`), ``send()`` sends one-way. It stamps its settings' job token on every
message and refuses to send what a receiver with its limits would refuse (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import zmq

from hmp.errors import EndpointClosed, HmpError, ProtocolError, RemoteError, RequestTimeout
from hmp.messages import Error, Kind, Message
from hmp.transport import guard
from hmp.transport.channel import Channel, log, open_socket
from hmp.transport.codec import decode, encode, frame_error_rid
from hmp.transport.metrics import TransportMetrics
from hmp.transport.ratelimit import RateLimitedLog
from hmp.transport.settings import EndpointSettings, resolve
from hmp.transport.shm_link import ClientShm
from hmp.transport.trust import ClientHandshake


class Client:
    """A DEALER endpoint to one server; ``request()`` matches replies to requests by ``rid``.

    ``close()`` fails the requests still pending with :class:`EndpointClosed`; ``fail_pending``
    fails them with any error (the node layer uses it when it declares the peer lost). ``settings``
    as for :class:`~hmp.transport.Server`; ``on_refused`` is called (from the loop) with each refusal of
    a one-way message (an ``Error`` of ``rid`` 0, see ``Message.refusals_answered``); None: logged
    (rate-limited).
    """

    def __init__(self, address: str, *, name: str = "client", settings: EndpointSettings | None = None,
                 on_refused: Callable[[RemoteError], None] | None = None, **changes: Any) -> None:
        self.settings = settings = resolve(settings, changes)
        self.address, self.name, self.on_refused = address, name, on_refused
        self.limits, self.timeout_s, self.curve = settings.limits, settings.timeout_s, settings.security
        self._handshake: ClientHandshake | None = None
        self._chan: Channel | None = None
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._rids = itertools.count(1)
        self.stats = {"requests": 0, "bytes_in": 0, "bytes_out": 0, "shm_bytes_out": 0, "one_way_refused": 0}
        self.log = log.bind(node=name, peer=address)
        self.warnings = RateLimitedLog(self.log)  # a reconnecting peer fails again and again
        self._shm = ClientShm(self)
        #: the server's node id, from its first reply ("" until then)
        self.peer_id = ""
        self._metrics: TransportMetrics | None = None  # the settings', from connect()

    @property
    def peer_label(self) -> str:
        """Who this client talks to, for the metrics: the server's id once it has replied, else its address."""
        return self.peer_id or self.address

    @property
    def pending(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._pending)

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        sock = open_socket(self.settings, zmq.DEALER)
        try:
            if self.curve is not None:
                self.curve.apply_client(sock)
                self._handshake = ClientHandshake(sock, self.curve, self.name, self.address, self.warnings,
                                                  self.fail_pending)
            sock.connect(self.address)
        except BaseException:
            if self._handshake is not None:
                self._handshake.close()
                self._handshake = None
            sock.close(linger=0)
            raise
        self._chan = Channel(sock, self._on_message, self._on_overlong, copied=1, limits=self.limits, head=1)
        self._shm.loop = self._chan.loop
        self._metrics = self.settings.metrics
        if self._metrics is not None:
            self._metrics.clients.add(self)

    @property
    def shm_active(self) -> bool:
        """Whether shared memory is in use with this server (after a successful handshake)."""
        return self._shm.link is not None

    def _on_overlong(self, m: guard.Overlong) -> None:
        """A reply of more frames than ``limits.max_frames`` (its extra frames dropped unread): the
        request it answers fails with ``too_large``."""
        self.stats["bytes_in"] += m.nbytes - len(m.head[0])
        self._bad_reply(frame_error_rid(m.head), guard.overlong_error(m, 1, self.limits))

    def _bad_reply(self, rid: int, exc: ProtocolError) -> None:
        self.warnings.warning("bad_reply", exc.code, error=str(exc), rid=rid)
        fut = self._pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) > 1:
            self.stats["bytes_in"] += sum(len(f) for f in frames[1:])
        try:
            msg = decode(frames, self.limits, resolve=self._shm.resolve)
        except ProtocolError as exc:
            self._bad_reply(frame_error_rid(frames), exc)
            return
        if not self.peer_id:
            self.peer_id = msg.sender
        if msg.rid == 0 and isinstance(msg, Error):  # a one-way message of ours was refused
            self._refused(RemoteError(msg.code, msg.message, msg.sender, msg.blamed))
            return
        fut = self._pending.pop(msg.rid, None)
        if fut is None or fut.done():
            self.log.debug("unmatched_reply", kind=msg.kind.value, rid=msg.rid)
            return
        if isinstance(msg, Error):
            fut.set_exception(RemoteError(msg.code, msg.message, msg.sender, msg.blamed))
        else:
            fut.set_result(msg)

    def _refused(self, exc: RemoteError) -> None:
        self.stats["one_way_refused"] += 1
        if self.on_refused is None:
            self.warnings.warning("one_way_refused", exc.code, error=str(exc))
            return
        try:
            self.on_refused(exc)
        except Exception:  # the callback's bug must not stop the reader
            self.log.exception("on_refused_failed")

    async def send(self, msg: Message, track: bool = False, *, lend: bool = False) -> zmq.MessageTracker | None:
        """Send one message as is (``rid`` 0 for one-way); zero-copy (docs/protocol.md, "hmp's endpoints").

        ``lend``: tensors in this client's shared-memory arena go by reference when the server
        maps it (an earlier request shook hands; no handshake is started here). No reply says
        when the server is done reading them: the caller knows it from its own protocol (the
        ring: docs/collective.md), and must not write them before."""
        link = self._shm.link if lend else None
        return await self._send(msg, track, locate=self._shm.lender(link, None) if link and link.send else None)

    async def _send(self, msg: Message, track: bool, rid: int | None = None,
                    sender: str | None = None, locate: Any = None) -> zmq.MessageTracker | None:
        if self._chan is None:
            raise EndpointClosed(f"{self.name} is closed")
        frames = encode(msg, self.settings.frame_bytes, rid=rid, sender=sender, locate=locate,
                        job_token=self.settings.job_token or None, limits=self.limits)
        if len(frames) > 1:
            self.stats["bytes_out"] += sum(len(memoryview(f)) for f in frames[1:])
        return await self._chan.send(frames, track)

    async def request(self, msg: Message, timeout_s: float | None = None) -> Message:
        """Send ``msg`` with a fresh rid and return the reply (``Error`` replies raise RemoteError).

        Tensors in this client's shared-memory arena go by reference when the server maps it
        (docs/shm.md); they are lent to the server until the reply arrives."""
        if self._chan is None:
            raise EndpointClosed(f"{self.name} is closed")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        shm = self._shm
        if shm.wants_handshake():
            await shm.maybe_handshake(msg, timeout)
        link = shm.link
        if link is None or not link.send:
            return await self._request(msg, timeout, None)
        used: list[int] = []
        try:
            return await self._request(msg, timeout, shm.lender(link, used))
        except RemoteError as exc:
            if exc.code != "bad_shm" or not used:
                raise
            # The server no longer reads our segments (it restarted, or lost this connection's
            # agreement): once more inline, and shake hands again before the next request.
            self.log.warning("shm_refused", error=exc.remote_message)
            shm.drop(link)
            return await self._request(msg, timeout, None)

    async def _request(self, msg: Message, timeout: float, locate: Any) -> Message:
        if self._chan is None:  # closed while shaking hands
            raise EndpointClosed(f"{self.name} is closed")
        rid = next(self._rids)
        loop = self._chan.loop
        fut: asyncio.Future[Message] = loop.create_future()
        self._pending[rid] = fut
        self.stats["requests"] += 1
        # A timer on the future rather than asyncio.wait_for: same bound, a fraction of the cost.
        timer = loop.call_later(timeout, self._expire, fut, msg.kind, rid, timeout)
        if self._handshake is not None:
            self._handshake.guard(fut)
        metrics = self._metrics
        t0 = time.perf_counter() if metrics is not None else 0.0  # not loop.time(): uvloop's ticks in ms
        try:
            await self._send(msg, False, rid=rid, sender=msg.sender or self.name, locate=locate)
            reply = await fut
            if metrics is not None:
                metrics.observe(type(msg), time.perf_counter() - t0)
            return reply
        except HmpError as exc:
            if metrics is not None:
                if isinstance(exc, RemoteError):  # answered, if with an error: a round trip all the same
                    metrics.observe(type(msg), time.perf_counter() - t0)
                metrics.client_failed(type(msg), exc)
            raise
        finally:
            timer.cancel()
            self._pending.pop(rid, None)

    def _expire(self, fut: asyncio.Future[Message], kind: Kind, rid: int, timeout: float) -> None:
        if not fut.done():
            fut.set_exception(RequestTimeout(f"{self.name}: no reply to {kind.value} #{rid} from {self.address} "
                                             f"within {timeout} s"))

    def fail_pending(self, exc: Exception) -> int:
        """Fail every pending request with ``exc`` (e.g. PeerLost); returns how many."""
        n = 0
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(exc)
                n += 1
        self._pending.clear()
        return n

    async def close(self) -> None:
        if self._chan is None:
            return
        self.fail_pending(EndpointClosed(f"{self.name} closed"))
        self._shm.close()
        if self._handshake is not None:
            self._handshake.close()
            self._handshake = None
        self._chan.close()
        self._chan = None
        self.warnings.flush()
        if self._metrics is not None:
            self._metrics.client_closed(self)
