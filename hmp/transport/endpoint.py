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
``track=True`` to get a ``zmq.MessageTracker`` (covering every zero-copy frame of the message) and
``await wait_sent(tracker)`` before reusing the buffer. Received data frames are taken with
``copy=False``: their tensors are read-only views over the receive frames (see
:mod:`hmp.transport.codec`).

How the sockets meet asyncio
----------------------------
The sockets are plain (synchronous) pyzmq sockets driven by the running loop: a reader callback on
libzmq's notification FD receives with ``NOBLOCK`` until the socket is empty, and sends go out with
``NOBLOCK`` directly from the calling coroutine. This replaces ``zmq.asyncio``, whose per-call
futures, enum flag arithmetic and edge re-scheduling cost more than decoding a control message
(bench/transport.py: one-way rate 24k/s -> 60k+/s). libzmq's FD is edge-triggered (it signals state
changes, not pending messages, and any socket call may consume a signal), hence the two rules
here: drain until ``EAGAIN``, and look again after every send.

For large tensors, call :func:`tune_malloc` once at process start (see there).
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import contextvars
import ctypes
import itertools
import os
import platform
import sys
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

# Plain ints: pyzmq's flag enums cost an enum operation per use, and these are used per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

#: Messages handled per reader callback before other callbacks get a turn (fairness under floods).
_BURST = 256


def context() -> zmq.asyncio.Context:
    """The process-wide context (one I/O thread is plenty for loopback at these rates).

    Endpoints open plain sockets in it; any ``zmq.Context`` may be passed as ``ctx`` instead.
    """
    return zmq.asyncio.Context.instance()


# asyncio.Task(..., eager_start=True) exists from Python 3.12 (see Server._on_message).
_EAGER_TASKS = sys.version_info >= (3, 12)


