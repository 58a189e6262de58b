"""A plain (synchronous) zmq socket driven by the running asyncio loop: the one place where hmp reads
and writes sockets. A reader callback on libzmq's notification FD receives with ``NOBLOCK`` until the
socket is empty, and sends go out with ``NOBLOCK`` from the calling coroutine, waiting for room on the
FD's signal; cheaper per message than ``zmq.asyncio``, and never a busy wait
(docs/protocol.md, "hmp's endpoints")."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import platform
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from hmp.errors import EndpointClosed, PeerLost, RequestTimeout
from hmp.transport import guard
from hmp.transport.codec import Limits
from hmp.transport.settings import EndpointSettings

log = structlog.get_logger("hmp.transport")

#: Receive high-water marks are at least this many messages (control messages are small).
HWM_FLOOR = 16

#: Send high-water mark. A zero-copy send queues views of the sender's own buffers (plus a header
#: each), so a deep send queue costs next to no memory; it lets a stream of small messages run
#: without waking the sender every few messages (docs/protocol.md, "hmp's endpoints").
SEND_HWM = 1024

# Plain ints: pyzmq's flag enums cost an enum operation per use, and these are used per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)

#: Messages handled per reader callback before other callbacks get a turn (fairness under floods).
_BURST = 256

#: A send waiting for room retries on every state change of its socket, and at the latest after
#: this fallback poll (doubling from the first to the second value).
_SEND_POLL_S = (0.001, 0.005)

#: wait_sent polls a tracker after 1 ms, then at intervals growing by half up to 10 ms.
_TRACK_POLL_S = (0.001, 0.010)


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

    Endpoints open plain sockets in it unless their settings name another ``ctx``.
    """
    return zmq.asyncio.Context.instance()


def tune_malloc(retain_bytes: int = 1 << 30) -> bool:
    """Let large received frames reuse memory instead of faulting in fresh pages; call once, early.

    libzmq mallocs a buffer for every frame it receives. glibc serves blocks of 32 MiB and more
    (and, in a thread's own arena, anything near its 64 MiB heap size) with a fresh ``mmap`` that
    is unmapped again on free, so every large message costs one page fault per 4 KiB on the
    receiving I/O thread (docs/protocol.md, "hmp's endpoints").
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


def open_socket(settings: EndpointSettings, kind: int) -> zmq.Socket:
    """A plain socket of ``kind`` in ``settings``'s context, with its high-water marks and limits."""
    sock = (settings.ctx or context()).socket(kind, socket_class=zmq.Socket)
    hwm = settings.hwm
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM if hwm is None else hwm)
    sock.setsockopt(zmq.RCVHWM, hwm_for(settings.limits, settings.frame_bytes) if hwm is None else hwm)
    # libzmq itself refuses a single frame bigger than any message may be, before buffering it.
    sock.setsockopt(zmq.MAXMSGSIZE, settings.limits.max_message_bytes + settings.limits.max_header_bytes)
    return sock


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


def wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Channel:
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
            wake(self._changed)
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
        timer = self.loop.call_later(timeout, wake, fut)
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
            wake(self._changed)  # a waiting send sees the close at once
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)
