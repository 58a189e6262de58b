"""The one exception tree of hmp.

::

    HmpError
    ├── ProtocolError        a frame sequence that is not a valid hmp message (codec)
    ├── ConfigError          a bad config file: names the file, the key and what was expected
    ├── RequestError         a well-formed request a handler refuses (wrong shape, unknown key, ...)
    ├── RemoteError          the peer answered a request with an error reply
    └── TransportError       the connection, not the content, failed
        ├── RequestTimeout   no reply within the timeout
        ├── PeerLost         the peer was declared lost (missed heartbeats) or closed
        └── EndpointClosed   the local endpoint was closed while the request was pending

A daemon turns ``ProtocolError`` and ``RequestError`` raised while serving a request into an
error reply (see docs/protocol.md, "Error replies") and keeps serving; the client side raises
``RemoteError`` carrying the reply's ``code`` and ``message``.
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