def tune_malloc(retain_bytes: int = 1 << 30) -> bool:
    """Let large received frames reuse memory instead of faulting in fresh pages; call once, early.

    libzmq mallocs a buffer for every frame it receives. glibc serves blocks of 32 MiB and more
    (and, in a thread's own arena, anything near its 64 MiB heap size) with a fresh ``mmap`` that
    is unmapped again on free, so every large message costs one page fault per 4 KiB on the
    receiving I/O thread: ~16k faults, as long as the 64 MiB transfer itself (bench/transport.py).
    This sets, process-wide, one malloc arena (so the I/O thread shares the main heap), no ``mmap``
    for large blocks, and a trim threshold of ``retain_bytes``: freed receive buffers stay mapped
    and the next message reuses them without faults.

    Call it before the first socket is created (libzmq's I/O thread picks its arena at its first
    allocation). Cost: up to ``retain_bytes`` of freed heap stays with the process, and memory
    freed below live allocations is reused rather than returned to the OS. Returns False, changing
    nothing, where the C library is not glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # from glibc's <malloc.h>
    ok = mallopt(m_arena_max, 1) == 1
    ok = mallopt(m_mmap_max, 0) == 1 and ok
    return mallopt(m_trim_threshold, int(retain_bytes)) == 1 and ok


def _configure(sock: zmq.Socket, limits: Limits, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # libzmq itself refuses a single frame bigger than any message may be, before buffering it.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + limits.max_header_bytes)


async def wait_sent(tracker: zmq.MessageTracker | None, timeout_s: float = 30.0) -> None:
    """Wait until libzmq no longer holds the buffers of a tracked send (bounded)."""
    if tracker is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not tracker.done:
        if loop.time() > deadline:
            raise RequestTimeout(f"send still pending after {timeout_s} s")
        await asyncio.sleep(0.0005)


class _Channel:
    """A synchronous zmq socket driven by the running loop (see the module docstring).

    ``on_message(parts)`` gets each received multipart message: the first ``copied`` parts as
    ``bytes`` (routing id, header: small), the rest as zero-copy ``zmq.Frame``.
    """

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[Any]], None], copied: int) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._copied = copied
        self._fd = sock.getsockopt(zmq.FD)
        self._scheduled = False
        self._closed = False
        self._waiting = 0  # sends waiting for room; later sends queue behind them to keep order
        self._send_lock = asyncio.Lock()
        self.loop.add_reader(self._fd, self._drain)
        self._schedule()  # messages may have arrived before the reader was registered

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock, copied = self.sock, self._copied
        for _ in range(_BURST):
            try:
                parts = [sock.recv(_NOBLOCK)]
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # context terminated under us: nothing more will come
                log.warning("reader_stopped", error=str(exc))
                self.close()
                return
            # Once the first part is readable, the whole multipart message is (libzmq delivers
            # messages atomically), so NOBLOCK never fails below.
            while sock.get(_RCVMORE):
                parts.append(sock.recv(_NOBLOCK, copy=len(parts) < copied))
            try:
                self._on_message(parts)
            except Exception:  # a bug in one message's handling must not stop the reader
                log.exception("on_message_failed")
        self._schedule()  # more may be waiting: continue after other callbacks had a turn

    def _send_now(self, frames: list[Any], track: bool) -> zmq.MessageTracker | None:
        sock = self.sock
        last = len(frames) - 1
        trackers = []
        # First part: EAGAIN (no room) means nothing was queued; the caller waits and retries.
        t = sock.send(frames[0], _NOBLOCK | (_SNDMORE if last else 0), copy=False, track=track)
        if track and t is not None and not t.done:
            trackers.append(t)
        for i in range(1, last + 1):
            try:
                t = sock.send(frames[i], _NOBLOCK | (_SNDMORE if i < last else 0), copy=False, track=track)
            except zmq.ZMQError as exc:
                # Only a pipe torn down mid-message gets here. libzmq now drops the message's
                # remaining parts: hand them over anyway so that the next message starts clean.
                for j in range(i + 1, last + 1):
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send(frames[j], _NOBLOCK | (_SNDMORE if j < last else 0), copy=False)
                raise PeerLost(f"connection lost while sending ({exc})") from exc
            if track and t is not None and not t.done:
                trackers.append(t)
        self._schedule()  # the send may have consumed the FD's signal of an arrival
        if not track:
            return None
        # pyzmq returns only the last part's tracker, which is "done" at once when that part was
        # small enough to be copied: track every zero-copy part instead.
        return trackers[0] if len(trackers) == 1 else zmq.MessageTracker(*trackers)

    async def send(self, frames: list[Any], track: bool) -> zmq.MessageTracker | None:
        if self._closed:
            raise EndpointClosed("socket closed")
        if not self._waiting:
            try:
                return self._send_now(frames, track)
            except zmq.Again:
                pass
        # No room (high-water mark, or a ROUTER peer whose pipe is full): wait, in arrival order.
        self._waiting += 1
        try:
            async with self._send_lock:
                delay = 0.0002
                while True:
                    if self._closed:
                        raise EndpointClosed("socket closed")
                    try:
                        return self._send_now(frames, track)
                    except zmq.Again:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 0.01)
        finally:
            self._waiting -= 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)


_STARTED = object()


class _Resume(collections.abc.Coroutine):
    """The rest of a coroutine whose first step already ran outside any Task.

    A Task driving this first gets what that step yielded (the future the coroutine waits on),
    then every send/throw goes straight to the coroutine: the Task drives it as if it had run the
    first step itself, cancellation included.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: collections.abc.Coroutine, first: Any) -> None:
        self._coro, self._first = coro, first

    def send(self, value: Any) -> Any:
        if self._first is not _STARTED:
            first, self._first = self._first, _STARTED
            return first
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._first = _STARTED
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        raise TypeError("_Resume is driven by a Task only")


