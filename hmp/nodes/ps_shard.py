"""The PS shard daemon: serves push/pull/init for the chunks placed on it.

Where a message is handled: ``on_push`` validates, then applies (async), waits for the SSP bound
(ssp) or for the round to complete (sync), and returns the chunks' new values, which the server
sends. A reply carries a copy of the values taken when the handler returns (see ``_params``): the
shard may change a chunk again at once, and a reply never carries values of a later update.
Checkpoints are written off the event loop from a snapshot (see ``checkpoint``): every
``[ps] checkpoint_every`` updates, at least every ``checkpoint_every_s`` seconds while there are new
updates, and once more on the way out (stopped, job over, scheduler lost). A failed write is logged
(file and OS error) and the shard goes on with its previous checkpoint; ``--resume`` falls back to
the checkpoint before a damaged one (:meth:`ShardCore.resume`).

Restarts (docs/protocol.md, "Shard restarts"): a shard started again with ``--resume`` while its
job runs joins as before; the scheduler admits it, tells the workers its new address, and they send
their pushes in flight again with the same ``seq``. A push this shard applied already (its ``seq`` is
not above the last one applied from that worker) is answered with the current values and not
applied again; a sync contribution already in the round in progress waits for the round. The
restarted shard's welcome lists the workers still in the job (``workers``): the others are not
waited for. ``step`` (the heartbeats') is the shard's version, so that the scheduler knows how many
updates a crash lost.

Membership: a worker's ``leave`` or the scheduler's ``drop`` takes it out of sync rounds and SSP
bounds (a round waiting only for it completes at once); a worker that was taken out and pushes
again is counted again.

Shared memory (``[shm]``, docs/shm.md): the shard opens its process's arena when it starts. Pushes
from workers on this host arrive as read-only views of the workers' gradient buffers (read here,
never kept past the reply), and the reply's copy of the values is made into a reply slot of the
arena, which the workers on this host read in place; everyone else gets frames as before.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hmp import job
from hmp.config import Config, Consistency, Role
from hmp.errors import ConfigError, RequestError
from hmp.messages import Ack, Drop, Init, Kind, Leave, Message, Params, Pull, Push
from hmp.nodes.base import Node
from hmp.ps.optim import chunk_optimizer_of
from hmp.ps.shard_core import CheckpointError, ShardCore
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
        self.checkpoint_path = job.checkpoint_dir(cfg) / f"{node_id}.pt"
        # The next write rotates the current checkpoint into the previous one's place, except after
        # a resume that had to fall back: the damaged file is then replaced and the good one kept.
        self._keep_previous = True
        if resume:
            self._resume()
        self.step = self.core.version  # the heartbeats' step: a restart's lost updates are counted from it
        self.log.info("chunks_owned", chunks=len(initial), bytes=sum(t.numel() * t.element_size() for t in initial.values()))
        self._changed = asyncio.Condition()  # ssp clocks / sync rounds advance
        self._round_done: asyncio.Future | None = None
        self._last_checkpoint = self.core.updates_applied  # updates in the last checkpoint written
        # The last checkpoint tried, written or not: a failing disk is retried at the configured pace, not
        # on every push.
        self._last_attempt = self.core.updates_applied
        self._last_attempt_at = time.monotonic()
        self._checkpointing: asyncio.Task | None = None  # the checkpoint being written, if any
        self._departed: set[str] = set()  # workers taken out by leave or drop: counted again if they push
        # SSP pushes waiting for the bound, by (worker, seq): each resolved True once applied, False if not
        self._ssp_waiting: dict[tuple[str, int], asyncio.Future] = {}
        self.stats = {"pushes": 0, "pulls": 0, "rejected": 0, "checkpoints": 0, "checkpoint_failures": 0,
                      "drops": 0, "duplicates": 0}
        # A sweep's members are independent: one diverging member's NaN stays in its own slice of
        # every chunk, and refusing the push would stop the others too (its report shows it).
        self.reject_nonfinite = cfg.ps.reject_nonfinite and not cfg.sweep.members
        #: where reply copies go (main() opens the process arena; the server finds it there)
        self.arena: Arena | None = None

    def _resume(self) -> None:
        """``--resume``: continue from the checkpoint, or from the one before it if it is damaged. No
        usable checkpoint, or one of another layout, is a config error naming the files."""
        path = self.checkpoint_path
        try:
            used, passed_over = self.core.resume(path)
        except CheckpointError as exc:
            raise ConfigError(str(path), "--resume", f"a usable checkpoint of shard {self.id}; {exc.why}") from None
        except (ValueError, KeyError, TypeError) as exc:  # a good file of another job, layout or optimizer
            raise ConfigError(str(path), "--resume",
                              f"a checkpoint of this job's model and optimizer ({exc})") from None
        for exc in passed_over:
            self.log.error("checkpoint_unusable", path=str(exc.path), error=exc.why)
        if passed_over:
            self.log.warning("checkpoint_fallback", using=str(used), instead_of=str(path))
            self._keep_previous = False
        self.log.info("resumed", path=str(used), version=self.core.version, updates=self.core.updates_applied,
                      samples=self.core.samples)

    def handlers(self):
        return {**super().handlers(), Kind.PUSH: self.on_push, Kind.PULL: self.on_pull, Kind.INIT: self.on_init,
                Kind.LEAVE: self.on_leave, Kind.DROP: self.on_drop}

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
        seen = self.core.seen(worker, msg.seq)
        if seen == "applied":  # a retry of a push applied before (its reply was lost): not applied twice
            self.stats["duplicates"] += 1
            return self._params(msg.keys)
        if seen == "pending" and self._round_done is not None and not self._round_done.done():
            self.stats["duplicates"] += 1  # sync: already in the round in progress; answered with it
            try:
                version, values = await asyncio.wait_for(asyncio.shield(self._round_done),
                                                         self.cfg.limits.request_timeout_s)
            except TimeoutError:
                raise RequestError(f"sync round {self.core.version} incomplete after "
                                   f"{self.cfg.limits.request_timeout_s} s", "timeout") from None
            return Params(sender=self.id, keys=msg.keys, values=tuple(values[k] for k in msg.keys), version=version)
        waiting = self._ssp_waiting.get((worker, msg.seq)) if msg.seq else None
        if waiting is not None:  # a retry of a push still waiting for the SSP bound: answered once it is applied
            self.stats["duplicates"] += 1
            try:
                applied = await asyncio.wait_for(asyncio.shield(waiting), self.cfg.limits.request_timeout_s)
            except TimeoutError:
                raise RequestError(f"{worker}'s push {msg.seq} still waits for the SSP bound", "timeout") from None
            if applied:
                return self._params(msg.keys)
        if worker in self._departed:  # left or dropped, and pushing again: it came back
            self._departed.discard(worker)
            self.core.add_worker(worker)
            self.log.info("worker_back", worker=worker)
        timeout = self.cfg.limits.request_timeout_s
        if self.core.consistency == Consistency.SYNC:
            if worker not in self.core.live_workers:
                raise RequestError(f"{worker} is not in this sync group ({sorted(self.core.live_workers)})", "bad_request")
            if self.stopping.is_set():  # the round would wait for members that are stopping too
                raise RequestError(f"shard {self.id} is stopping; sync round {self.core.version} will not "
                                   "complete", "shutting_down")
            if self._round_done is None or self._round_done.done():
                self._round_done = asyncio.get_running_loop().create_future()
            round_done = self._round_done
            self.core.contribute(worker, msg.keys, msg.grads, msg.samples, msg.seq)
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
                # A retry of this push (the worker abandoned it when a shard went down) must not be
                # applied too: it waits for this one (see above).
                done = asyncio.get_running_loop().create_future()
                if msg.seq:
                    self._ssp_waiting[(worker, msg.seq)] = done
                try:
                    async with self._changed:
                        try:
                            await asyncio.wait_for(self._changed.wait_for(
                                lambda: self.core.ssp_ready(worker) or self.stopping.is_set()), timeout)
                        except TimeoutError:
                            raise RequestError(f"{worker} stayed more than {self.core.staleness} updates ahead "
                                               f"for {timeout} s", "timeout") from None
                    if not self.core.ssp_ready(worker):
                        raise RequestError(f"shard {self.id} is stopping; {worker}'s push waited for the SSP "
                                           "bound and was not applied", "shutting_down")
                    self.core.apply(worker, msg.keys, msg.grads, msg.samples, msg.seq)
                    done.set_result(True)
                finally:
                    if not done.done():
                        done.set_result(False)
                    if self._ssp_waiting.get((worker, msg.seq)) is done:
                        del self._ssp_waiting[(worker, msg.seq)]
            else:
                self.core.apply(worker, msg.keys, msg.grads, msg.samples, msg.seq)
            self.step = self.core.version
            reply = self._params(msg.keys)  # this update's values, before anything else runs
            async with self._changed:
                self._changed.notify_all()
            self._maybe_checkpoint()
            return reply

    def _maybe_finish_round(self) -> None:
        if self.core.consistency == Consistency.SYNC and self.core.round_complete():
            self.step = self.core.finish_round()
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
        await self._remove_worker(msg.sender)
        self.log.info("worker_left", worker=msg.sender)
        return Ack()

    async def on_drop(self, msg: Drop, peer: bytes) -> Message:
        """The scheduler says worker ``msg.node`` is gone (lost, failed or left): stop waiting for it. Only
        the scheduler may say so; a worker pushing again after its drop is counted again."""
        scheduler = self.cfg.scheduler.id
        if msg.sender != scheduler:
            raise RequestError(f"drop of {msg.node!r} from {msg.sender!r}: only the scheduler ({scheduler!r}) "
                               "may drop a worker", "unauthorized")
        known = msg.node in self.core.live_workers
        await self._remove_worker(msg.node)
        self.stats["drops"] += 1
        self.log.info("worker_dropped", worker=msg.node, reason=msg.reason, was_live=known)
        return Ack(detail=f"{msg.node} dropped" if known else f"{msg.node} was not counted")

    async def _remove_worker(self, worker: str) -> None:
        """Take ``worker`` out of sync rounds and SSP bounds; wake what waited for it."""
        if worker in self.core.live_workers:
            self._departed.add(worker)  # only workers once counted: the set stays as small as the job
        self.core.remove_worker(worker)
        self._maybe_finish_round()
        async with self._changed:
            self._changed.notify_all()

    async def _release_waiters(self) -> None:
        """On the way out, pushes waiting for a sync round or the SSP bound get a ``shutting_down`` error now
        rather than at ``request_timeout_s`` (the round will not complete: its members are told so)."""
        if self._round_done is not None and not self._round_done.done():
            self._round_done.set_exception(RequestError(
                f"shard {self.id} is stopping; sync round {self.core.version} will not complete", "shutting_down"))
        async with self._changed:
            self._changed.notify_all()

    def _maybe_checkpoint(self) -> None:
        """Start writing a checkpoint in the background when one is due (``checkpoint_every`` updates since
        the last try, or ``checkpoint_every_s`` seconds with new updates) and none is being written (a due
        one that finds a write in progress waits for the next update or timer tick after it)."""
        if self._checkpointing is not None and not self._checkpointing.done():
            return
        updates = self.core.updates_applied
        every, every_s = self.cfg.ps.checkpoint_every, self.cfg.ps.checkpoint_every_s
        by_updates = every and updates - self._last_attempt >= every
        by_time = (every_s and updates > self._last_checkpoint
                   and time.monotonic() - self._last_attempt_at >= every_s)
        if by_updates or by_time:
            try:  # a background task of the node (checkpoint() itself never raises for a failed write)
                self._checkpointing = self.spawn(self.checkpoint(), name="checkpoint")
            except RuntimeError:  # main() not running (yet, or any more): the final checkpoint covers it
                pass

    async def _checkpoint_timer(self) -> None:
        """``checkpoint_every_s``: a shard that had updates and then none (a stalled or finished job) is
        checkpointed too, not only on its next push."""
        every_s = self.cfg.ps.checkpoint_every_s
        next_at = self._last_attempt_at + every_s
        while True:
            try:  # 1 ms late on purpose: the loop may fire a timer up to its clock resolution early
                await asyncio.wait_for(self.stopping.wait(), max(0.0, next_at - time.monotonic()) + 0.001)
                return
            except TimeoutError:
                pass
            self._maybe_checkpoint()
            # One interval after the last try (a push may have started one meanwhile), or from now when
            # this one just started or there was nothing new to write.
            now = time.monotonic()
            next_at = self._last_attempt_at + every_s
            if next_at <= now:
                next_at = now + every_s

    async def checkpoint(self) -> bool:
        """Write a checkpoint (temp file, fsync, rename) without blocking the event loop.

        The state is snapshotted on the loop (a copy of the chunks and optimizer state, taken
        between two updates, so consistent) and serialized and fsynced in a thread. A snapshot
        rather than holding updates while writing: torch.save + fsync of a shard take tens to
        hundreds of milliseconds, every push would wait that long, while the copy is one memcpy
        of the shard's state (it costs that much memory for the duration of the write).

        A failed write (disk full, unwritable folder) is logged with the file and the OS error and
        returns False: the previous checkpoint stays, and the shard keeps serving.
        """
        t0 = time.perf_counter()
        snapshot = self.core.snapshot()
        updates = self.core.updates_applied
        self._last_attempt, self._last_attempt_at = updates, time.monotonic()
        keep_previous = self._keep_previous
        try:
            await asyncio.to_thread(ShardCore.write, snapshot, self.checkpoint_path, keep_previous)
        except OSError as exc:
            self.stats["checkpoint_failures"] += 1
            self.log.error("checkpoint_failed", path=str(self.checkpoint_path), version=snapshot["version"],
                           error=f"{exc.strerror or exc} (errno {exc.errno})" if exc.errno else str(exc),
                           kept=str(self.checkpoint_path) if self.checkpoint_path.exists() else "none yet")
            return False
        self._keep_previous = True
        self._last_checkpoint = max(self._last_checkpoint, updates)
        self.stats["checkpoints"] += 1
        self.log.info("checkpoint_written", path=str(self.checkpoint_path), version=snapshot["version"],
                      updates=updates, seconds=round(time.perf_counter() - t0, 4))
        return True

    async def main(self) -> None:
        if self.cfg.shm.enabled:  # before joining: workers learn of this shard only after
            self.arena = open_process_arena(self.cfg.job.name, self.id, ShmSettings.of(self.cfg.shm))
        if self.cfg.ps.checkpoint_every_s:
            # From the start, not from the welcome: a restarted shard may take its workers' retried
            # pushes while it is still joining.
            self.spawn(self._checkpoint_timer(), name="checkpoint_timer")
        try:
            welcome = await self.join()
            if welcome is None:
                return
            self.start_heartbeat()
            if "workers" in welcome.info:  # a rejoin: the workers gone meanwhile hold no round or bound back
                for worker in sorted(self.core.live_workers - set(welcome.info["workers"])):
                    await self._remove_worker(worker)
            await self.stopping.wait()
        finally:
            # Every way out comes here: stopped (signal, shutdown, job over), the scheduler lost (fail()
            # cancels main), a background task failed, or refused at join.
            self.step = self.core.version
            await self._release_waiters()
            if self._checkpointing is not None:  # one write at a time: the final one goes last
                await asyncio.gather(self._checkpointing, return_exceptions=True)
            if self.welcome is not None or self.core.updates_applied > self._last_checkpoint:
                await self.checkpoint()
            if self.welcome is not None:
                await self.leave(self.failed or "stopped")
