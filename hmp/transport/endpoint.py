"""Asyncio ZeroMQ endpoints: the one place where hmp meets the network.

* :class:`Server` binds a ROUTER socket and dispatches each decoded request to the handler for its
  kind (an explicit table ``{Kind: handler}``). A handler is ``async def on_x(msg, peer) ->
  Message | Reply | None`` and never sends anything itself: the server sends what it returns, with
  the request's ``rid`` (a :class:`Reply` wraps a message whose zero-copy buffers the handler
  wants to hear about: the server calls its ``on_sent`` once libzmq has let go of them). A frame
  sequence that does not decode, a kind with no handler, or a handler raising
  :class:`RequestError` gets an :class:`Error` reply; the server keeps serving everyone else.
* One-way rule: a message with ``rid`` 0 is never answered, not even with an error (a decode
  error whose ``rid`` cannot be read counts as ``rid`` 0 too), and not at shut-down; except that
  a read message of a kind with ``refusals_answered`` (``ring`` pieces) that is refused gets its
  ``Error`` with ``rid`` 0, which the client passes to its ``on_refused`` callback.
* Backpressure: a server runs at most ``limits.max_inflight_requests`` requests at once (handlers
  that suspended, replies waiting for room); at the cap it stops reading its socket, so requests
  queue in libzmq and then in the peers (their sends wait) until a request finishes. Receive
  high-water marks are sized to memory (:func:`hwm_for`), not to a message count.
* Limits (:class:`~hmp.transport.codec.Limits`, both sides): a client refuses to send what a
  receiver with its limits would refuse (``ProtocolError`` ``too_large``, raised by ``send`` and
  ``request`` before anything leaves), and a server answers a handler's reply over them with an
  ``Error`` of that code instead. Receiving, parts are read a bounded number per turn of the loop
  and a message of more than ``limits.max_frames`` data frames is dropped as it is read and
  refused ``too_large`` (:mod:`hmp.transport.guard`); after refusing a message of 64 MiB or more a
  server gives the memory back to the OS (at most once a second).
* Trust (docs/protocol.md, "Trust"): a server with a ``job_token`` answers a message whose token
  differs (or is missing) ``unauthorized`` before anything else, then asks ``authorize(msg, peer)``
  (the node's who-may-send-what table) before the handler; with CURVE (``security``, see
  :mod:`hmp.transport.security`) it also checks that the sender id is its key's. A client stamps its
  ``job_token`` on every message; replies carry none. ``None`` for either option means this
  process's setting (:func:`set_process_job_token`, ``security.set_process_security``), which a
  daemon sets once. Warnings a peer can cause per message (``bad_message``, ``unauthorized``) are
  rate-limited (:mod:`hmp.transport.ratelimit`).
* :class:`Client` opens a DEALER socket to one server. ``request()`` sends a message with a fresh
  ``rid`` and returns the reply with that ``rid`` (many may be in flight); an ``Error`` reply raises
  :class:`RemoteError`, no reply in time raises :class:`RequestTimeout`.
* Metrics (docs/metrics.md): with :func:`set_process_metrics` (a daemon with ``[metrics] enabled``),
  the endpoints this process opens afterwards also count into its :class:`TransportMetrics`: per
  peer bytes and requests, requests by kind, request latency by kind, errors by code. Plain
  numbers (a dict increment or two per message); :mod:`hmp.metrics` reads them when scraped.

Zero-copy rules (both sides): sends go out with ``copy=False``: libzmq reads the tensors' own
memory after ``send`` returns, so a tensor must not be mutated until its message is sent. Pass
``track=True`` to ``Client.send`` to get a ``zmq.MessageTracker`` (covering every zero-copy frame
of the message) and ``await wait_sent(tracker)`` before reusing the buffer; a handler's reply
does the same with ``Reply(msg, on_sent)``. Received data frames are taken with ``copy=False``:
their tensors are read-only views over the receive frames (see :mod:`hmp.transport.codec`).

No busy waiting: the event loop shares the machine with libzmq's I/O thread, and uvloop turns a
sleep under 0.5 ms into an immediate reschedule, i.e. a spin. A send that finds no room waits for
the socket's FD to signal a state change (room freed, a peer connected), with a fallback poll of
1-5 ms in case that edge was consumed elsewhere; :func:`wait_sent` polls its tracker at
increasing intervals from 1 ms (see there).

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

Shared memory (docs/shm.md)
---------------------------
A Client and a Server on the same host pass tensors through shared memory once a handshake proved
that each maps the other's segments (:mod:`hmp.transport.shm`); with any other peer, or when the
handshake fails or is not answered, frames travel as above. Both ends use ``shm``: an
:class:`~hmp.transport.shm.Arena`, ``False`` (never), or ``None`` (the default: the process arena,
:func:`hmp.transport.shm.open_process_arena`, if this process opened one).

* Requests: a tensor of at least ``min_bytes`` lying in the client's arena travels as a reference.
  Its memory stays lent to the server until the reply arrives: the sender must not change it
  before (as with zero-copy frames, which also hold it until sent), and the server must copy what
  it keeps past its reply. A client with an explicit arena shakes hands before its first request;
  one on the process arena before its first request that carries arena memory.
* Replies: a tensor of at least ``min_bytes`` inside one of the server's reply slots
  (``Arena.reply_copies``) travels as a reference when the client maps the server's segments; the
  client returns each reference once the last view of it is gone (``shm_release``, one-way,
  batched). A full pool makes ``reply_copies`` return None: the handler copies as before and the
  reply goes inline. Nothing waits for a slot.
* A request refused with ``bad_shm`` (the server lost the agreement, e.g. it restarted) is sent
  again inline, once, and the next request shakes hands again. A server that offered no shared
  memory (no arena open yet) is asked again after ``_SHM_RETRY_S``.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import ctypes
import dataclasses
import itertools
import os
import platform
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
import zmq
import zmq.asyncio

from hmp.errors import (EndpointClosed, HmpError, PeerLost, ProtocolError, RemoteError, RequestError,
                        RequestTimeout)
from hmp.messages import Ack, Error, Kind, Message, ShmHello, ShmRelease
from hmp.transport import shm as shm_mod
from hmp.transport.codec import (DEFAULT_FRAME_BYTES, DEFAULT_LIMITS, Limits, decode, encode, frame_error_rid,
                                 message_tensors)
from hmp.transport.shm import Arena
from hmp.transport.eager import start_eager
from hmp.transport import guard
from hmp.transport import security as sec
from hmp.transport.ratelimit import RateLimitedLog
from hmp.transport.security import Curve, HandshakeFailed


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """A handler's reply whose zero-copy buffers the handler must not change until it is sent.

    The server sends ``message`` with a tracker and calls ``on_sent(True)`` once libzmq has let go
    of every zero-copy frame, or ``on_sent(False)`` when it gives up: the peer is gone, the server
    closed, or the frames were still held after ``timeout_s`` (a peer that stopped reading). It
    is called exactly once, on the loop; it must not raise or block. A request with ``rid`` 0
    is not answered: its reply is dropped and ``on_sent(True)`` called at once.
    """

    message: Message
    on_sent: Callable[[bool], None]
    timeout_s: float = 60.0


Handler = Callable[[Message, bytes], Awaitable[Message | Reply | None]]
#: ``authorize(msg, peer)`` -> None to serve ``msg``, or the reason it is refused (``unauthorized``)
Authorize = Callable[[Message, bytes], "str | None"]
log = structlog.get_logger("hmp.transport")

_process_job_token = ""


def set_process_job_token(token: str) -> None:
    """The job token of the endpoints of this process that are given none (``job_token=None``).

    A daemon sets it once (:meth:`hmp.nodes.base.Node.run`), so that every Client it opens, in
    whatever module, stamps the job's token and every Server refuses other jobs' messages."""
    global _process_job_token
    _process_job_token = token


def process_job_token() -> str:
    """The token :func:`set_process_job_token` set ("" by default: open)."""
    return _process_job_token


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
    """What this process's endpoints count for its metrics endpoint, once :func:`set_process_metrics`
    installed it (a Server or Client picks it up when created, resp. connected). Everything is read on the
    event loop's thread (:func:`hmp.metrics.snapshot`), so plain dicts and ints do.

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
        self.clients: weakref.WeakSet[Client] = weakref.WeakSet()
        self.servers: weakref.WeakSet[Server] = weakref.WeakSet()

    def peer(self, peer_id: str) -> list[int]:
        key = _bounded(self.peers, peer_id or "?")
        rec = self.peers.get(key)
        if rec is None:
            rec = self.peers[key] = [0, 0, 0, 0, 0]
        return rec

    def server_error(self, code: str) -> None:
        key = _bounded(self.server_errors, code)
        self.server_errors[key] = self.server_errors.get(key, 0) + 1

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

    def client_closed(self, client: Client) -> None:
        """Fold a closing client's counts into its peer's (they would vanish with it)."""
        self.clients.discard(client)
        rec = self.peer(client.peer_label)
        st = client.stats
        rec[0] += st["bytes_in"]
        rec[1] += st["bytes_out"]
        rec[3] += st["requests"]
        rec[4] += st["shm_bytes_out"]


