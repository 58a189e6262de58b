"""Asyncio ZeroMQ endpoints: the one place where hmp meets the network.

* :class:`Server` binds a ROUTER socket and dispatches each decoded request to the handler for its
  kind (an explicit table ``{Kind: handler}``). A handler is ``async def on_x(msg, peer) ->
  Message | None``; its return value is sent back with the request's ``rid``. A frame sequence that
  does not decode, a kind with no handler, or a handler raising :class:`RequestError` gets an
  :class:`Error` reply; the server keeps serving everyone else.
* :class:`Client` opens a DEALER socket to one server. ``request()`` sends a message with a fresh
  ``rid`` and returns the reply with that ``rid`` (many may be in flight); an ``Error`` reply raises
  :class:`RemoteError`, no reply in time raises :class:`RequestTimeout`.

Zero-copy rules (both sides): sends go out with ``copy=False``: libzmq reads the tensors' own
memory after ``send`` returns, so a tensor must not be mutated until its message is sent. Pass
``track=True`` to get a ``zmq.MessageTracker`` and ``await wait_sent(tracker)`` before reusing the
buffer. Received messages are decoded with ``copy=False``: their tensors are read-only views over
the receive frames (see :mod:`hmp.transport.codec`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
import zmq
import zmq.asyncio

from hmp.errors import (EndpointClosed, PeerLost, ProtocolError, RemoteError, RequestError, RequestTimeout)
from hmp.messages import Error, Kind, Message
from hmp.transport.codec import DEFAULT_FRAME_BYTES, DEFAULT_LIMITS, Limits, decode, encode, frame_error_rid

Handler = Callable[[Message, bytes], Awaitable[Message | None]]
log = structlog.get_logger("hmp.transport")

# High-water marks in messages. ROUTER silently drops messages for a peer at its HWM; with a high
# mark and ROUTER_MANDATORY a send to a full or vanished peer blocks or fails instead.
HWM = 100_000


def context() -> zmq.asyncio.Context:
    """The process-wide asyncio context (one I/O thread is plenty for loopback at these rates)."""
    return zmq.asyncio.Context.instance()


def _configure(sock: zmq.asyncio.Socket, limits: Limits) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    # libzmq itself refuses a single frame bigger than any message may be, before buffering it.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + limits.max_header_bytes)


async def wait_sent(tracker: zmq.MessageTracker | None, timeout_s: float = 30.0) -> None:
    """Wait until libzmq no longer holds the buffers of a tracked send (bounded)."""
    if tracker is None:
        return
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not tracker.done:
        if asyncio.get_running_loop().time() > deadline:
            raise RequestTimeout("send still pending after {timeout_s} s")
        await asyncio.sleep(0.0005)


class Server:
    """A ROUTER endpoint serving requests with a kind->handler table.

    Use as ``async with Server(addr, handlers, name=...) as srv:``; ``srv.address`` is the bound
    address (a ``tcp://host:0`` bind picks a free port).
    """

    def __init__(self, address: str, handlers: Mapping[Kind, Handler], *, name: str = "server",
                 limits: Limits = DEFAULT_LIMITS, frame_bytes: int = DEFAULT_FRAME_BYTES,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.bind_address = address
        self.address = address
        self.handlers = dict(handlers)
        self.name = name
        self.limits = limits
        self.frame_bytes = frame_bytes
        self._ctx = ctx or context()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()
        self._closing = False
        self.stats = {"requests": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0}
        self.log = log.bind(node=name)

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> str:
        sock = self._ctx.socket(zmq.ROUTER)
        _configure(sock, self.limits)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.bind_address.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.bind_address.removeprefix("ipc://"))
        sock.bind(self.bind_address)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._reader = asyncio.create_task(self._read_loop(), name=f"{self.name}-reader")
        return self.address

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            peer, body = frames[0].bytes, frames[1:]
            self.stats["bytes_in"] += sum(len(f) for f in body)
            if self._closing:
                await self._send_error(peer, frame_error_rid(body) if body else 0, "shutting_down",
                                       f"{self.name} is shutting down")
                continue
            try:
                msg = decode(body, self.limits)
            except ProtocolError as exc:
                self.stats["errors"] += 1
                self.log.warning("bad_message", peer=peer.hex(), code=exc.code, error=str(exc))
                if body:
                    await self._send_error(peer, frame_error_rid(body), exc.code, str(exc))
                continue
            self.stats["requests"] += 1
            handler = self.handlers.get(msg.kind)
            if handler is None:
                self.stats["errors"] += 1
                await self._send_error(peer, msg.rid, "unknown_op",
                                       f"{self.name} does not serve {msg.kind.value!r}; serves "
                                       f"{sorted(k.value for k in self.handlers)}")
                continue
            task = asyncio.create_task(self._dispatch(handler, msg, peer))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _dispatch(self, handler: Handler, msg: Message, peer: bytes) -> None:
        try:
            reply = await handler(msg, peer)
        except RequestError as exc:
            self.stats["errors"] += 1
            await self._send_error(peer, msg.rid, exc.code, str(exc))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a handler bug must not kill the server; the sender hears of it
            self.stats["errors"] += 1
            self.log.exception("handler_failed", kind=msg.kind.value)
            await self._send_error(peer, msg.rid, "internal", f"{exc.__class__.__name__}: {exc}")
            return
        if reply is not None:
            await self.send(peer, reply.replace(rid=msg.rid, sender=self.name))

    async def send(self, peer: bytes, msg: Message, track: bool = False) -> zmq.MessageTracker | None:
        """Send ``msg`` to the client with routing id ``peer`` (zero-copy; see module docstring)."""
        if self._sock is None:
            raise EndpointClosed(f"{self.name} is not started")
        frames = encode(msg, self.frame_bytes)
        self.stats["bytes_out"] += sum(len(memoryview(f)) for f in frames[1:])
        try:
            return await self._sock.send_multipart([peer, *frames], copy=False, track=track)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the peer disconnected before its reply was ready
                self.log.info("reply_unroutable", kind=msg.kind.value)
                return None
            raise

    async def _send_error(self, peer: bytes, rid: int, code: str, text: str) -> None:
        await self.send(peer, Error(sender=self.name, rid=rid, code=code, message=text))

    async def close(self, grace_s: float = 2.0) -> None:
        """Refuse new requests, let in-flight handlers finish for up to ``grace_s``, then close."""
        if self._sock is None:
            return
        self._closing = True
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)
        self._sock = None


class Client:
    """A DEALER endpoint to one server; ``request()`` matches replies to requests by ``rid``."""

    _ids = itertools.count(1)

    def __init__(self, address: str, *, name: str = "client", limits: Limits = DEFAULT_LIMITS,
                 frame_bytes: int = DEFAULT_FRAME_BYTES, timeout_s: float = 30.0,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.address = address
        self.name = name
        self.limits = limits
        self.frame_bytes = frame_bytes
        self.timeout_s = timeout_s
        self._ctx = ctx or context()
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._rids = itertools.count(1)
        self.stats = {"requests": 0, "bytes_in": 0, "bytes_out": 0}
        self.log = log.bind(node=name, peer=address)

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        _configure(sock, self.limits)
        sock.connect(self.address)
        self._sock = sock
        self._reader = asyncio.create_task(self._read_loop(), name=f"{self.name}-reader")

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            self.stats["bytes_in"] += sum(len(f) for f in frames[1:])
            try:
                msg = decode(frames, self.limits)
            except ProtocolError as exc:
                rid = frame_error_rid(frames)
                self.log.warning("bad_reply", code=exc.code, error=str(exc), rid=rid)
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                continue
            fut = self._pending.pop(msg.rid, None)
            if fut is None or fut.done():
                self.log.debug("unmatched_reply", kind=msg.kind.value, rid=msg.rid)
                continue
            if isinstance(msg, Error):
                fut.set_exception(RemoteError(msg.code, msg.message, msg.sender))
            else:
                fut.set_result(msg)

    async def send(self, msg: Message, track: bool = False) -> zmq.MessageTracker | None:
        """Send one message as is (``rid`` 0 for one-way); zero-copy, see the module docstring."""
        if self._sock is None:
            raise EndpointClosed(f"{self.name} is closed")
        frames = encode(msg, self.frame_bytes)
        self.stats["bytes_out"] += sum(len(memoryview(f)) for f in frames[1:])
        return await self._sock.send_multipart(frames, copy=False, track=track)

    async def request(self, msg: Message, timeout_s: float | None = None) -> Message:
        """Send ``msg`` with a fresh rid and return the reply (``Error`` replies raise RemoteError)."""
        if self._sock is None:
            raise EndpointClosed(f"{self.name} is closed")
        rid = next(self._rids)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self.stats["requests"] += 1
        try:
            await self.send(msg.replace(rid=rid, sender=msg.sender or self.name))
            return await asyncio.wait_for(fut, timeout_s if timeout_s is not None else self.timeout_s)
        except TimeoutError:
            raise RequestTimeout(f"{self.name}: no reply to {msg.kind.value} #{rid} from {self.address} "
                                 f"within {timeout_s or self.timeout_s} s") from None
        finally:
            self._pending.pop(rid, None)

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
        if self._sock is None:
            return
        self.fail_pending(EndpointClosed(f"{self.name} closed"))
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)
        self._sock = None


__all__ = ["Client", "Server", "Handler", "context", "wait_sent", "PeerLost"]