class Server:
    """A ROUTER endpoint serving requests with a kind->handler table.

    Use as ``async with Server(addr, handlers, name=...) as srv:``; ``srv.address`` is the bound
    address (a ``tcp://host:0`` bind picks a free port).

    With ``eager=True`` (the default) a handler starts at once, in the reader callback, and only
    one that suspends gets a Task (as with Python 3.12's eager task factory). Up to its first
    suspension ``asyncio.current_task()`` is therefore None: a handler must not enter
    ``asyncio.timeout()`` before its first ``await`` of something pending (``eager=False``
    gives every request its own Task from the start).
    """

    def __init__(self, address: str, handlers: Mapping[Kind, Handler], *, name: str = "server",
                 limits: Limits = DEFAULT_LIMITS, frame_bytes: int = DEFAULT_FRAME_BYTES,
                 ctx: zmq.Context | None = None, eager: bool = True, hwm: int = HWM) -> None:
        self.bind_address = address
        self.address = address
        self.handlers = dict(handlers)
        self.name = name
        self.limits = limits
        self.frame_bytes = frame_bytes
        self.eager = eager
        self.hwm = hwm
        self._ctx = ctx or context()
        self._chan: _Channel | None = None
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
        sock = self._ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        try:
            _configure(sock, self.limits, self.hwm)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self.bind_address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.bind_address.removeprefix("ipc://"))
            sock.bind(self.bind_address)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            sock.close(linger=0)
            raise
        self._chan = _Channel(sock, self._on_message, copied=2)
        return self.address

    def _on_message(self, frames: list[Any]) -> None:
        peer, body = frames[0], frames[1:]
        stats = self.stats
        stats["bytes_in"] += len(body[0]) if len(body) == 1 else sum(len(f) for f in body)
        if self._closing:
            self._reply_error(peer, frame_error_rid(body) if body else 0, "shutting_down",
                              f"{self.name} is shutting down")
            return
        try:
            msg = decode(body, self.limits)
        except ProtocolError as exc:
            stats["errors"] += 1
            self.log.warning("bad_message", peer=peer.hex(), code=exc.code, error=str(exc))
            if body:
                self._reply_error(peer, frame_error_rid(body), exc.code, str(exc))
            return
        stats["requests"] += 1
        handler = self.handlers.get(msg.kind)
        if handler is None:
            stats["errors"] += 1
            self._reply_error(peer, msg.rid, "unknown_op", f"{self.name} does not serve {msg.kind.value!r}; "
                              f"serves {sorted(k.value for k in self.handlers)}")
            return
        coro = self._dispatch(handler, msg, peer)
        if not self.eager:
            self._track(self._chan.loop.create_task(coro))  # type: ignore[union-attr]
            return
        # Start the handler right here: most handlers finish without suspending, and a Task per
        # request costs more than the rest of the request (~5-10 us, bench/transport.py). One that
        # suspends continues in a Task of its own.
        ctx = contextvars.copy_context()  # what create_task would give it
        if _EAGER_TASKS:
            # Python 3.12+: a real eager task. Its first step runs inside the Task, so a handler
            # may start a timeout (asyncio.wait_for/timeout need a current task from 3.12 on)
            # before it first suspends.
            task = asyncio.Task(coro, loop=self._chan.loop, context=ctx, eager_start=True)  # type: ignore[union-attr]
            if not task.done():
                self._track(task)
            return
        try:
            first = ctx.run(coro.send, None)
        except StopIteration:
            return
        self._track(self._chan.loop.create_task(_Resume(coro, first), context=ctx))  # type: ignore[union-attr]

    def _track(self, task: asyncio.Task) -> None:
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    def _reply_error(self, peer: bytes, rid: int, code: str, text: str) -> None:
        # Called from the reader callback, which cannot await: the reply goes out at once when
        # there is room (the usual case), else from a task like any other reply.
        chan = self._chan
        assert chan is not None
        if not chan._waiting:
            frames = [peer, *encode(Error(code=code, message=text), self.frame_bytes, rid=rid, sender=self.name)]
            try:
                chan._send_now(frames, False)
                return
            except zmq.Again:
                pass
            except (zmq.ZMQError, PeerLost) as exc:  # EHOSTUNREACH: the peer left meanwhile
                self.log.info("error_reply_unroutable", code=code, error=str(exc))
                return
        self._track(chan.loop.create_task(self._send_error(peer, rid, code, text)))

    async def _dispatch(self, handler: Handler, msg: Message, peer: bytes) -> None:
        try:
            reply = await handler(msg, peer)
        except RequestError as exc:
            self.stats["errors"] += 1
            await self._send_error(peer, msg.rid, exc.code, str(exc))
            return
        except asyncio.CancelledError:
            if self._closing and self._chan is not None:
                # close() cancels handlers still running after its grace period: tell the sender
                # now instead of leaving it to wait out its request timeout.
                self._reply_error(peer, msg.rid, "shutting_down",
                                  f"{self.name} shut down before answering {msg.kind.value!r}")
            raise
        except Exception as exc:  # a handler bug must not kill the server; the sender hears of it
            self.stats["errors"] += 1
            self.log.exception("handler_failed", kind=msg.kind.value)
            await self._send_error(peer, msg.rid, "internal", f"{exc.__class__.__name__}: {exc}")
            return
        if reply is not None and msg.rid != 0:  # rid 0: a one-way message, nobody waits for a reply
            await self._send(peer, reply, False, rid=msg.rid, sender=self.name)

    async def send(self, peer: bytes, msg: Message, track: bool = False) -> zmq.MessageTracker | None:
        """Send ``msg`` to the client with routing id ``peer`` (zero-copy; see module docstring)."""
        return await self._send(peer, msg, track)

    async def _send(self, peer: bytes, msg: Message, track: bool, rid: int | None = None,
                    sender: str | None = None) -> zmq.MessageTracker | None:
        if self._chan is None:
            raise EndpointClosed(f"{self.name} is not started")
        frames = encode(msg, self.frame_bytes, rid=rid, sender=sender)
        if len(frames) > 1:
            self.stats["bytes_out"] += sum(len(memoryview(f)) for f in frames[1:])
        try:
            return await self._chan.send([peer, *frames], track)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the peer disconnected before its reply was ready
                self.log.info("reply_unroutable", kind=msg.kind.value)
                return None
            raise

    async def _send_error(self, peer: bytes, rid: int, code: str, text: str) -> None:
        try:
            await self._send(peer, Error(code=code, message=text), False, rid=rid, sender=self.name)
        except EndpointClosed:
            pass

    async def close(self, grace_s: float = 2.0) -> None:
        """Refuse new requests, let in-flight handlers finish for up to ``grace_s``, then close."""
        if self._chan is None:
            return
        self._closing = True
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        self._chan.close()
        self._chan = None