_process_metrics: TransportMetrics | None = None


def set_process_metrics(metrics: TransportMetrics | None) -> None:
    """Count this process's traffic into ``metrics`` (None: stop counting). A daemon sets it once, before
    opening its server (:meth:`hmp.nodes.base.Node.run`); endpoints opened before keep not counting."""
    global _process_metrics
    _process_metrics = metrics


def process_metrics() -> TransportMetrics | None:
    """What :func:`set_process_metrics` installed (None by default: nothing is counted)."""
    return _process_metrics


#: Receive high-water marks are at least this many messages (control messages are small).
HWM_FLOOR = 16

#: Send high-water mark. A zero-copy send queues views of the sender's own buffers (plus a header
#: each), so a deep send queue costs next to no memory; it lets a stream of small messages run
#: without waking the sender every few messages (measured on loopback, 2 cores: one-way small
#: messages at send/receive marks of 16/16 ran at about half the rate of 1024/16 or 100k/100k).
SEND_HWM = 1024

# Plain ints: pyzmq's flag enums cost an enum operation per use, and these are used per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

#: Messages handled per reader callback before other callbacks get a turn (fairness under floods).
_BURST = 256

#: A send waiting for room retries on every state change of its socket, and at the latest after
#: this fallback poll (doubling from the first to the second value).
_SEND_POLL_S = (0.001, 0.005)

#: wait_sent polls a tracker after 1 ms, then at intervals growing by half up to 10 ms.
_TRACK_POLL_S = (0.001, 0.010)

#: Slot references per ``shm_release`` message.
_RELEASE_BATCH = 4096

#: A server that offered no shared memory (none open yet, or disabled) is asked again after this long.
_SHM_RETRY_S = 10.0

#: A server gives the memory of a refused message back to the OS (guard.release_memory) when the
#: message held at least this many bytes, at most once per _RELEASE_EVERY_S: the call walks the
#: heap (~0.5 ms with nothing to give back, ~18 ms for 256 MiB), too dear per small message.
_RELEASE_AFTER_BYTES = 64 << 20
_RELEASE_EVERY_S = 1.0


def _arena_of(option: Arena | bool | None) -> Arena | None:
    """The arena an endpoint's ``shm`` option means now (module docstring)."""
    if option is False:
        return None
    if option is None or option is True:
        return shm_mod.process_arena()
    return None if option.closed else option


