"""Whether, and how, a Client and a Server on one host pass tensors through shared memory instead of
frames (docs/shm.md; the handshake: docs/protocol.md, "Shared memory"): the server's agreement with
each connection and its reply slots, the client's handshake state and the reply-slot references it
gives back. :mod:`hmp.transport.shm` owns the memory; this decides, per peer, when to use it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from typing import Any

import zmq

from hmp.errors import EndpointClosed, PeerLost, ProtocolError, RemoteError, RequestError
from hmp.messages import Ack, Message, ShmHello, ShmRelease
from hmp.transport import shm
from hmp.transport.codec import encode, message_tensors
from hmp.transport.shm import Arena

#: Slot references per ``shm_release`` message.
RELEASE_BATCH = 4096

#: A server that offered no shared memory (none open yet, or disabled) is asked again after this long.
RETRY_S = 10.0


def arena_of(option: Arena | bool | None) -> Arena | None:
    """The arena an endpoint's ``shm`` setting means now (:class:`~hmp.transport.settings.EndpointSettings`)."""
    if option is False:
        return None
    if option is None or option is True:
        return shm.process_arena()
    return None if option.closed else option


class ServerShm:
    """A server's side: what each connection (by routing id) agreed, the handshake's and the releases'
    handlers, and which replies' tensors go by reference."""

    def __init__(self, option: Arena | bool | None, log: Any) -> None:
        self.option = option
        self.peers: dict[bytes, shm.RequestResolver] = {}  # routing id -> what it agreed
        self.log = log

    def resolver(self, peer: bytes) -> shm.RequestResolver | None:
        """What reads ``peer``'s references in its requests (None: it agreed none)."""
        return self.peers.get(peer) if self.peers else None

    async def on_hello(self, msg: ShmHello, peer: bytes) -> Message:
        """The server's side of the handshake (docs/protocol.md, "Shared memory")."""
        arena = arena_of(self.option)
        if arena is None:
            self.peers.pop(peer, None)
            return ShmHello(host="", segment="", token="", mapped=False)
        here = shm.host_id(arena.directory)
        prefix = shm.prefix_of(msg.segment)
        if msg.mapped:  # second step: the client reads our segments
            agreed = self.peers.get(peer)
            if agreed is None or agreed.prefix != prefix:
                raise RequestError("shm: a 'mapped' hello without this connection's offer first", "bad_shm")
            agreed.replies = True
            return Ack(detail="shm replies")
        if prefix is None or msg.host != here:
            self.peers.pop(peer, None)
            return ShmHello(host=here, segment=arena.probe, token=arena.token, mapped=False)
        ok = shm.verify_probe(arena.directory, msg.segment, msg.token)
        if len(self.peers) >= 256:  # forget connections of peers that have exited
            for rid_, agreed in list(self.peers.items()):
                if not shm.owner_alive(agreed.directory, f"{agreed.prefix}.0"):
                    del self.peers[rid_]
        self.peers[peer] = shm.RequestResolver(arena.directory, prefix, ok)
        self.log.info("shm_peer", peer=prefix, requests=ok)
        return ShmHello(host=here, segment=arena.probe, token=arena.token, mapped=ok)

    async def on_release(self, msg: ShmRelease, peer: bytes) -> Message | None:
        arena = arena_of(self.option)
        prefix = shm.prefix_of(msg.segment)
        if arena is not None and prefix is not None:
            unknown = arena.release(msg.slots, prefix)
            if unknown:
                self.log.debug("shm_release_unknown", peer=prefix, slots=unknown)
        return None if msg.rid == 0 else Ack()

    def reply_locate(self, peer: bytes, held: list[int], stats: dict[str, int]) -> tuple[Any, Arena | None, str]:
        """The ``locate`` for a reply to ``peer`` (None unless it maps our reply slots), the arena and the
        peer's prefix; the slots referenced are appended to ``held``."""
        agreed = self.resolver(peer)
        arena = arena_of(self.option) if agreed is not None and agreed.replies else None
        if arena is None:
            return None, None, ""

        def locate(t: Any) -> Any:
            ref = arena.reply_ref(t)
            if ref is not None:
                held.append(ref[2])
                stats["shm_bytes_out"] += t.numel() * t.element_size()
            return ref
        return locate, arena, agreed.prefix


@dataclasses.dataclass(eq=False)
class ShmLink:
    """What a client agreed with its server: ``send`` (the server maps our arena), ``resolver`` (we
    map its reply slots; None: replies inline)."""

    arena: Arena
    send: bool
    resolver: shm.ReplyResolver | None


