"""A ROUTER endpoint that serves requests with an explicit ``{Kind: handler}`` table (docs/protocol.md:
error replies, the one-way rule, flow control). A handler never sends anything itself: the server
sends what it returns, so that limits, trust checks, shared memory, backpressure (at most
``max_inflight`` requests at once, then it stops reading) and metrics hold for every handler alike."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import zmq

from hmp.errors import EndpointClosed, PeerLost, ProtocolError, RequestError, RequestTimeout
from hmp.messages import Error, Kind, Message
from hmp.transport import guard
from hmp.transport import security as sec
from hmp.transport.channel import Channel, context, log, open_socket, wait_sent
from hmp.transport.codec import decode, encode, frame_error_rid
from hmp.transport.eager import start_eager
from hmp.transport.metrics import MAX_LABEL_VALUES, TransportMetrics
from hmp.transport.ratelimit import RateLimitedLog
from hmp.transport.settings import EndpointSettings, resolve
from hmp.transport.shm_link import ServerShm
from hmp.transport.trust import Authorize, curve_user, refusal

#: A server gives the memory of a refused message back to the OS (guard.release_memory) when the
#: message held at least this many bytes, at most once per _RELEASE_EVERY_S: the call walks the
#: heap, too dear per small message (docs/protocol.md, "hmp's endpoints").
_RELEASE_AFTER_BYTES = 64 << 20
_RELEASE_EVERY_S = 1.0


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


class Server:
    """A ROUTER endpoint serving requests with a kind->handler table.

    Use as ``async with Server(addr, handlers, name=...) as srv:``; ``srv.address`` is the bound
    address (a ``tcp://host:0`` bind picks a free port).

    With ``eager=True`` (the default) a handler starts at once, in the reader callback, and only
    one that suspends gets a Task (:func:`hmp.transport.eager.start_eager`; Python 3.12's eager
    start where the interpreter has it). On Python 3.11 ``asyncio.current_task()`` is None up to
    the handler's first suspension: a handler must not enter ``asyncio.timeout()`` before its
    first ``await`` of something pending (``eager=False`` gives every request its own Task from
    the start). ``settings`` (None: the process's, :func:`~hmp.transport.settings.process_settings`)
    may be changed by keyword for this server (``limits=...``, see :class:`EndpointSettings`);
    ``max_inflight`` defaults to ``limits.max_inflight_requests``; ``authorize(msg, peer)``, the node's
    who-may-send-what table, is asked for every decoded message before its handler.
    """

    def __init__(self, address: str, handlers: Mapping[Kind, Handler], *, name: str = "server",
                 settings: EndpointSettings | None = None, eager: bool = True, max_inflight: int | None = None,
                 authorize: Authorize | None = None, **changes: Any) -> None:
        self.settings = settings = resolve(settings, changes)
        self.bind_address = self.address = address
        self.handlers = dict(handlers)
        self.name, self.eager, self.authorize = name, eager, authorize
        self.limits, self.frame_bytes, self.curve = settings.limits, settings.frame_bytes, settings.security
        self._metrics = settings.metrics
        self.max_inflight = self.limits.max_inflight_requests if max_inflight is None else max_inflight
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        self._ctx = settings.ctx or context()
        self._chan: Channel | None = None
        self._inflight: set[asyncio.Task] = set()
        self._closing = False
        self.stats = {"requests": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0, "replies": 0,
                      "unanswered_one_way_errors": 0, "answered_one_way_errors": 0, "paused": 0, "shm_bytes_out": 0,
                      "unauthorized": 0, "memory_releases": 0}
        self._release_pending = False  # a release_memory call is scheduled
        self._released_at = -_RELEASE_EVERY_S  # loop time of the last one
        self.log = log.bind(node=name)
        self.warnings = RateLimitedLog(self.log)
        self._shm = ServerShm(settings.shm, self.log)
        self._internal: dict[Kind, Handler] = {Kind.SHM: self._shm.on_hello, Kind.SHM_RELEASE: self._shm.on_release}
        self._watch: sec.HandshakeWatch | None = None  # CURVE: failed handshakes, for the log
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
        sock = open_socket(self.settings, zmq.ROUTER)
        auth = False
        try:
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
        self._chan = Channel(sock, self._on_message, self._on_overlong, copied=1 if self.curve is not None else 2,
                              limits=self.limits, head=2)
        if self.curve is not None:  # clients that fail the handshake never reach _on_message: say so here
            self._watch = sec.HandshakeWatch(sock, lambda why: self.warnings.warning(
                "curve_handshake_failed", "handshake_failed", address=self.address, error=why), sec.SERVER_FAILURES)
        return self.address

    def _on_message(self, frames: list[Any]) -> None:
        peer, body = frames[0], frames[1:]
        stats = self.stats
        user = curve_user(body)
        nbytes = len(body[0]) if len(body) == 1 else sum(len(f) for f in body)
        stats["bytes_in"] += nbytes
        if self._closing:
            self._answer_error(peer, frame_error_rid(body) if body else 0, "shutting_down",
                               f"{self.name} is shutting down")
            return
        try:
            msg = decode(body, self.limits, resolve=self._shm.resolver(peer))
        except ProtocolError as exc:
            stats["errors"] += 1
            self.warnings.warning("bad_message", exc.code, peer=peer.hex(), error=str(exc))
            self._answer_error(peer, frame_error_rid(body) if body else 0, exc.code, str(exc))
            if exc.code == "too_large" and nbytes >= _RELEASE_AFTER_BYTES:
                self._release_memory_soon()
            return
        why = refusal(self.name, msg, peer, self.settings.job_token, user, self.curve, self.authorize)
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
        # Start the handler right here: most finish without suspending (hmp.transport.eager).
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
        metrics.served[type(msg)] = metrics.served.get(type(msg), 0) + 1

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
        if rid == 0:  # one-way (or unreadable rid): not answered, but where its kind asks (docs/protocol.md)
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
            locate, arena, who = self._shm.reply_locate(peer, held, self.stats)
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