def hwm_for(limits: Limits, frame_bytes: int) -> int:
    """The receive high-water mark (in messages) that keeps a socket's receive queue per peer near
    ``limits.queue_bytes``, counting each message as one full frame: ``queue_bytes //
    frame_bytes``, at least :data:`HWM_FLOOR`. Received frames are fresh allocations driven by the
    peers, so this is where memory must be bounded. (libzmq counts messages, not bytes; a peer
    whose messages find the queue full waits, ROUTER_MANDATORY and DEALER sockets never drop.)
    The send side uses :data:`SEND_HWM`."""
    return max(HWM_FLOOR, limits.queue_bytes // max(1, frame_bytes))


def context() -> zmq.asyncio.Context:
    """The process-wide context (one I/O thread is plenty for loopback at these rates).

    Endpoints open plain sockets in it; any ``zmq.Context`` may be passed as ``ctx`` instead.
    """
    return zmq.asyncio.Context.instance()


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


def _configure(sock: zmq.Socket, limits: Limits, hwm: tuple[int, int]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm[0])
    sock.setsockopt(zmq.RCVHWM, hwm[1])
    # libzmq itself refuses a single frame bigger than any message may be, before buffering it.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + limits.max_header_bytes)


async def wait_sent(tracker: zmq.MessageTracker | None, timeout_s: float = 30.0) -> None:
    """Wait until libzmq no longer holds the buffers of a tracked send (bounded: RequestTimeout).

    The wait polls ``tracker.done`` after 1 ms, then at intervals growing by half up to 10 ms:
    never a spin (uvloop makes sleeps under 0.5 ms immediate), at most a few hundred wake-ups a
    second per waiter, and any number of waiters. Not ``to_thread(tracker.wait)``: a blocking
    wait holds an executor thread per tracker (the default pool has cpu_count + 4), so trackers
    of a peer that stopped reading would hold every thread for their whole timeout and queue
    everyone else's waits, and checkpoint writes, behind them.
    """
    if tracker is None or tracker.done:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay, longest = _TRACK_POLL_S
    while not tracker.done:
        left = deadline - loop.time()
        if left <= 0:
            raise RequestTimeout(f"send still pending after {timeout_s} s")
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 1.5, longest)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _Channel:
    """A synchronous zmq socket driven by the running loop (see the module docstring).

    ``on_message(parts)`` gets each received multipart message: the first ``copied`` parts as
    ``bytes`` (routing id, header: small), the rest as zero-copy ``zmq.Frame``. Parts are read by a
    :class:`hmp.transport.guard.PartReader` (a bounded number per turn of the loop): a message of
    more than ``head`` leading parts plus ``limits.max_frames`` goes to ``on_overlong(overlong)``
    instead, with only its first ``head`` parts kept. ``pause()`` stops reading (messages queue in
    libzmq, then in the peers) until ``resume()``.
    """

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[Any]], None],
                 on_overlong: Callable[[guard.Overlong], None], copied: int, limits: Limits, head: int) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._on_overlong = on_overlong
        self._reader = guard.PartReader.for_limits(sock, copied, limits, head=head)
        self._fd = sock.getsockopt(zmq.FD)
        self._scheduled = False
        self._closed = False
        self.paused = False
        self._waiting = 0  # sends waiting for room; later sends queue behind them to keep order
        self._send_lock = asyncio.Lock()
        self._changed: asyncio.Future | None = None  # a waiting send's wake-up: the FD fired
        self.loop.add_reader(self._fd, self._drain)
        self._schedule()  # messages may have arrived before the reader was registered

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self._schedule()  # messages that arrived meanwhile signalled nothing new

    def _drain(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        if self._changed is not None:  # a send waiting for room: the socket's state changed
            _wake(self._changed)
        if self.paused:
            # Not reading, but the FD must be reset (reading ZMQ_EVENTS processes libzmq's
            # pending commands): it is level-triggered for the loop and would fire in a spin.
            with contextlib.suppress(zmq.ZMQError):
                self.sock.get(_EVENTS)
            return
        reader = self._reader
        reader.turn()
        for _ in range(_BURST):
            try:
                got = reader.read()
            except zmq.ZMQError as exc:  # context terminated under us: nothing more will come
                log.warning("reader_stopped", error=str(exc))
                self.close()
                return
            if got is None:
                if reader.spent:  # the turn's budget ran out (maybe mid-message): go on next turn
                    self._schedule()
                return
            try:
                if type(got) is list:
                    self._on_message(got)
                else:
                    self._on_overlong(got)
            except Exception:  # a bug in one message's handling must not stop the reader
                log.exception("on_message_failed")
            if self.paused or self._closed:
                return  # resume() schedules the rest
        self._schedule()  # more may be waiting: continue after other callbacks had a turn

    def send_now(self, frames: list[Any], track: bool) -> zmq.MessageTracker | None:
        """Send at once or raise ``zmq.Again`` (no room: nothing was queued)."""
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
                return self.send_now(frames, track)
            except zmq.Again:
                pass
        # No room (high-water mark, or a ROUTER peer whose pipe is full): wait, in arrival order.
        self._waiting += 1
        try:
            async with self._send_lock:
                delay, longest = _SEND_POLL_S
                while True:
                    if self._closed:
                        raise EndpointClosed("socket closed")
                    try:
                        return self.send_now(frames, track)
                    except zmq.Again:
                        pass
                    await self._state_change(delay)
                    delay = min(delay * 2, longest)
        finally:
            self._waiting -= 1

    async def _state_change(self, timeout: float) -> None:
        """Until the socket's FD fires (room freed, a peer connected, a message arrived), or ``timeout``.

        The FD fires for any change, not just for room; a ROUTER, whose ZMQ_EVENTS shows POLLOUT
        whatever its peers' pipes hold, has no finer signal. Retrying on each is cheap (one
        failed NOBLOCK send) and bounded by the socket's real traffic; the timeout covers an edge
        some other socket call consumed."""
        fut = self.loop.create_future()
        self._changed = fut
        timer = self.loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if self._changed is fut:
                self._changed = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._changed is not None:
            _wake(self._changed)  # a waiting send sees the close at once
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)


