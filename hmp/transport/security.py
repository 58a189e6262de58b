"""ZeroMQ CURVE for hmp's endpoints: keys, the ZAP handler that admits the job's peers, handshake watch.

With ``[security] curve = true`` every server uses the job's server keypair and admits only clients
whose public key is in the job's key folder (:class:`KeyAuthenticator`), binding each connection to
its key's name so that message senders are no longer self-asserted (:func:`sender_bound`); a client
whose handshake fails gets :class:`HandshakeFailed` instead of hanging. What the keys prove and how
a job uses them: docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import zmq
from zmq.auth.certs import load_certificate
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from hmp.errors import ConfigError, TransportError
from hmp.transport.ratelimit import RateLimitedLog

log = structlog.get_logger("hmp.transport")

#: The name of the job's server keypair (every daemon's server uses it; clients need its public half).
SERVER_KEY = "server"

#: The ZAP domain of hmp's servers.
ZAP_DOMAIN = "hmp"

#: Socket monitor events a client watches.
_WATCHED = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class HandshakeFailed(TransportError):
    """A CURVE handshake with a peer failed (refused key, wrong server key, or a peer without CURVE)."""


@dataclasses.dataclass(frozen=True)
class Curve:
    """What one process needs for CURVE: its own keypair (``name``), the job's server keypair (the
    secret half only where the process serves), and the allowed public keys (name by z85 key)."""

    key_dir: Path
    name: str
    public: bytes
    secret: bytes
    server_public: bytes
    server_secret: bytes | None
    allowed: Mapping[bytes, str]
    handshake_timeout_s: float = 5.0

    @classmethod
    def load(cls, key_dir: str | os.PathLike, name: str, *, serve: bool = True, handshake_timeout_s: float = 5.0,
             config_path: str = "") -> Curve:
        """The keys of ``name`` from ``key_dir`` (written by ``hmp-keygen``). ``serve``: this process
        runs servers and needs ``server.key_secret``. Missing or unreadable files raise ConfigError
        naming the file (``config_path``: the config that pointed here, for the message)."""
        folder = Path(key_dir)
        where = config_path or str(folder)

        def read(stem: str, secret: bool) -> tuple[bytes, bytes | None]:
            path = folder / f"{stem}.key{'_secret' if secret else ''}"
            try:
                public, sec = load_certificate(path)
            except (OSError, ValueError) as exc:
                raise ConfigError(where, "security.key_dir", f"a readable {path} (make it with hmp-keygen "
                                  f"{folder} --nodes ...): {exc}") from None
            if secret and not sec:
                raise ConfigError(where, "security.key_dir", f"a secret key in {path}")
            return public, sec

        public, secret = read(name, True)
        server_public, server_secret = read(SERVER_KEY, serve)
        allowed: dict[bytes, str] = {}
        for path in sorted(folder.glob("*.key")):
            if path.stem == SERVER_KEY:
                continue  # the server key is no client's: nobody connects as "server"
            with contextlib.suppress(OSError, ValueError):
                allowed[load_certificate(path)[0]] = path.stem
        assert secret is not None
        return cls(folder, name, public, secret, server_public, server_secret if serve else None, allowed,
                   handshake_timeout_s)

    def apply_server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before bind) a CURVE server with the job's server key, behind the ZAP handler."""
        if self.server_secret is None:
            raise ValueError(f"{self.name}: no server secret key loaded (Curve.load(serve=True))")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(self.handshake_timeout_s * 1000)))

    def apply_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before connect) a CURVE client with this process's keypair."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(self.handshake_timeout_s * 1000)))


def from_config(cfg: Any, name: str, *, serve: bool = True) -> Curve | None:
    """``name``'s CURVE settings from a job config (``[security]``), or None when CURVE is off."""
    sec = cfg.security
    if not sec.curve:
        return None
    if not sec.key_dir:
        raise ConfigError(cfg.path, "security.key_dir", "the folder hmp-keygen wrote, when curve = true")
    if sec.handshake_timeout_s <= 0:
        raise ConfigError(cfg.path, "security.handshake_timeout_s", f"a positive number, got {sec.handshake_timeout_s}")
    return Curve.load(cfg.resolve(sec.key_dir), name, serve=serve, handshake_timeout_s=sec.handshake_timeout_s,
                      config_path=str(cfg.path))


def sender_bound(sender: str, user: str, curve: Curve) -> bool:
    """Whether a message claiming ``sender`` may come over a connection authenticated as key ``user``:
    the key's own name, or a name of its own clients (``user-...``, e.g. ``cpu0-eval``, ``cpu0->1``)
    that is not another key's name."""
    if sender == user:
        return True
    return sender.startswith(user + "-") and sender not in curve.allowed.values()


# ------------------------------------------------------------------------- the ZAP handler
_ZAP_VERSION = b"1.0"


