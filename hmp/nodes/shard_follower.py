"""What a PS worker (:mod:`hmp.nodes.worker`, :mod:`hmp.nodes.stage_worker`) knows of the shards: the
scheduler's ``shards`` messages (docs/protocol.md, "Shard restarts").

A mixin of the worker nodes: the addresses as the scheduler last said, which shards are down, and a
future resolved at the next change, which a push in flight races against (``with_shards`` in each
worker). An older change arriving after a newer one is ignored (``epoch``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from hmp.errors import RemoteError, RequestError, TransportError
from hmp.messages import Ack, Message, Shards, WelcomeInfo


class ShardFollower:
    """Mixed into a :class:`hmp.nodes.base.Node` subclass; call :meth:`init_shard_view` in ``__init__``."""

    cfg: Any
    log: Any
    push_retries: int

    def init_shard_view(self) -> None:
        self.shard_epoch = 0
        self.shard_addresses: dict[str, str] = {}
        self.shards_down: set[str] = set()
        self._shards_changed: asyncio.Future | None = None

    async def on_shards(self, msg: Shards, peer: bytes) -> Message:
        """The scheduler: a shard went down or came back. Only the scheduler may say so."""
        scheduler = self.cfg.scheduler.id
        if msg.sender != scheduler:
            raise RequestError(f"shards from {msg.sender!r}: only the scheduler ({scheduler!r}) may send it",
                               "unauthorized")
        if msg.epoch <= self.shard_epoch:
            return Ack(detail=f"change {msg.epoch} is older than {self.shard_epoch}")
        self._learn_shards(msg.epoch, msg.shards, msg.down)
        self.log.warning("shards_changed", epoch=msg.epoch, down=sorted(self.shards_down))
        if self._shards_changed is not None and not self._shards_changed.done():
            self._shards_changed.set_result(msg.epoch)
        # The version of the last reply from each shard: how far a shard that died had got (the report's
        # updates lost are counted from it).
        versions = dict(getattr(getattr(self, "ps", None), "shard_versions", {}) or {})
        return Ack(detail=json.dumps({"versions": versions}))

    def learn_welcome_shards(self, info: WelcomeInfo) -> None:
        """The welcome's view of the shards, unless a ``shards`` message since said more."""
        if (info.shard_epoch or 0) > self.shard_epoch:
            self._learn_shards(info.shard_epoch, info.shards, info.shards_down or ())

    def _learn_shards(self, epoch: int, shards: Any, down: Any) -> None:
        self.shard_epoch = epoch
        self.shard_addresses.update({str(sid): str(addr) for sid, addr in shards})
        self.shards_down = set(down)

    def _next_shard_change(self) -> asyncio.Future:
        if self._shards_changed is None or self._shards_changed.done():
            self._shards_changed = asyncio.get_running_loop().create_future()
        return self._shards_changed

    async def follow_shards(self, client: Any, request: Callable[[], Any], what: str) -> Any:
        """``await request()`` (a pull or a push of ``client``, a :class:`hmp.client.PSClient`) and return
        its result. While a shard is down it waits; when a shard goes down or comes back (the scheduler's
        ``shards``) with the request in flight, the request is abandoned and sent again, to the new
        addresses: a push carries the same ``seq`` each time, so a shard that applied it already does not
        apply it again. Cancelling this cancels the request (the caller races it against a stop)."""
        while True:
            while self.shards_down:  # until the scheduler says it is back (or the job fails and stops us)
                await asyncio.wait({self._next_shard_change()})
            for sid, address in client.shard_addresses:
                new = self.shard_addresses.get(sid, address)
                if new != address:
                    self.log.info("shard_moved", shard=sid, old=address, new=new)
                    await client.readdress(sid, new)
            epoch, changed = self.shard_epoch, self._next_shard_change()
            task = asyncio.ensure_future(request())
            try:
                await asyncio.wait({task, changed}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            if task.done():
                try:
                    return task.result()
                except (RemoteError, TransportError) as exc:
                    if epoch == self.shard_epoch and not self.shards_down:
                        raise
                    self.log.info(f"{what}_failed_during_shard_change", error=str(exc))
            else:  # the shards changed first: abandon this try
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self.push_retries += 1
            self.log.info(f"{what}_retry", epoch=self.shard_epoch, down=sorted(self.shards_down))
