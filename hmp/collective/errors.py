"""The collective's errors, subclasses of :class:`hmp.errors.HmpError` kept here so that this package
stays self-contained (move them to ``hmp/errors.py`` if other layers come to need them):
:class:`RingError`, the collective cannot be used as asked (closed, aborted by the caller), and its
subclass :class:`RingBroken`, an operation cannot complete because of one rank (no progress within
``timeout_s``: dead, partitioned or stuck; or it refused a piece).
"""

from __future__ import annotations

from hmp.errors import HmpError


class RingError(HmpError):
    """The ring cannot run the operation (closed, aborted)."""


class RingBroken(RingError):
    """An all-reduce cannot complete because of rank ``blamed`` (-1: none, the caller aborted the
    ring; ``address`` its server).

    ``code`` says how: ``"timeout"`` (no progress for ``timeout_s``: the rank is dead, stuck or
    unreachable), ``"closed"`` (our connection to it closed), or the error code the rank answered
    one of our pieces with (``"stale_ring"``, ``"bad_piece"``, ``"ring_aborted"``, ...).
    """

    def __init__(self, message: str, *, blamed: int, address: str = "", code: str = "timeout") -> None:
        super().__init__(message)
        self.blamed, self.address, self.code = blamed, address, code


__all__ = ["RingBroken", "RingError"]