class KeyAuthenticator:
    """The ZAP handler of one zmq context (RFC 27), on the running loop: admits the CURVE public keys
    of ``curve.allowed`` with their names as User-Id, refuses any other key (``curve_refused`` in the
    log with the peer's address, rate-limited), and lets NULL connections through (plain sockets
    of the same context; they set no ZAP domain, so libzmq does not ask). A REP socket bound to
    ``inproc://zeromq.zap.01`` and read from a loop reader: pyzmq's AsyncioAuthenticator polls a
    plain socket through zmq.asyncio and spins on this context."""

    def __init__(self, ctx: zmq.Context, curve: Curve) -> None:
        self.allowed = dict(curve.allowed)
        self.refused = 0
        self.warnings = RateLimitedLog(log.bind(node=curve.name))
        self.loop = asyncio.get_running_loop()
        self.sock = ctx.socket(zmq.REP, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind("inproc://zeromq.zap.01")
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        self._fd = self.sock.getsockopt(zmq.FD)
        self.loop.add_reader(self._fd, self._drain)
        self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        sock = self.sock
        if sock.closed:
            return
        while True:
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(self.answer(request), zmq.NOBLOCK)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: ``[version, request id, status, text, user id, metadata]``."""
        if len(request) < 6:
            return [_ZAP_VERSION, request[1] if len(request) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, rid, _domain, address, _identity, mechanism = request[:6]
        if version != _ZAP_VERSION:
            return [_ZAP_VERSION, rid, b"400", b"unknown ZAP version", b"", b""]
        if mechanism == b"NULL":
            return [_ZAP_VERSION, rid, b"200", b"OK", b"", b""]
        peer = address.decode("utf-8", "replace")
        if mechanism == b"CURVE" and len(request) > 6 and len(request[6]) == 32:
            key = z85.encode(request[6])
            name = self.allowed.get(key)
            if name is not None:
                return [_ZAP_VERSION, rid, b"200", b"OK", name.encode(), b""]
            self.refused += 1
            self.warnings.warning("curve_refused", "unknown_key", peer=peer, public_key=key.decode("ascii"),
                                  error="a CURVE client whose public key is not in the job's key folder")
            return [_ZAP_VERSION, rid, b"400", b"unknown key", b"", b""]
        self.refused += 1
        self.warnings.warning("curve_refused", "bad_mechanism", peer=peer, mechanism=mechanism.decode("ascii", "replace"),
                              error="only CURVE clients with a key of the job's key folder are admitted")
        return [_ZAP_VERSION, rid, b"400", b"mechanism not allowed", b"", b""]

    def stop(self) -> None:
        self.warnings.flush()
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        self.sock.close(linger=0)


_authenticators: dict[int, list[Any]] = {}  # id(ctx) -> [authenticator, servers using it]


def acquire_authenticator(ctx: zmq.Context, curve: Curve) -> KeyAuthenticator:
    """The ZAP handler of ``ctx`` (started on first use, on the running loop); pair with :func:`release_authenticator`.
    One per context: the first server's allowed set serves every server of the context."""
    entry = _authenticators.get(id(ctx))
    if entry is None:
        auth = KeyAuthenticator(ctx, curve)
        entry = _authenticators[id(ctx)] = [auth, 0]
    entry[1] += 1
    return entry[0]


def release_authenticator(ctx: zmq.Context) -> None:
    entry = _authenticators.get(id(ctx))
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _authenticators[id(ctx)]
        entry[0].stop()


# ------------------------------------------------------------------------- the client's handshake watch
_FAILURES = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused this client's key (not in the job's key folder)",
             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error (the peer does not speak CURVE, or keys do not "
                                                  "match)",
             zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the server did not complete it (its key is not this client's "
                                                   "server.key, or it does not speak CURVE)"}


#: What a failed handshake means on a server's side (a refused key: the ZAP handler logs it, with the peer).
SERVER_FAILURES = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a client failed the CURVE handshake (it does not speak "
                                                        "CURVE, or holds another job's server.key)",
                   zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "a client's connection failed during the CURVE handshake"}

_monitors = itertools.count(1)


class HandshakeWatch:
    """Follows a CURVE client socket's handshakes through a socket monitor, on the running loop.

    ``ok``: the current connection finished its handshake; ``error``: the last failure's reason
    (cleared by a success); ``connected_at``: loop time of the first connection since the last
    success (None: no connection yet). ``on_failure(reason)`` is called at each failure."""

    def __init__(self, sock: zmq.Socket, on_failure: Callable[[str], None],
                 reasons: Mapping[int, str] | None = None) -> None:
        self._reasons = _FAILURES if reasons is None else reasons
        self.loop = asyncio.get_running_loop()
        self.ok = False
        self.error = ""
        self.connected_at: float | None = None
        self._on_failure = on_failure
        self._sock = sock
        # Not sock.get_monitor_socket(): it opens the PAIR with the context's default socket class,
        # which for hmp's zmq.asyncio context returns futures from a NOBLOCK recv instead of raising.
        address = f"inproc://hmp-monitor-{next(_monitors)}"
        sock.monitor(address, _WATCHED)
        self._mon = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
        self._mon.setsockopt(zmq.LINGER, 0)
        self._mon.connect(address)
        self._fd = self._mon.getsockopt(zmq.FD)
        self._closed = False
        self.loop.add_reader(self._fd, self._drain)
        self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        if self._closed:
            return
        while True:
            try:
                frames = self._mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # noqa: BLE001  (a malformed monitor message: skip it)
                continue
            if event == zmq.EVENT_CONNECTED:
                if not self.ok and self.connected_at is None:
                    self.connected_at = self.loop.time()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.ok, self.error, self.connected_at = True, "", None
            elif event == zmq.EVENT_DISCONNECTED:
                self.ok = False
            elif event in self._reasons:
                self.ok, self.error = False, self._reasons[event]
                self._on_failure(self.error)

    def stalled(self, timeout_s: float) -> bool:
        """A connection has been up for ``timeout_s`` without a finished handshake."""
        return not self.ok and self.connected_at is not None and self.loop.time() - self.connected_at >= timeout_s

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._mon.close(linger=0)


__all__ = ["Curve", "HandshakeFailed", "HandshakeWatch", "KeyAuthenticator", "SERVER_KEY", "acquire_authenticator",
           "from_config", "release_authenticator", "sender_bound"]
