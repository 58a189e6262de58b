"""Receive-side guards: what a daemon does with a message before the codec sees it.

The codec bounds what a message costs to decode (:class:`hmp.transport.codec.Limits`); reading its
parts and buffering its frames come before that and are bounded here: :class:`PartReader` reads a
bounded number of parts per event-loop turn and turns an over-long message into an
:class:`Overlong` to refuse, :func:`max_frame_bytes` sizes libzmq's frame limit and
:func:`release_memory` gives the memory back. Why these bounds: docs/protocol.md, "Limits".
"""

from __future__ import annotations

import ctypes
import dataclasses
import platform
from typing import Any

import zmq

from hmp.errors import ProtocolError
from hmp.transport.codec import Limits

_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)

#: Parts read per turn of the event loop (docs/protocol.md, "Limits"); a message with
#: more parts is read over several turns, with the loop's other callbacks (heartbeats) in between.
PARTS_PER_TURN = 1024

#: Slack over the largest frame for ``zmq.MAXMSGSIZE``: msgpack headers and tensors cut at
#: ``frame_bytes`` never exceed it, and a header is bounded by ``max_header_bytes`` itself.
FRAME_SLACK = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class Overlong:
    """A message with more parts than allowed: its first parts (as read), how many it had, and the bytes of
    all of them (what the receiver held for it: see :func:`release_memory`)."""

    head: list[Any]
    parts: int
    nbytes: int = 0


class PartReader:
    """Reads one multipart message after another from a socket, a bounded number of parts per turn.

    ``read()`` returns the next message's parts (the first ``copied`` as ``bytes``, the rest as
    zero-copy ``zmq.Frame``), an :class:`Overlong` for a message of more than ``max_parts`` parts
    (keeping its first ``head`` parts, by default ``copied``),
    or None: nothing to read (``zmq.Again``), or this turn's budget ran out (then ``spent`` is True,
    and ``mid_message`` too when it ran out in the middle of a message; either way the caller must
    call again on a later turn: libzmq signals nothing new for what it already holds). ``turn()``
    starts a new budget. Only this reader may receive on the socket; sends in between are fine.
    """

    def __init__(self, sock: zmq.Socket, copied: int, max_parts: int, parts_per_turn: int = PARTS_PER_TURN, *,
                 head: int | None = None) -> None:
        self.head = copied if head is None else head  #: leading parts an Overlong keeps (routing id, header)
        if max_parts < max(copied, self.head, 1) or parts_per_turn < 1:
            raise ValueError(f"max_parts must be >= {max(copied, self.head, 1)} and parts_per_turn >= 1, "
                             f"got {max_parts} and {parts_per_turn}")
        self.sock = sock
        self.copied = copied
        self.max_parts = max_parts
        self.parts_per_turn = parts_per_turn
        self._left = parts_per_turn
        self._parts: list[Any] | None = None  # the message being read (None: between messages)
        self._count = 0  # its parts so far, kept or not
        self._dropped = 0  # the bytes of its parts past max_parts
        self.overlong = 0  #: over-long messages read so far

    @classmethod
    def for_limits(cls, sock: zmq.Socket, copied: int, limits: Limits, parts_per_turn: int = PARTS_PER_TURN, *,
                   head: int | None = None) -> PartReader:
        """A reader for messages of ``head`` leading parts (routing id and header; default ``copied``)
        plus at most ``limits.max_frames`` data frames."""
        head = copied if head is None else head
        return cls(sock, copied, head + limits.max_frames, parts_per_turn, head=head)

    @property
    def mid_message(self) -> bool:
        """True when the last ``read()`` stopped inside a message (call again on a later turn)."""
        return self._parts is not None

    @property
    def spent(self) -> bool:
        """True when this turn's budget is used up: a ``read()`` returning None may have left messages
        unread (libzmq signals nothing new for them), so the caller must call again on a later turn."""
        return self._left <= 0

    def turn(self) -> None:
        """Start a new turn's budget of ``parts_per_turn`` parts."""
        self._left = self.parts_per_turn

    def read(self) -> list[Any] | Overlong | None:
        # The hot receive path: every message passes here, so the counters live in locals and go
        # back to the instance only where the call returns.
        sock = self.sock
        parts = self._parts
        left = self._left
        if parts is None:
            if left <= 0:
                return None
            try:
                first = sock.recv(_NOBLOCK, copy=self.copied > 0)
            except zmq.Again:
                return None
            left -= 1
            parts, count, dropped = [first], 1, 0
        else:
            count, dropped = self._count, self._dropped
        # Once the first part is readable the whole message is (libzmq delivers messages
        # atomically), so NOBLOCK never fails below.
        copied, keep = self.copied, self.max_parts
        recv, get = sock.recv, sock.get
        while get(_RCVMORE):
            if left <= 0:
                self._parts, self._count, self._dropped, self._left = parts, count, dropped, 0
                return None
            left -= 1
            part = recv(_NOBLOCK, copy=count < copied)
            count += 1
            if count <= keep:
                parts.append(part)
            else:  # dropped here, its buffer freed with it
                dropped += len(part)
        self._left = left
        self._parts = None
        if count > keep:
            self.overlong += 1
            return Overlong(parts[:self.head], count, dropped + sum(len(p) for p in parts))
        return parts


def overlong_error(message: Overlong, head: int, limits: Limits) -> ProtocolError:
    """The ``too_large`` error for an over-long message of ``head`` leading parts (routing id, header) and
    data frames: what decode would say."""
    frames = message.parts - head
    return ProtocolError(f"{frames} data frames exceed the limit of {limits.max_frames}", "too_large")


def max_frame_bytes(limits: Limits, frame_bytes: int) -> int:
    """``zmq.MAXMSGSIZE`` for a socket of a job cutting tensors at ``frame_bytes``: its largest frame
    (a tensor frame or a header) plus :data:`FRAME_SLACK`. A larger frame drops the connection
    before it is buffered; the sender sees no error, only a request timeout, so peers must agree
    on ``frame_bytes`` (a job's daemons share ``[limits] frame_bytes``)."""
    return max(min(frame_bytes, limits.max_message_bytes), limits.max_header_bytes) + FRAME_SLACK


def release_memory() -> bool:
    """Give freed heap memory back to the OS now (glibc ``malloc_trim(0)``); False where not glibc.

    For after refusing a large message: :func:`hmp.transport.endpoint.tune_malloc` keeps freed
    receive buffers mapped on purpose (up to its ``retain_bytes`` at the top of the heap, and any
    amount below live allocations), so a refused 3 GiB message would otherwise stay in the RSS.
    Costs a walk of the heap and a page release per freed page (docs/protocol.md, "Flow control"),
    so call it rarely: after a refused message of many megabytes,
    not per message.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


__all__ = ["FRAME_SLACK", "PARTS_PER_TURN", "Overlong", "PartReader", "max_frame_bytes", "overlong_error",
           "release_memory"]
