"""The PS shard daemon: serves push/pull/init for the chunks placed on it.

Where a message is handled: ``on_push`` validates, then applies (async), waits for the SSP bound
(ssp) or for the round to complete (sync), and answers with the chunks' new values: the reply is
the shard's own chunk tensors sent zero-copy, so before a chunk is mutated again the shard waits
until libzmq has finished sending every reply that still references it (``_replies_in_flight``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from hmp import job
from hmp.config import Config
from hmp.errors import RequestError
from hmp.messages import Ack, Init, Kind, Leave, Message, Params, Pull, Push
from hmp.nodes.base import Node
from hmp.ps.optim import chunk_optimizer_of
from hmp.ps.shard_core import ShardCore


class PSShardNode(Node):
    role = "ps"

    def __init__(self, cfg: Config, node_id: str, resume: bool = False) -> None:
        super().__init__(cfg, node_id)
        sharded = job.sharded_model(cfg)
        index = [s.id for s in cfg.shards].index(node_id)
        initial = sharded.initial_chunks(index)
        self.core = ShardCore(node_id, initial, *chunk_optimizer_of(cfg), cfg.train.consistency, cfg.train.staleness)
        self.core.live_workers = {w.id for w in cfg.workers}
        self.core.clock = {w.id: 0 for w in cfg.workers}
        ckdir = cfg.ps.checkpoint_dir or str(cfg.report_dir / "checkpoints")
        self.checkpoint_path = Path(ckdir) / f"{node_id}.pt"
        if resume:
            if not self.checkpoint_path.exists():
                raise RequestError(f"--resume: no checkpoint at {self.checkpoint_path}", "no_checkpoint")
            self.core.load(self.checkpoint_path)
            self.log.info("resumed", path=str(self.checkpoint_path), version=self.core.version)
        self.log.info("chunks_owned", chunks=len(initial), bytes=sum(t.numel() * t.element_size() for t in initial.values()))
        self._changed = asyncio.Condition()  # ssp clocks / sync rounds advance
        self._round_done: asyncio.Future | None = None
        self._replies_in_flight: list = []  # (tracker, give-up time) of replies libzmq still holds
        self._sending: dict[object, float] = {}  # replies being handed to libzmq: token -> since when
        self._updates_begun = 0  # updates that have had to wait in _before_mutation
        self._updates_done = 0  # ... and have finished waiting
        self._update_passed = asyncio.Event()  # set (and replaced) each time one finishes waiting
        self._last_checkpoint = 0
        self.stats = {"pushes": 0, "pulls": 0, "rejected": 0}
        # A sweep's members are independent: one diverging member's NaN stays in its own slice of
        # every chunk, and refusing the push would stop the others too (its report shows it).
        self.reject_nonfinite = cfg.ps.reject_nonfinite and not cfg.sweep.members

    def handlers(self):
        return {**super().handlers(), Kind.PUSH: self.on_push, Kind.PULL: self.on_pull, Kind.INIT: self.on_init,
                Kind.LEAVE: self.on_leave}

    def status(self) -> dict[str, Any]:
        st = super().status()
        st.update(version=self.core.version, updates=self.core.updates_applied, samples=self.core.samples,
                  chunks=len(self.core.chunks), live_workers=sorted(self.core.live_workers), **self.stats)
        return st

    async def _before_mutation(self) -> None:
        """Wait until no reply references the chunks' current values any more.

        Replies send the chunk tensors themselves (zero-copy), so a chunk must not change while
        libzmq still holds a reply's frames: those already handed over (``track=True``
        trackers) and those being handed over (``_sending``). Every mutation waits on the same
        shared list (a second concurrent update must wait for the same replies), and a reply
        arriving while updates wait lets those updates go first (``_reply``): a steady stream
        of pulls cannot hold an update back. A reply not sent after ``request_timeout_s`` (a
        peer that stopped reading) is given up with a warning rather than failing the update.
        """
        if not self._replies_in_flight and not self._sending:
            return
        loop = asyncio.get_running_loop()
        limit = self.cfg.limits.request_timeout_s
        self._updates_begun += 1
        warned = False
        try:
            while True:
                now, keep = loop.time(), []
                for tracker, give_up_at in self._replies_in_flight:
                    if tracker.done:
                        continue
                    if now > give_up_at:
                        self.log.warning("reply_send_stuck", waited_s=limit,
                                         effect="the reply may carry values of the next update")
                        continue
                    keep.append((tracker, give_up_at))
                self._replies_in_flight = keep
                sending = [t for t in self._sending.values() if now - t <= limit]
                if len(sending) < len(self._sending) and not warned:
                    warned = True
                    self.log.warning("reply_hand_over_stuck", waited_s=limit,
                                     effect="the reply may carry values of the next update")
                if not keep and not sending:
                    return
                await asyncio.sleep(0.0005)
        finally:
            self._updates_done += 1
            passed, self._update_passed = self._update_passed, asyncio.Event()
            passed.set()

    async def _reply(self, peer: bytes, rid: int, keys: tuple[int, ...]) -> None:
        assert self.server is not None
        if rid == 0:  # a one-way push (protocol.md): applied, not answered
            return
        # Updates already waiting for in-flight replies go first (later ones do not hold this
        # reply back: it waits for as many updates to pass as were waiting when it came).
        waiting_for = self._updates_begun
        while self._updates_done < waiting_for:
            await self._update_passed.wait()
        # From here to the tracker's registration this reply counts as being sent: an update
        # starting meanwhile (the send may wait for room) waits for it.
        token = object()
        self._sending[token] = asyncio.get_running_loop().time()
        try:
            msg = Params(sender=self.id, rid=rid, keys=keys, values=self.core.values(keys), version=self.core.version)
            tracker = await self.server.send(peer, msg, track=True)
            if tracker is not None and not tracker.done:
                give_up_at = asyncio.get_running_loop().time() + self.cfg.limits.request_timeout_s
                self._replies_in_flight.append((tracker, give_up_at))
        finally:
            del self._sending[token]

    async def on_push(self, msg: Push, peer: bytes) -> None:
        try:
            self.core.check(msg.keys, msg.grads, "push")
            if self.reject_nonfinite:
                self.core.check_finite(msg.keys, msg.grads, "push")
        except RequestError:
            self.stats["rejected"] += 1
            raise
        self.stats["pushes"] += 1
        worker = msg.sender
        timeout = self.cfg.limits.request_timeout_s
        if self.core.consistency == "sync":
            if worker not in self.core.live_workers:
                raise RequestError(f"{worker} is not in this sync group ({sorted(self.core.live_workers)})", "bad_request")
            if self._round_done is None or self._round_done.done():
                self._round_done = asyncio.get_running_loop().create_future()
            round_done = self._round_done
            self.core.contribute(worker, msg.keys, msg.grads, msg.samples)
            await self._maybe_finish_round()
            try:
                await asyncio.wait_for(asyncio.shield(round_done), timeout)
            except TimeoutError:
                raise RequestError(f"sync round {self.core.version} incomplete after {timeout} s; waiting for "
                                   f"{sorted(self.core.live_workers - self.core.round_members)}", "timeout") from None
        else:
            if not self.core.ssp_ready(worker):
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait_for(lambda: self.core.ssp_ready(worker)), timeout)
                    except TimeoutError:
                        raise RequestError(f"{worker} stayed more than {self.core.staleness} updates ahead for "
                                           f"{timeout} s", "timeout") from None
            await self._before_mutation()
            self.core.apply(worker, msg.keys, msg.grads, msg.samples)
            async with self._changed:
                self._changed.notify_all()
            self._maybe_checkpoint()
        await self._reply(peer, msg.rid, msg.keys)

    async def _maybe_finish_round(self) -> None:
        if self.core.consistency == "sync" and self.core.round_complete():
            await self._before_mutation()
            if not self.core.round_complete():
                return  # another push or leave finished this round while we waited
            self.core.finish_round()
            if self._round_done is not None and not self._round_done.done():
                self._round_done.set_result(self.core.version)
            self._maybe_checkpoint()

    async def on_pull(self, msg: Pull, peer: bytes) -> None:
        self.core.check_keys(msg.keys)
        self.stats["pulls"] += 1
        await self._reply(peer, msg.rid, msg.keys)

    async def on_init(self, msg: Init, peer: bytes) -> Message:
        self.core.check(msg.keys, msg.values, "init")
        if self.reject_nonfinite:
            self.core.check_finite(msg.keys, msg.values, "init")
        await self._before_mutation()
        self.core.set_values(msg.keys, msg.values)
        return Ack(detail=f"{len(msg.keys)} chunks set")

    async def on_leave(self, msg: Leave, peer: bytes) -> Message:
        """A worker is done: it no longer holds back sync rounds or the SSP bound."""
        self.core.remove_worker(msg.sender)
        self.log.info("worker_left", worker=msg.sender)
        await self._maybe_finish_round()
        async with self._changed:
            self._changed.notify_all()
        return Ack()

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.ps.checkpoint_every
        if every and self.core.updates_applied - self._last_checkpoint >= every:
            self.checkpoint()

    def checkpoint(self) -> None:
        t0 = time.perf_counter()
        self.core.save(self.checkpoint_path)
        self._last_checkpoint = self.core.updates_applied
        self.log.info("checkpoint_written", path=str(self.checkpoint_path), version=self.core.version,
                      seconds=round(time.perf_counter() - t0, 4))

    async def main(self) -> None:
        if await self.join() is None:
            return
        hb = asyncio.create_task(self.heartbeat_loop(), name="heartbeat")
        try:
            await self.stopping.wait()
        finally:
            hb.cancel()
            await asyncio.gather(hb, return_exceptions=True)
            self.step = self.core.version
            self.checkpoint()
            await self.leave(self.failed or "stopped")