class Server:
    """A ROUTER endpoint serving requests with a kind->handler table.

    Use as ``async with Server(addr, handlers, name=...) as srv:``; ``srv.address`` is the bound
    address (a ``tcp://host:0`` bind picks a free port).

    With ``eager=True`` (the default) a handler starts at once, in the reader callback, and only
    one that suspends gets a Task (:func:`hmp.transport.eager.start_eager`; Python 3.12's eager
    start where the interpreter has it). On Python 3.11 ``asyncio.current_task()`` is None up to
    the handler's first suspension: a handler must not enter ``asyncio.timeout()`` before its
    first ``await`` of something pending (``eager=False`` gives every request its own Task from
    the start). High-water marks: :data:`SEND_HWM` and :func:`hwm_for` of ``limits`` and
    ``frame_bytes`` for receiving (``hwm`` sets both); ``max_inflight`` defaults to
    ``limits.max_inflight_requests``.
    """

    def __init__(self, address: str, handlers: Mapping[Kind, Handler], *, name: str = "server",
                 limits: Limits = DEFAULT_LIMITS, frame_bytes: int = DEFAULT_FRAME_BYTES,
                 ctx: zmq.Context | None = None, eager: bool = True, hwm: int | None = None,
                 max_inflight: int | None = None, shm: Arena | bool | None = None, job_token: str | None = None,
                 authorize: Authorize | None = None, security: Curve | bool | None = None) -> None:
        self.bind_address = address
        #: CURVE (hmp.transport.security): a Curve, False (plain), None (the process's, plain by default)
        self.curve = sec.resolve(security)
        #: the job's identity: when set, a message whose ``job_token`` differs is refused ``unauthorized``
        #: (None: the process's, :func:`set_process_job_token`; "": open)
        self.job_token = process_job_token() if job_token is None else job_token
        #: who may send what (``authorize(msg, peer)`` -> None, or why it is refused): asked for every
        #: decoded message before its handler, so that no handler can forget it
        self.authorize = authorize
        self.address = address
        self.handlers = dict(handlers)
        self.name = name
        self.limits = limits
        self.frame_bytes = frame_bytes
        self.eager = eager
        self.hwm = (SEND_HWM, hwm_for(limits, frame_bytes)) if hwm is None else (hwm, hwm)
        self.max_inflight = limits.max_inflight_requests if max_inflight is None else max_inflight
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        self._ctx = ctx or context()
        self._chan: _Channel | None = None
        self._inflight: set[asyncio.Task] = set()
        self._closing = False
        self.stats = {"requests": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0, "replies": 0,
                      "unanswered_one_way_errors": 0, "answered_one_way_errors": 0, "paused": 0, "shm_bytes_out": 0,
                      "unauthorized": 0, "memory_releases": 0}
        self._release_pending = False  # a release_memory call is scheduled
        self._released_at = -_RELEASE_EVERY_S  # loop time of the last one
        self.log = log.bind(node=name)
        self.warnings = RateLimitedLog(self.log)
        #: shared memory: an Arena, False (none), or None (the process arena when a peer asks)
        self.shm = shm
        self._shm_peers: dict[bytes, shm_mod.RequestResolver] = {}  # routing id -> what it agreed
        self._internal: dict[Kind, Handler] = {Kind.SHM: self._on_shm_hello, Kind.SHM_RELEASE: self._on_shm_release}
        self._watch: sec.HandshakeWatch | None = None  # CURVE: failed handshakes, for the log
        #: the process's TransportMetrics when this server was made (None: nothing counted)
        self._metrics = process_metrics()
        self._peer_names: dict[bytes, str] = {}  # routing id -> sender id, for the per-peer bytes of replies
        if self._metrics is not None:
            self._metrics.servers.add(self)

    @property
    def inflight(self) -> int:
        """Requests being handled or answered now (at most ``max_inflight``)."""
        return len(self._inflight)

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def reading(self) -> bool:
        """False while the server is at its in-flight cap (and so not reading its socket)."""
        return self._chan is not None and not self._chan.paused

    async def start(self) -> str:
        sock = self._ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        auth = False
        try:
            _configure(sock, self.limits, self.hwm)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self.curve is not None:
                self.curve.apply_server(sock)
                sec.acquire_authenticator(self._ctx, self.curve)  # before bind: no connection gets in unchecked
                auth = True
            if self.bind_address.startswith("ipc://"):
                path = self.bind_address.removeprefix("ipc://")
                # Another live server: taking its path over would hijack its peers. (A server of this
                # process closed just now may still listen for a moment: libzmq closes on its I/O thread.)
                for _ in range(50):
                    if not _listening(path):
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise zmq.ZMQError(zmq.EADDRINUSE)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a stale socket file left by a process that died
            sock.bind(self.bind_address)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            sock.close(linger=0)
            if auth:
                sec.release_authenticator(self._ctx)
            raise
        # With CURVE the header stays a frame: its User-Id property names the sender's key.
        self._chan = _Channel(sock, self._on_message, self._on_overlong, copied=1 if self.curve is not None else 2,
                              limits=self.limits, head=2)
        if self.curve is not None:  # clients that fail the handshake never reach _on_message: say so here
            self._watch = sec.HandshakeWatch(sock, lambda why: self.warnings.warning(
                "curve_handshake_failed", "handshake_failed", address=self.address, error=why), sec.SERVER_FAILURES)
        return self.address

    def _on_message(self, frames: list[Any]) -> None:
        peer, body = frames[0], frames[1:]
        stats = self.stats
        user = None
        if self.curve is not None and body and isinstance(body[0], zmq.Frame):
            try:
                user = body[0].get("User-Id")
            except zmq.ZMQError:
                user = ""
            body[0] = body[0].bytes
        nbytes = len(body[0]) if len(body) == 1 else sum(len(f) for f in body)
        stats["bytes_in"] += nbytes
        if self._closing:
            self._answer_error(peer, frame_error_rid(body) if body else 0, "shutting_down",
                               f"{self.name} is shutting down")
            return
        try:
            msg = decode(body, self.limits, resolve=self._shm_peers.get(peer) if self._shm_peers else None)
        except ProtocolError as exc:
            stats["errors"] += 1
            self.warnings.warning("bad_message", exc.code, peer=peer.hex(), error=str(exc))
            self._answer_error(peer, frame_error_rid(body) if body else 0, exc.code, str(exc))
            if exc.code == "too_large" and nbytes >= _RELEASE_AFTER_BYTES:
                self._release_memory_soon()
            return
        why = None
        if self.job_token and msg.job_token != self.job_token:
            # Never echo either token: the refusal must not teach a stranger the job's identity.
            why = (f"{self.name} refuses {msg.kind.value!r} from {msg.sender or '?'!r}: the job token "
                   f"{'is missing' if not msg.job_token else 'does not match'} (another job, or a client "
                   f"without this job's token)")
        elif user is not None and not sec.sender_bound(msg.sender, user, self.curve):
            why = (f"{self.name} refuses {msg.kind.value!r} from {msg.sender or '?'!r}: the connection's CURVE key "
                   f"is {user or 'unnamed'!r}, and a key speaks only for its own node")
        elif self.authorize is not None:
            why = self.authorize(msg, peer)
        if why is not None:
            stats["errors"] += 1
            stats["unauthorized"] += 1
            self.warnings.warning("unauthorized", "unauthorized", peer=peer.hex(), sender=msg.sender,
                                  kind=msg.kind.value, error=why)
            self._answer_error(peer, msg.rid, "unauthorized", why, msg.refusals_answered)
            return
        stats["requests"] += 1
        metrics = self._metrics
        if metrics is not None:
            self._count_request(metrics, peer, msg, nbytes)
        handler = self.handlers.get(msg.kind) or self._internal.get(msg.kind)
        if handler is None:
            stats["errors"] += 1
            self._answer_error(peer, msg.rid, "unknown_op", f"{self.name} does not serve {msg.kind.value!r}; "
                               f"serves {sorted(k.value for k in self.handlers)}", msg.refusals_answered)
            return
        chan = self._chan
        assert chan is not None
        coro = self._dispatch(handler, msg, peer)
        if not self.eager:
            self._track(chan.loop.create_task(coro))
            return
        # Start the handler right here: most finish without suspending (module eager).
        task = start_eager(coro, chan.loop)
        if task is not None:
            self._track(task)

    def _count_request(self, metrics: TransportMetrics, peer: bytes, msg: Message, nbytes: int) -> None:
        """An accepted request, for the metrics: its sender's bytes and count, its kind's count."""
        sender = msg.sender or "?"
        names = self._peer_names
        if names.get(peer) != sender and (peer in names or len(names) < MAX_LABEL_VALUES):
            names[peer] = sender
        rec = metrics.peer(sender)
        rec[0] += nbytes
        rec[2] += 1
        served = metrics.served
        cls = type(msg)
        served[cls] = served.get(cls, 0) + 1

    def _on_overlong(self, m: guard.Overlong) -> None:
        """A message of more frames than ``limits.max_frames``: its extra frames were dropped unread
        (:class:`hmp.transport.guard.PartReader`); refused ``too_large`` like any other."""
        peer, body = m.head[0], m.head[1:]
        exc = guard.overlong_error(m, 2, self.limits)
        self.stats["bytes_in"] += m.nbytes - len(peer)
        self.stats["errors"] += 1
        self.warnings.warning("bad_message", exc.code, peer=peer.hex(), error=str(exc))
        self._answer_error(peer, frame_error_rid(body) if body else 0, exc.code, str(exc))
        if m.nbytes >= _RELEASE_AFTER_BYTES:
            self._release_memory_soon()

    def _release_memory_soon(self) -> None:
        """Give a refused message's memory back to the OS (:func:`hmp.transport.guard.release_memory`):
        from a later callback, once the reader has dropped its frames (never from the one that
        refused it), and at most once per :data:`_RELEASE_EVERY_S`; a refusal meanwhile is covered by
        the call already scheduled."""
        chan = self._chan
        if self._release_pending or chan is None:
            return
        self._release_pending = True
        wait = self._released_at + _RELEASE_EVERY_S - chan.loop.time()
        if wait > 0:
            chan.loop.call_later(wait, self._release_memory)
        else:
            chan.loop.call_soon(self._release_memory)

    def _release_memory(self) -> None:
        self._release_pending = False
        self._released_at = asyncio.get_running_loop().time()
        guard.release_memory()
        self.stats["memory_releases"] += 1

    def _track(self, task: asyncio.Task) -> None:
        self._inflight.add(task)
        task.add_done_callback(self._untrack)
        chan = self._chan
        if len(self._inflight) >= self.max_inflight and chan is not None and not chan.paused and not self._closing:
            self.stats["paused"] += 1
            self.log.info("inflight_cap_reached", inflight=len(self._inflight), cap=self.max_inflight)
            chan.pause()

    def _untrack(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        chan = self._chan
        if chan is not None and chan.paused and len(self._inflight) < self.max_inflight:
            chan.resume()

    def _answer_error(self, peer: bytes, rid: int, code: str, text: str, answer_one_way: bool = False) -> None:
        """Answer ``rid`` with an error, from the reader callback (which cannot await): at once
        when there is room (the usual case), else from a task like any other reply.
        ``answer_one_way``: the message was read and is of a kind whose one-way refusals are
        answered (``Message.refusals_answered``); a ``rid`` of 0 is then answered too."""
        if self._metrics is not None:
            self._metrics.server_error(code)
        if rid == 0:  # one-way (or unreadable rid): not answered, but where its kind asks (module docstring)
            if not answer_one_way:
                self.stats["unanswered_one_way_errors"] += 1
                return
            self.stats["answered_one_way_errors"] += 1
        chan = self._chan
        assert chan is not None
        if not chan._waiting:
            frames = [peer, *encode(Error(code=code, message=text), self.frame_bytes, rid=rid, sender=self.name)]
            try:
                chan.send_now(frames, False)
                self.stats["replies"] += 1
                return
            except zmq.Again:
                pass
            except (zmq.ZMQError, PeerLost) as exc:  # EHOSTUNREACH: the peer left meanwhile
                self.log.info("error_reply_unroutable", code=code, error=str(exc))
                return
        self._track(chan.loop.create_task(self._reply(peer, rid, Error(code=code, message=text))))

    async def _dispatch(self, handler: Handler, msg: Message, peer: bytes) -> None:
        try:
            reply = await handler(msg, peer)
        except RequestError as exc:
            self.stats["errors"] += 1
            if self._metrics is not None:
                self._metrics.server_error(exc.code)
            reply = Error(code=exc.code, message=str(exc), blamed=exc.blamed)
        except asyncio.CancelledError:
            if self._closing and self._chan is not None:
                # close() cancels handlers still running after its grace period: tell the sender
                # now instead of leaving it to wait out its request timeout.
                self._answer_error(peer, msg.rid, "shutting_down",
                                   f"{self.name} shut down before answering {msg.kind.value!r}",
                                   msg.refusals_answered)
            raise
        except Exception as exc:  # a handler bug must not kill the server; the sender hears of it
            self.stats["errors"] += 1
            self.log.exception("handler_failed", kind=msg.kind.value)
            if self._metrics is not None:
                self._metrics.server_error("internal")
            reply = Error(code="internal", message=f"{exc.__class__.__name__}: {exc}")
        if reply is None:
            return
        if msg.rid == 0:  # one-way: nobody waits for a reply
            if isinstance(reply, Error):
                if msg.refusals_answered:  # its sender must hear at once (Message.refusals_answered)
                    self.stats["answered_one_way_errors"] += 1
                    await self._reply(peer, 0, reply)
                    return
                self.stats["unanswered_one_way_errors"] += 1
            if isinstance(reply, Reply):
                _notify(reply, True)
            return
        await self._reply(peer, msg.rid, reply)

    # ---------------------------------------------------------------- shared memory
    def _arena(self) -> Arena | None:
        return _arena_of(self.shm)

    async def _on_shm_hello(self, msg: ShmHello, peer: bytes) -> Message:
        """The server's side of the handshake (docs/protocol.md, "Shared memory")."""
        arena = self._arena()
        if arena is None:
            self._shm_peers.pop(peer, None)
            return ShmHello(host="", segment="", token="", mapped=False)
        here = shm_mod.host_id(arena.directory)
        prefix = shm_mod.prefix_of(msg.segment)
        if msg.mapped:  # second step: the client reads our segments
            agreed = self._shm_peers.get(peer)
            if agreed is None or agreed.prefix != prefix:
                raise RequestError("shm: a 'mapped' hello without this connection's offer first", "bad_shm")
            agreed.replies = True
            return Ack(detail="shm replies")
        if prefix is None or msg.host != here:
            self._shm_peers.pop(peer, None)
            return ShmHello(host=here, segment=arena.probe, token=arena.token, mapped=False)
        ok = shm_mod.verify_probe(arena.directory, msg.segment, msg.token)
        if len(self._shm_peers) >= 256:  # forget connections of peers that have exited
            for rid_, agreed in list(self._shm_peers.items()):
                if not shm_mod.owner_alive(agreed.directory, f"{agreed.prefix}.0"):
                    del self._shm_peers[rid_]
        self._shm_peers[peer] = shm_mod.RequestResolver(arena.directory, prefix, ok)
        self.log.info("shm_peer", peer=prefix, requests=ok)
        return ShmHello(host=here, segment=arena.probe, token=arena.token, mapped=ok)

    async def _on_shm_release(self, msg: ShmRelease, peer: bytes) -> Message | None:
        arena = self._arena()
        prefix = shm_mod.prefix_of(msg.segment)
        if arena is not None and prefix is not None:
            unknown = arena.release(msg.slots, prefix)
            if unknown:
                self.log.debug("shm_release_unknown", peer=prefix, slots=unknown)
        return None if msg.rid == 0 else Ack()

    def _reply_locate(self, peer: bytes, held: list[int]) -> tuple[Any, Arena | None, str]:
        """The ``locate`` for a reply to ``peer`` (None unless it maps our reply slots)."""
        agreed = self._shm_peers.get(peer) if self._shm_peers else None
        arena = self._arena() if agreed is not None and agreed.replies else None
        if arena is None:
            return None, None, ""
        stats = self.stats

        def locate(t: Any) -> Any:
            ref = arena.reply_ref(t)
            if ref is not None:
                held.append(ref[2])
                stats["shm_bytes_out"] += t.numel() * t.element_size()
            return ref
        return locate, arena, agreed.prefix

    async def _reply(self, peer: bytes, rid: int, reply: Message | Reply) -> None:
        """Send a handler's reply (the only way anything leaves a server)."""
        tracked = reply if isinstance(reply, Reply) else None
        msg = reply.message if tracked is not None else reply
        tracker = None
        held: list[int] = []  # reply slots referenced (lent to the peer once sent)
        arena, who, sent = None, "", False
        try:
            chan = self._chan
            if chan is None:
                raise EndpointClosed(f"{self.name} is closed")
            locate, arena, who = self._reply_locate(peer, held)
            try:
                frames = encode(msg, self.frame_bytes, rid=rid, sender=self.name, locate=locate, limits=self.limits)
            except ProtocolError as exc:
                # A reply the client would refuse (too_large), or none can encode (bad_device, ...):
                # say so now, rather than leave the client to wait out its timeout.
                self.stats["errors"] += 1
                if self._metrics is not None:
                    self._metrics.server_error(exc.code)
                self.warnings.warning("reply_not_encoded", exc.code, kind=msg.kind.value, error=str(exc))
                if held:
                    assert arena is not None
                    arena.release(held, who)
                    held.clear()
                tracked_error = tracked
                tracked = None  # nothing of the handler's goes out: told on_sent(False) below
                if tracked_error is not None:
                    _notify(tracked_error, False)
                frames = encode(Error(code=exc.code, message=f"{self.name} could not send its {msg.kind.value!r} "
                                                             f"reply: {exc}"), self.frame_bytes, rid=rid,
                                sender=self.name)
            if held:
                assert arena is not None
                arena.hold(held, who)  # before the send: the peer may release as soon as it has the reply
            if len(frames) > 1:
                nbytes = sum(len(memoryview(f)) for f in frames[1:])
                self.stats["bytes_out"] += nbytes
                if self._metrics is not None:
                    self._metrics.peer(self._peer_names.get(peer, "?"))[1] += nbytes
            tracker = await chan.send([peer, *frames], tracked is not None)
            sent = True
            self.stats["replies"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.log.info("reply_unroutable", kind=msg.kind.value)  # the peer left before its reply
        except (PeerLost, EndpointClosed) as exc:
            self.log.info("reply_not_sent", kind=msg.kind.value, error=str(exc))
        finally:
            if held and not sent and arena is not None:
                arena.release(held, who)  # never reached the peer: nobody will release them
            if tracked is not None and (tracker is None or tracker.done):
                _notify(tracked, tracker is not None)
        if tracked is not None and tracker is not None and not tracker.done:
            chan = self._chan
            assert chan is not None
            self._track(chan.loop.create_task(self._await_sent(tracker, tracked)))

    async def _await_sent(self, tracker: zmq.MessageTracker, reply: Reply) -> None:
        sent = False
        try:
            await wait_sent(tracker, reply.timeout_s)
            sent = True
        except RequestTimeout:
            self.log.warning("reply_send_stuck", kind=reply.message.kind.value, waited_s=reply.timeout_s)
        finally:
            _notify(reply, sent)

    async def close(self, grace_s: float = 2.0) -> None:
        """Refuse new requests, let in-flight handlers finish for up to ``grace_s``, then close."""
        if self._chan is None:
            return
        self._closing = True
        self._chan.resume()  # requests held back by the in-flight cap now get shutting_down at once
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._chan.close()
        self._chan = None
        self.warnings.flush()
        if self.curve is not None:
            sec.release_authenticator(self._ctx)


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (a live server, not a stale file)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _notify(reply: Reply, sent: bool) -> None:
    try:
        reply.on_sent(sent)
    except Exception:
        log.exception("on_sent_failed", kind=reply.message.kind.value)


class Client:
    """A DEALER endpoint to one server; ``request()`` matches replies to requests by ``rid``.

    ``close()`` fails the requests still pending with :class:`EndpointClosed`; ``fail_pending``
    fails them with any error (the node layer uses it when it declares the peer lost). High-water
    marks as for :class:`Server`.
    """

    def __init__(self, address: str, *, name: str = "client", limits: Limits = DEFAULT_LIMITS,
                 frame_bytes: int = DEFAULT_FRAME_BYTES, timeout_s: float = 30.0,
                 ctx: zmq.Context | None = None, hwm: int | None = None,
                 shm: Arena | bool | None = None, job_token: str | None = None,
                 security: Curve | bool | None = None,
                 on_refused: Callable[[RemoteError], None] | None = None) -> None:
        self.address = address
        #: called (from the loop) with each refusal of a one-way message (an ``Error`` of ``rid`` 0,
        #: see ``Message.refusals_answered``); None: logged (rate-limited)
        self.on_refused = on_refused
        #: CURVE (hmp.transport.security): a Curve, False (plain), None (the process's, plain by default)
        self.curve = sec.resolve(security)
        self._watch: sec.HandshakeWatch | None = None
        self.warnings = RateLimitedLog(log.bind(node=name, peer=address))  # a reconnecting peer fails again and again
        #: the job's identity, stamped on every message this client sends (docs/protocol.md, "Trust");
        #: None: the process's (:func:`set_process_job_token`), "": none
        self.job_token = process_job_token() if job_token is None else job_token
        self.name = name
        self.limits = limits
        self.frame_bytes = frame_bytes
        self.timeout_s = timeout_s
        self.hwm = (SEND_HWM, hwm_for(limits, frame_bytes)) if hwm is None else (hwm, hwm)
        self._ctx = ctx or context()
        self._chan: _Channel | None = None
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._rids = itertools.count(1)
        self.stats = {"requests": 0, "bytes_in": 0, "bytes_out": 0, "shm_bytes_out": 0, "one_way_refused": 0}
        self.log = log.bind(node=name, peer=address)
        #: shared memory: an Arena (shake hands before the first request), True (the same with the
        #: process arena), False (never), or None (the process arena, shaking hands before the first
        #: request that carries its memory)
        self.shm = shm
        self._shm_state = "off" if shm is False else "new"  # new -> pending -> on | off
        self._shm_wait: asyncio.Future | None = None
        self._shm_not_before = 0.0  # loop time before which no new handshake is tried
        self._link: _ShmLink | None = None
        #: reads the server's reply slots; kept when the link is dropped, for replies still on the way
        self._resolve: shm_mod.ReplyResolver | None = None
        self._released: collections.deque[int] = collections.deque()  # slots to return (any thread)
        self._release_scheduled = False
        self._release_as = ""  # our probe, as the server knows us
        self._release_tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shm_retry = False  # the last handshake found a server without an arena
        #: the server's node id, from its first reply ("" until then)
        self.peer_id = ""
        self._metrics: TransportMetrics | None = None  # the process's, taken at connect()

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
        sock = self._ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        try:
            _configure(sock, self.limits, self.hwm)
            if self.curve is not None:
                self.curve.apply_client(sock)
                self._watch = sec.HandshakeWatch(sock, self._handshake_failed)
            sock.connect(self.address)
        except BaseException:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            sock.close(linger=0)
            raise
        self._chan = _Channel(sock, self._on_message, self._on_overlong, copied=1, limits=self.limits, head=1)
        self._loop = self._chan.loop
        self._metrics = process_metrics()
        if self._metrics is not None:
            self._metrics.clients.add(self)

    @property
    def shm_active(self) -> bool:
        """Whether shared memory is in use with this server (after a successful handshake)."""
        return self._link is not None

    def _on_overlong(self, m: guard.Overlong) -> None:
        """A reply of more frames than ``limits.max_frames`` (its extra frames dropped unread): the
        request it answers fails with ``too_large``."""
        exc = guard.overlong_error(m, 1, self.limits)
        rid = frame_error_rid(m.head)
        self.stats["bytes_in"] += m.nbytes - len(m.head[0])
        self.warnings.warning("bad_reply", exc.code, error=str(exc), rid=rid)
        fut = self._pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) > 1:
            self.stats["bytes_in"] += sum(len(f) for f in frames[1:])
        try:
            msg = decode(frames, self.limits, resolve=self._resolve)
        except ProtocolError as exc:
            rid = frame_error_rid(frames)
            self.warnings.warning("bad_reply", exc.code, error=str(exc), rid=rid)
            fut = self._pending.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(exc)
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
        """Send one message as is (``rid`` 0 for one-way); zero-copy, see the module docstring.

        ``lend``: tensors in this client's shared-memory arena go by reference when the server
        maps it (an earlier request shook hands; no handshake is started here). No reply says
        when the server is done reading them: the caller knows it from its own protocol (the
        ring: docs/collective.md), and must not write them before."""
        locate = None
        if lend:
            link = self._link
            if link is not None and link.send:
                locate = self._lender(link, None)
        return await self._send(msg, track, locate=locate)

    def _lender(self, link: _ShmLink, used: list[int] | None) -> Any:
        """``locate`` for encode: the reference of a tensor in ``link``'s arena (None: inline)."""
        arena, stats = link.arena, self.stats

        def locate(t: Any) -> Any:
            ref = arena.request_ref(t)
            if ref is not None:
                n = t.numel() * t.element_size()
                if used is not None:
                    used.append(n)
                stats["shm_bytes_out"] += n
            return ref
        return locate

    async def _send(self, msg: Message, track: bool, rid: int | None = None,
                    sender: str | None = None, locate: Any = None) -> zmq.MessageTracker | None:
        if self._chan is None:
            raise EndpointClosed(f"{self.name} is closed")
        frames = encode(msg, self.frame_bytes, rid=rid, sender=sender, locate=locate,
                        job_token=self.job_token or None, limits=self.limits)
        if len(frames) > 1:
            self.stats["bytes_out"] += sum(len(memoryview(f)) for f in frames[1:])
        return await self._chan.send(frames, track)

    async def request(self, msg: Message, timeout_s: float | None = None) -> Message:
        """Send ``msg`` with a fresh rid and return the reply (``Error`` replies raise RemoteError).

        Tensors in this client's shared-memory arena go by reference when the server maps it
        (module docstring); they are lent to the server until the reply arrives."""
        if self._chan is None:
            raise EndpointClosed(f"{self.name} is closed")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self._shm_state != "off" and self._link is None and (self._shm_state == "pending"
                                                                or _arena_of(self.shm) is not None):
            await self._shm_maybe_handshake(msg, timeout)
        link = self._link
        if link is None or not link.send:
            return await self._request(msg, timeout, None)
        used: list[int] = []
        try:
            return await self._request(msg, timeout, self._lender(link, used))
        except RemoteError as exc:
            if exc.code != "bad_shm" or not used:
                raise
            # The server no longer reads our segments (it restarted, or lost this connection's
            # agreement): once more inline, and shake hands again before the next request.
            self.log.warning("shm_refused", error=exc.remote_message)
            if self._link is link:
                self._link, self._shm_state = None, "new"
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
        watch = self._watch
        if watch is not None and not watch.ok:
            if watch.error:  # the last handshake was refused: say so now rather than wait
                fut.set_exception(self._handshake_error(watch.error))
            else:
                self._check_handshake(fut)
        metrics = self._metrics
        t0 = time.perf_counter() if metrics is not None else 0.0  # not loop.time(): uvloop's ticks in ms
        try:
            await self._send(msg, False, rid=rid, sender=msg.sender or self.name, locate=locate)
            reply = await fut
            if metrics is not None:
                self._observe(metrics, type(msg), time.perf_counter() - t0)
            return reply
        except HmpError as exc:
            if metrics is not None:
                if isinstance(exc, RemoteError):  # answered, if with an error: a round trip all the same
                    self._observe(metrics, type(msg), time.perf_counter() - t0)
                metrics.client_failed(type(msg), exc)
            raise
        finally:
            timer.cancel()
            self._pending.pop(rid, None)

    @staticmethod
    def _observe(metrics: TransportMetrics, cls: type, seconds: float) -> None:
        hist = metrics.latency.get(cls)
        if hist is None:
            hist = metrics.latency[cls] = LatencyHistogram()
        hist.observe(seconds)

    def _handshake_error(self, reason: str) -> HandshakeFailed:
        assert self.curve is not None
        return HandshakeFailed(f"{self.name}: the CURVE handshake with {self.address} failed: {reason} "
                               f"(key folder {self.curve.key_dir}, this client's key {self.curve.name!r})")

    def _handshake_failed(self, reason: str) -> None:
        """The server refused the handshake (monitor event): fail what waits now, not at its timeout."""
        self.warnings.warning("curve_handshake_failed", "handshake_failed", error=reason)
        self.fail_pending(self._handshake_error(reason))

    def _check_handshake(self, fut: asyncio.Future[Message]) -> None:
        """A request's handshake watch: fail it once the connection has been up ``handshake_timeout_s``
        without a finished handshake (a server that cannot read our hello answers nothing at all)."""
        watch, curve = self._watch, self.curve
        if fut.done() or watch is None or curve is None or watch.ok:
            return
        if watch.stalled(curve.handshake_timeout_s):
            self.warnings.warning("curve_handshake_failed", "handshake_timeout", waited_s=curve.handshake_timeout_s)
            fut.set_exception(self._handshake_error(
                watch.error or f"no handshake within {curve.handshake_timeout_s} s (the server has another key, "
                               f"or does not speak CURVE)"))
            return
        # No connection yet (the server may be starting), or one younger than the timeout: look again.
        watch.loop.call_later(min(0.25, curve.handshake_timeout_s / 4), self._check_handshake, fut)

    def _expire(self, fut: asyncio.Future[Message], kind: Kind, rid: int, timeout: float) -> None:
        if not fut.done():
            fut.set_exception(RequestTimeout(f"{self.name}: no reply to {kind.value} #{rid} from {self.address} "
                                             f"within {timeout} s"))

    # ---------------------------------------------------------------- shared memory
    async def _shm_maybe_handshake(self, msg: Message, timeout: float) -> None:
        if self._shm_state == "pending":
            assert self._shm_wait is not None
            await asyncio.shield(self._shm_wait)  # the first request's handshake; its errors are its own
            return
        if self._shm_state != "new":
            return
        arena = _arena_of(self.shm)
        if arena is None or (self._shm_not_before and asyncio.get_running_loop().time() < self._shm_not_before):
            return
        if self.shm is None and not any(arena.request_ref(t) is not None for t in message_tensors(msg)):
            return  # the process arena: only once a request carries its memory
        self._shm_state = "pending"
        loop = asyncio.get_running_loop()
        self._shm_wait = wait = loop.create_future()
        try:
            self._link = await self._shm_negotiate(arena, timeout)
            self._shm_state = "on" if self._link is not None else "off"
            if self._shm_state == "off" and self._shm_retry:  # the server may open its arena later
                self._shm_state, self._shm_not_before = "new", loop.time() + _SHM_RETRY_S
            if self._link is not None and self._link.resolver is not None:
                self._resolve = self._link.resolver
        except (RemoteError, ProtocolError) as exc:  # a server that does not speak it: frames, as ever
            self.log.info("shm_off", reason=str(exc))
            self._shm_state = "off"
        except BaseException:
            self._shm_state = "new"  # timeout, closed, cancelled: the next request tries again
            raise
        finally:
            self._shm_wait = None
            if not wait.done():
                wait.set_result(None)

    async def _shm_negotiate(self, arena: Arena, timeout: float) -> _ShmLink | None:
        """The client's side of the handshake (docs/protocol.md, "Shared memory")."""
        here = shm_mod.host_id(arena.directory)
        offer = ShmHello(host=here, segment=arena.probe, token=arena.token)
        reply = await self._request(offer, timeout, None)
        self._shm_retry = isinstance(reply, ShmHello) and not reply.segment  # it offers none (yet)
        if not isinstance(reply, ShmHello):
            return None
        send = bool(reply.mapped)
        resolver = None
        prefix = shm_mod.prefix_of(reply.segment)
        if reply.host == here and prefix is not None and shm_mod.verify_probe(arena.directory, reply.segment,
                                                                              reply.token):
            await self._request(offer.replace(mapped=True), timeout, None)
            resolver = shm_mod.ReplyResolver(arena.directory, prefix, self._release_slot)
        if not send and resolver is None:
            self.log.info("shm_off", reason="the server cannot map this process's segments nor we its",
                          server_host=reply.host == here)
            return None
        self._release_as = arena.probe
        self.log.info("shm_on", server=prefix, requests=send, replies=resolver is not None)
        return _ShmLink(arena, send, resolver)

    def _release_slot(self, slot: int) -> None:
        """Queue one reply-slot reference for release; called by finalizers, from any thread."""
        self._released.append(slot)
        if not self._release_scheduled:
            self._release_scheduled = True
            loop = self._loop
            try:
                if loop is not None:
                    loop.call_soon_threadsafe(self._flush_releases)
            except RuntimeError:  # the loop is closed: the server reclaims when we exit
                pass

    def _flush_releases(self) -> None:
        """Send the queued releases (one-way ``shm_release`` messages; never waits)."""
        self._release_scheduled = False
        slots = []
        while self._released:
            slots.append(self._released.popleft())
        chan = self._chan
        if not slots or chan is None or not self._release_as:
            return
        for i in range(0, len(slots), _RELEASE_BATCH):
            frames = encode(ShmRelease(segment=self._release_as, slots=tuple(slots[i:i + _RELEASE_BATCH])),
                            self.frame_bytes, sender=self.name, job_token=self.job_token or None)
            try:
                chan.send_now(frames, False)
            except zmq.Again:  # no room now: a task waits for it (releases are never dropped for that)
                task = chan.loop.create_task(self._send_frames(frames))
                self._release_tasks.add(task)
                task.add_done_callback(self._release_tasks.discard)
            except (zmq.ZMQError, PeerLost, EndpointClosed) as exc:
                self.log.info("shm_release_not_sent", slots=len(slots), error=str(exc))

    async def _send_frames(self, frames: list[Any]) -> None:
        chan = self._chan
        if chan is None:
            return
        with contextlib.suppress(zmq.ZMQError, PeerLost, EndpointClosed):
            await chan.send(frames, False)

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
        self._flush_releases()  # what is queued goes now; later ones are reclaimed when this process exits
        for task in list(self._release_tasks):
            task.cancel()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._chan.close()
        self._chan = None
        self.warnings.flush()
        if self._metrics is not None:
            self._metrics.client_closed(self)


@dataclasses.dataclass(eq=False)
class _ShmLink:
    """What a client agreed with its server: ``send`` (the server maps our arena), ``resolver`` (we
    map its reply slots; None: replies inline)."""

    arena: Arena
    send: bool
    resolver: shm_mod.ReplyResolver | None


__all__ = ["Authorize", "Client", "LatencyHistogram", "RateLimitedLog", "Server", "Handler", "Reply",
           "TransportMetrics", "process_job_token", "process_metrics", "set_process_job_token",
           "set_process_metrics", "context", "hwm_for", "tune_malloc", "wait_sent", "PeerLost"]
