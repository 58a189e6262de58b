"""Who may talk to whom (docs/protocol.md, "Trust"; docs/security.md): the checks a server makes of
every decoded message before its handler (the job token, the CURVE key's sender id, the node's
``authorize`` table), and a client's watch over its CURVE handshake, which fails its requests at once
rather than at their timeout. Kept apart from the sockets they guard so that they read as one list."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq

from hmp.messages import Message
from hmp.transport import security as sec
from hmp.transport.ratelimit import RateLimitedLog
from hmp.transport.security import Curve, HandshakeFailed

#: ``authorize(msg, peer)`` -> None to serve ``msg``, or the reason it is refused (``unauthorized``)
Authorize = Callable[[Message, bytes], "str | None"]


def curve_user(body: list[Any]) -> str | None:
    """The CURVE key name (User-Id) of the connection ``body`` came over, turning its header frame into
    bytes; None when the header came as bytes (a server without CURVE copies it)."""
    if not body or not isinstance(body[0], zmq.Frame):
        return None
    try:
        user = body[0].get("User-Id")
    except zmq.ZMQError:
        user = ""
    body[0] = body[0].bytes
    return user


def refusal(server: str, msg: Message, peer: bytes, job_token: str, user: str | None, curve: Curve | None,
            authorize: Authorize | None) -> str | None:
    """Why ``server`` refuses ``msg`` from connection ``peer`` (answered ``unauthorized``), or None to serve it."""
    if job_token and msg.job_token != job_token:
        # Never echo either token: the refusal must not teach a stranger the job's identity.
        return (f"{server} refuses {msg.kind.value!r} from {msg.sender or '?'!r}: the job token "
                f"{'is missing' if not msg.job_token else 'does not match'} (another job, or a client "
                f"without this job's token)")
    if user is not None and curve is not None and not sec.sender_bound(msg.sender, user, curve):
        return (f"{server} refuses {msg.kind.value!r} from {msg.sender or '?'!r}: the connection's CURVE key "
                f"is {user or 'unnamed'!r}, and a key speaks only for its own node")
    return None if authorize is None else authorize(msg, peer)


class ClientHandshake:
    """A CURVE client socket's handshake, watched (:class:`hmp.transport.security.HandshakeWatch`): a refused
    handshake fails the client's pending requests (``fail_pending``) at once, and a request waits no longer
    than ``handshake_timeout_s`` of connection without one (a server that cannot read our hello answers
    nothing at all)."""

    def __init__(self, sock: zmq.Socket, curve: Curve, name: str, address: str, warnings: RateLimitedLog,
                 fail_pending: Callable[[Exception], int]) -> None:
        self.curve, self.name, self.address, self.warnings = curve, name, address, warnings
        self._fail_pending = fail_pending
        self.watch = sec.HandshakeWatch(sock, self._failed)

    def error(self, reason: str) -> HandshakeFailed:
        return HandshakeFailed(f"{self.name}: the CURVE handshake with {self.address} failed: {reason} "
                               f"(key folder {self.curve.key_dir}, this client's key {self.curve.name!r})")

    def _failed(self, reason: str) -> None:
        """The server refused the handshake (monitor event): fail what waits now, not at its timeout."""
        self.warnings.warning("curve_handshake_failed", "handshake_failed", error=reason)
        self._fail_pending(self.error(reason))

    def guard(self, fut: asyncio.Future[Any]) -> None:
        """Watch a new request's future until the handshake is done."""
        watch = self.watch
        if watch.ok:
            return
        if watch.error:  # the last handshake was refused: say so now rather than wait
            fut.set_exception(self.error(watch.error))
        else:
            self._check(fut)

    def _check(self, fut: asyncio.Future[Any]) -> None:
        watch, timeout = self.watch, self.curve.handshake_timeout_s
        if fut.done() or watch.ok:
            return
        if watch.stalled(timeout):
            self.warnings.warning("curve_handshake_failed", "handshake_timeout", waited_s=timeout)
            fut.set_exception(self.error(watch.error or f"no handshake within {timeout} s (the server has another "
                                                        f"key, or does not speak CURVE)"))
            return
        # No connection yet (the server may be starting), or one younger than the timeout: look again.
        watch.loop.call_later(min(0.25, timeout / 4), self._check, fut)

    def close(self) -> None:
        self.watch.close()