class Client:
    """A DEALER endpoint to one server; ``request()`` matches replies to requests by ``rid``."""

    _ids = itertools.count(1)

    def __init__(self, address: str, *, name: str = "client", limits: Limits = DEFAULT_LIMITS,
                 frame_bytes: int = DEFAULT_FRAME_BYTES, timeout_s: float = 30.0,
                 ctx: zmq.Context | None = None, hwm: int = HWM) -> None:
        self.address = address
        self.name = name
        self.limits = limits
        self.frame_bytes = frame_bytes
        self.timeout_s = timeout_s
        self.hwm = hwm
        self._ctx = ctx or context()
        self._chan: _Channel | None = None
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
        sock = self._ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        try:
            _configure(sock, self.limits, self.hwm)
            sock.connect(self.address)
        except BaseException:
            sock.close(linger=0)
            raise
        self._chan = _Channel(sock, self._on_message, copied=1)

    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) > 1:
            self.stats["bytes_in"] += sum(len(f) for f in frames[1:])
        try:
            msg = decode(frames, self.limits)
        except ProtocolError as exc:
            rid = frame_error_rid(frames)
            self.log.warning("bad_reply", code=exc.code, error=str(exc), rid=rid)
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(exc)
            return
        fut = self._pending.pop(msg.rid, None)
        if fut is None or fut.done():
            self.log.debug("unmatched_reply", kind=msg.kind.value, rid=msg.rid)
            return
        if isinstance(msg, Error):
            fut.set_exception(RemoteError(msg.code, msg.message, msg.sender))
        else:
            fut.set_result(msg)

    async def send(self, msg: Message, track: bool = False) -> zmq.MessageTracker | None:
        """Send one message as is (``rid`` 0 for one-way); zero-copy, see the module docstring."""
        return await self._send(msg, track)

    async def _send(self, msg: Message, track: bool, rid: int | None = None,
                    sender: str | None = None) -> zmq.MessageTracker | None:
        if self._chan is None:
            raise EndpointClosed(f"{self.name} is closed")
        frames = encode(msg, self.frame_bytes, rid=rid, sender=sender)
        if len(frames) > 1:
            self.stats["bytes_out"] += sum(len(memoryview(f)) for f in frames[1:])
        return await self._chan.send(frames, track)

    async def request(self, msg: Message, timeout_s: float | None = None) -> Message:
        """Send ``msg`` with a fresh rid and return the reply (``Error`` replies raise RemoteError)."""
        if self._chan is None:
            raise EndpointClosed(f"{self.name} is closed")
        rid = next(self._rids)
        loop = self._chan.loop
        fut: asyncio.Future[Message] = loop.create_future()
        self._pending[rid] = fut
        self.stats["requests"] += 1
        timeout = self.timeout_s if timeout_s is None else timeout_s
        # A timer on the future rather than asyncio.wait_for: same bound, a fraction of the cost.
        timer = loop.call_later(timeout, self._expire, fut, msg.kind, rid, timeout)
        try:
            await self._send(msg, False, rid=rid, sender=msg.sender or self.name)
            return await fut
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
        self._chan.close()
        self._chan = None


__all__ = ["Client", "Server", "Handler", "context", "tune_malloc", "wait_sent", "PeerLost"]
