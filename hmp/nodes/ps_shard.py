"""The PS shard daemon: serves push/pull/init for the chunks placed on it.

Where a message is handled: ``on_push`` validates, then applies (async), waits for the SSP bound
(ssp) or for the round to complete (sync), and returns the chunks' new values, which the server
sends. A reply carries a copy of the values taken when the handler returns (see ``_params``): the
shard may change a chunk again at once, and a reply never carries values of a later update.
Checkpoints are written off the event loop from a snapshot (see ``checkpoint``).

Shared memory (``[shm]``, docs/shm.md): the shard opens its process's arena when it starts. Pushes
from workers on this host arrive as read-only views of the workers' gradient buffers (read here,
never kept past the reply), and the reply's copy of the values is made into a reply slot of the
arena, which the workers on this host read in place; everyone else gets frames as before.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from hmp import job
from hmp.config import Config, Consistency, Role
from hmp.errors import RequestError
from hmp.messages import Ack, Init, Kind, Leave, Message, Params, Pull, Push
from hmp.nodes.base import Node
from hmp.ps.optim import chunk_optimizer_of
from hmp.ps.shard_core import ShardCore
from hmp.transport.shm import Arena, ShmSettings, open_process_arena


class PSShardNode(Node):
    role = Role.PS

    def __init__(self, cfg: Config, node_id: str, resume: bool = False) -> None:
        super().__init__(cfg, node_id)
        sharded = job.sharded_model(cfg)
        index = [s.id for s in cfg.shards].index(node_id)
        initial = sharded.initial_chunks(index)
        self.core = ShardCore(node_id, initial, *chunk_optimizer_of(cfg), cfg.train.consistency, cfg.train.staleness,
                              workers=[w.id for w in cfg.workers])
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
        self._last_checkpoint = 0
        self._checkpointing: asyncio.Task | None = None  # the checkpoint being written, if any
        self.stats = {"pushes": 0, "pulls": 0, "rejected": 0, "checkpoints": 0}
        # A sweep's members are independent: one diverging member's NaN stays in its own slice of
        # every chunk, and refusing the push would stop the others too (its report shows it).
        self.reject_nonfinite = cfg.ps.reject_nonfinite and not cfg.sweep.members
        #: where reply copies go (main() opens the process arena; the server finds it there)
        self.arena: Arena | None = None

    def handlers(self):
        return {**super().handlers(), Kind.PUSH: self.on_push, Kind.PULL: self.on_pull, Kind.INIT: self.on_init,
                Kind.LEAVE: self.on_leave}

    def status(self) -> dict[str, Any]:
        st = super().status()
        st.update(version=self.core.version, updates=self.core.updates_applied, samples=self.core.samples,
                  chunks=len(self.core.chunks), live_workers=sorted(self.core.live_workers), **self.stats)
        return st

    def _params(self, keys: tuple[int, ...]) -> Params:
        """The reply carrying the chunks' current values, as copies.

        The copy is needed: a zero-copy reply would hand libzmq the shard's own chunk tensors, and
        libzmq reads them until the last byte is on the wire (over inproc://, until the receiver
        drops the frames), so the next update would have to wait for every reply still in flight
        or the reply would carry values of that later update. bench/reply.py measures both (2 workers
        x 16 MiB in 1 MiB chunks, loopback, 2 cores): the copy's rounds were as fast or faster (copy /
        zero-copy round time 0.94 and 1.01 in two runs) for ~8% more shard CPU, and it needs no
        trackers, no waits before a mutation and no ordering between updates and replies.

        With a shared-memory arena the copy goes into a reply slot (the same one copy): workers on
        this host read it in place; for the others it is sent as frames, like a clone."""
        values = self.core.values(keys)
        copies = self.arena.reply_copies(values) if self.arena is not None else None
        if copies is None:  # no arena, small values, or no free slot: as before
            copies = tuple(v.clone() for v in values)
        return Params(sender=self.id, keys=keys, values=copies, version=self.core.version)

    async def on_push(self, msg: Push, peer: bytes) -> Message:
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
        if self.core.consistency == Consistency.SYNC:
            if worker not in self.core.live_workers:
                raise RequestError(f"{worker} is not in this sync group ({sorted(self.core.live_workers)})", "bad_request")
            if self._round_done is None or self._round_done.done():
                self._round_done = asyncio.get_running_loop().create_future()
            round_done = self._round_done
            self.core.contribute(worker, msg.keys, msg.grads, msg.samples)
            self._maybe_finish_round()
            try:
                version, values = await asyncio.wait_for(asyncio.shield(round_done), timeout)
            except TimeoutError:
                raise RequestError(f"sync round {self.core.version} incomplete after {timeout} s; waiting for "
                                   f"{sorted(self.core.live_workers - self.core.round_members)}", "timeout") from None
            # The round's values as copied when it finished (one copy shared by every member's reply).
            return Params(sender=self.id, keys=msg.keys, values=tuple(values[k] for k in msg.keys), version=version)
        else:
            if not self.core.ssp_ready(worker):
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait_for(lambda: self.core.ssp_ready(worker)), timeout)
                    except TimeoutError:
                        raise RequestError(f"{worker} stayed more than {self.core.staleness} updates ahead for "
                                           f"{timeout} s", "timeout") from None
            self.core.apply(worker, msg.keys, msg.grads, msg.samples)
            reply = self._params(msg.keys)  # this update's values, before anything else runs
            async with self._changed:
                self._changed.notify_all()
            self._maybe_checkpoint()
            return reply

    def _maybe_finish_round(self) -> None:
        if self.core.consistency == Consistency.SYNC and self.core.round_complete():
            self.core.finish_round()
            if self._round_done is not None and not self._round_done.done():
                # The replies' values, copied now (see _params): a member that has its reply may
                # push into the next round before another member's reply is sent.
                every = self._params(tuple(self.core.chunks))
                self._round_done.set_result((every.version, dict(zip(every.keys, every.values))))
            self._maybe_checkpoint()

    async def on_pull(self, msg: Pull, peer: bytes) -> Message:
        self.core.check_keys(msg.keys)
        self.stats["pulls"] += 1
        return self._params(msg.keys)

    async def on_init(self, msg: Init, peer: bytes) -> Message:
        self.core.check(msg.keys, msg.values, "init")
        if self.reject_nonfinite:
            self.core.check_finite(msg.keys, msg.values, "init")
        self.core.set_values(msg.keys, msg.values)
        return Ack(detail=f"{len(msg.keys)} chunks set")

    async def on_leave(self, msg: Leave, peer: bytes) -> Message:
        """A worker is done: it no longer holds back sync rounds or the SSP bound."""
        self.core.remove_worker(msg.sender)
        self.log.info("worker_left", worker=msg.sender)
        self._maybe_finish_round()
        async with self._changed:
            self._changed.notify_all()
        return Ack()

    def _maybe_checkpoint(self) -> None:
        """Start writing a checkpoint in the background when one is due and none is being written
        (a due one that finds a write in progress waits for the next update after it)."""
        every = self.cfg.ps.checkpoint_every
        if (every and self.core.updates_applied - self._last_checkpoint >= every
                and (self._checkpointing is None or self._checkpointing.done())):
            try:  # a background task of the node: a failed write fails the node
                self._checkpointing = self.spawn(self.checkpoint(), name="checkpoint")
            except RuntimeError:  # main() not running (yet, or any more): the final checkpoint covers it
                pass

    async def checkpoint(self) -> None:
        """Write a checkpoint (temp file, fsync, rename) without blocking the event loop.

        The state is snapshotted on the loop (a copy of the chunks and optimizer state, taken
        between two updates, so consistent) and serialized and fsynced in a thread. A snapshot
        rather than holding updates while writing: torch.save + fsync of a shard take tens to
        hundreds of milliseconds, every push would wait that long, while the copy is one memcpy
        of the shard's state (it costs that much memory for the duration of the write).
        """
        t0 = time.perf_counter()
        snapshot = self.core.snapshot()
        updates = self.core.updates_applied
        await asyncio.to_thread(ShardCore.write, snapshot, self.checkpoint_path)
        self._last_checkpoint = max(self._last_checkpoint, updates)
        self.stats["checkpoints"] += 1
        self.log.info("checkpoint_written", path=str(self.checkpoint_path), version=snapshot["version"],
                      seconds=round(time.perf_counter() - t0, 4))

    async def main(self) -> None:
        if self.cfg.shm.enabled:  # before joining: workers learn of this shard only after
            self.arena = open_process_arena(self.cfg.job.name, self.id, ShmSettings.of(self.cfg.shm))
        if await self.join() is None:
            return
        self.start_heartbeat()
        try:
            await self.stopping.wait()
        finally:
            self.step = self.core.version
            if self._checkpointing is not None:  # one write at a time: the final one goes last
                await asyncio.gather(self._checkpointing, return_exceptions=True)
            await self.checkpoint()
            await self.leave(self.failed or "stopped")
