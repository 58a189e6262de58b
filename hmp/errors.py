"""The one exception tree of hmp.

Every error hmp raises is an :class:`HmpError`, so callers can catch hmp's failures apart from
others: :class:`ProtocolError` (not a valid message), :class:`ConfigError` (names file, key and
what was expected), :class:`RequestError` (a request a handler refuses), :class:`RemoteError` (the
peer's error reply) and :class:`TransportError` (the connection failed) with its subclasses. The
tree and how daemons turn errors into replies: docs/protocol.md, "Error replies".
"""

from __future__ import annotations


class HmpError(Exception):
    """Base class of every error hmp raises on purpose."""


class ProtocolError(HmpError):
    """Frames that do not form a valid message. ``code`` is the wire error code."""

    def __init__(self, message: str, code: str = "malformed") -> None:
        super().__init__(message)
        self.code = code


class ConfigError(HmpError):
    """A config file that cannot be used."""

    def __init__(self, path: str, key: str, expected: str) -> None:
        super().__init__(f"{path}: key {key!r}: {expected}")
        self.path, self.key, self.expected = path, key, expected


class RequestError(HmpError):
    """A handler refuses a well-formed request; becomes an error reply with ``code`` (and ``blamed``)."""

    def __init__(self, message: str, code: str = "bad_request", blamed: str = "") -> None:
        super().__init__(message)
        self.code, self.blamed = code, blamed


class RemoteError(HmpError):
    """The peer answered with an error reply."""

    def __init__(self, code: str, message: str, peer: str = "", blamed: str = "") -> None:
        super().__init__(f"{peer or 'peer'} answered {code}: {message}")
        self.code, self.remote_message, self.peer, self.blamed = code, message, peer, blamed


class TransportError(HmpError):
    """The connection, not the content, failed."""


class RequestTimeout(TransportError):
    """No reply arrived within the request's timeout."""


class PeerLost(TransportError):
    """The peer was declared lost; pending requests to it fail with this."""


class EndpointClosed(TransportError):
    """The local endpoint closed while a request was pending."""