class ClientShm:
    """A client's side: the handshake (``state`` new -> pending -> on | off), the link it agreed, and the
    reply-slot references given back once their last view is gone (one-way ``shm_release``, batched)."""

    def __init__(self, client: Any) -> None:
        self.client = client  # an hmp.transport.Client: its requests, channel, name and settings
        self.option: Arena | bool | None = client.settings.shm
        self.state = "off" if self.option is False else "new"
        self.wait: asyncio.Future | None = None
        self.not_before = 0.0  # loop time before which no new handshake is tried
        self.retry = False  # the last handshake found a server without an arena
        self.link: ShmLink | None = None
        #: reads the server's reply slots; kept when the link is dropped, for replies still on the way
        self.resolve: shm.ReplyResolver | None = None
        self.released: collections.deque[int] = collections.deque()  # slots to return (any thread)
        self.release_scheduled = False
        self.release_as = ""  # our probe, as the server knows us
        self.release_tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def wants_handshake(self) -> bool:
        return self.state != "off" and self.link is None and (self.state == "pending"
                                                              or arena_of(self.option) is not None)

    def lender(self, link: ShmLink, used: list[int] | None) -> Any:
        """``locate`` for encode: the reference of a tensor in ``link``'s arena (None: inline)."""
        arena, stats = link.arena, self.client.stats

        def locate(t: Any) -> Any:
            ref = arena.request_ref(t)
            if ref is not None:
                n = t.numel() * t.element_size()
                if used is not None:
                    used.append(n)
                stats["shm_bytes_out"] += n
            return ref
        return locate

    def drop(self, link: ShmLink) -> None:
        """The server refused ``link``'s references (``bad_shm``): shake hands again before the next request."""
        if self.link is link:
            self.link, self.state = None, "new"

    async def maybe_handshake(self, msg: Message, timeout: float) -> None:
        if self.state == "pending":
            assert self.wait is not None
            await asyncio.shield(self.wait)  # the first request's handshake; its errors are its own
            return
        if self.state != "new":
            return
        arena = arena_of(self.option)
        if arena is None or (self.not_before and asyncio.get_running_loop().time() < self.not_before):
            return
        if self.option is None and not any(arena.request_ref(t) is not None for t in message_tensors(msg)):
            return  # the process arena: only once a request carries its memory
        self.state = "pending"
        loop = asyncio.get_running_loop()
        self.wait = wait = loop.create_future()
        try:
            self.link = await self._negotiate(arena, timeout)
            self.state = "on" if self.link is not None else "off"
            if self.state == "off" and self.retry:  # the server may open its arena later
                self.state, self.not_before = "new", loop.time() + RETRY_S
            if self.link is not None and self.link.resolver is not None:
                self.resolve = self.link.resolver
        except (RemoteError, ProtocolError) as exc:  # a server that does not speak it: frames, as ever
            self.client.log.info("shm_off", reason=str(exc))
            self.state = "off"
        except BaseException:
            self.state = "new"  # timeout, closed, cancelled: the next request tries again
            raise
        finally:
            self.wait = None
            if not wait.done():
                wait.set_result(None)

    async def _negotiate(self, arena: Arena, timeout: float) -> ShmLink | None:
        """The client's side of the handshake (docs/protocol.md, "Shared memory")."""
        client = self.client
        here = shm.host_id(arena.directory)
        offer = ShmHello(host=here, segment=arena.probe, token=arena.token)
        reply = await client._request(offer, timeout, None)
        self.retry = isinstance(reply, ShmHello) and not reply.segment  # it offers none (yet)
        if not isinstance(reply, ShmHello):
            return None
        send = bool(reply.mapped)
        resolver = None
        prefix = shm.prefix_of(reply.segment)
        if reply.host == here and prefix is not None and shm.verify_probe(arena.directory, reply.segment,
                                                                          reply.token):
            await client._request(offer.replace(mapped=True), timeout, None)
            resolver = shm.ReplyResolver(arena.directory, prefix, self._release_slot)
        if not send and resolver is None:
            client.log.info("shm_off", reason="the server cannot map this process's segments nor we its",
                            server_host=reply.host == here)
            return None
        self.release_as = arena.probe
        client.log.info("shm_on", server=prefix, requests=send, replies=resolver is not None)
        return ShmLink(arena, send, resolver)

    def _release_slot(self, slot: int) -> None:
        """Queue one reply-slot reference for release; called by finalizers, from any thread."""
        self.released.append(slot)
        if not self.release_scheduled:
            self.release_scheduled = True
            loop = self.loop
            try:
                if loop is not None:
                    loop.call_soon_threadsafe(self.flush_releases)
            except RuntimeError:  # the loop is closed: the server reclaims when we exit
                pass

    def flush_releases(self) -> None:
        """Send the queued releases (one-way ``shm_release`` messages; never waits)."""
        self.release_scheduled = False
        slots = []
        while self.released:
            slots.append(self.released.popleft())
        client = self.client
        chan = client._chan
        if not slots or chan is None or not self.release_as:
            return
        settings = client.settings
        for i in range(0, len(slots), RELEASE_BATCH):
            frames = encode(ShmRelease(segment=self.release_as, slots=tuple(slots[i:i + RELEASE_BATCH])),
                            settings.frame_bytes, sender=client.name, job_token=settings.job_token or None)
            try:
                chan.send_now(frames, False)
            except zmq.Again:  # no room now: a task waits for it (releases are never dropped for that)
                task = chan.loop.create_task(self._send_later(frames))
                self.release_tasks.add(task)
                task.add_done_callback(self.release_tasks.discard)
            except (zmq.ZMQError, PeerLost, EndpointClosed) as exc:
                client.log.info("shm_release_not_sent", slots=len(slots), error=str(exc))

    async def _send_later(self, frames: list[Any]) -> None:
        chan = self.client._chan
        if chan is None:
            return
        with contextlib.suppress(zmq.ZMQError, PeerLost, EndpointClosed):
            await chan.send(frames, False)

    def close(self) -> None:
        self.flush_releases()  # what is queued goes now; later ones are reclaimed when this process exits
        for task in list(self.release_tasks):
            task.cancel()
