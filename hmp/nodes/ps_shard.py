"""The PS shard daemon: the shell around its chunk groups' cores (:mod:`hmp.ps.shard_core`).

The core decides each push (validation, retried pushes, sync rounds, SSP bounds, membership); this
shell moves the frames, holds the waiting pushes' futures, copies the replies' values and forwards what
was applied to the group's backup. A reply carries a copy of the values taken when its update was
applied (see ``_params``): the shard may change a chunk again at once, and a reply never carries values
of a later update. Checkpoints are written off the event loop from a snapshot (see ``checkpoint``): every
``[ps] checkpoint_every`` updates, at least every ``checkpoint_every_s`` seconds while there are new
updates, and once more on the way out (stopped, job over, scheduler lost). A failed write is logged
(file and OS error) and the shard goes on with its previous checkpoint; ``--resume`` falls back to
the checkpoint before a damaged one (:meth:`ShardCore.resume`).

Restarts (docs/protocol.md, "Shard restarts"): a shard started again with ``--resume`` while its job
runs joins as before, and the workers send their pushes in flight again with the same ``seq`` (the core
answers those applied already). The restarted shard's welcome lists the workers still in the job
(``workers``): the others are not waited for. ``step`` (the heartbeats') is the shard's version, so that
the scheduler knows how many updates a crash lost. A worker's ``leave`` or the scheduler's ``drop``
takes the worker out of every group this shard holds; one that pushes again is counted again in all.
``status`` counts ``rows_pushed`` and ``rows_pulled`` (row-sparse tables, docs/protocol.md).

Shared memory (``[shm]``, docs/shm.md): the shard opens its process's arena when it starts. Pushes
from workers on this host arrive as read-only views of the workers' gradient buffers (read here,
never kept past the reply), and the reply's copy of the values is made into a reply slot of the
arena, which the workers on this host read in place; everyone else gets frames as before.

Replicas (``[ps] replicas = 2``, docs/resilience.md): the shard serves as primary the chunk groups in
:attr:`PSShardNode.cores` (its own, plus any it took over) and keeps a copy of the groups in
:attr:`PSShardNode.backups`. What a primary applies (a push, a sync round, an ``init``) it forwards to
the group's backup (``replicate``, numbered per group, over one connection per backup so the order
holds) and answers the push only once the backup acknowledged it. A forward whose backup is lost waits
for the scheduler's ``replicas`` message: a new backup gets a whole copy taken after the update (it is
in it), and with no backup left the update is acknowledged unreplicated. ``replicas`` also promotes:
a shard named primary of a group it backs up serves it from then on (workers are told to send its
pushes here; a retried push already applied is answered, not applied again).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from hmp import job
from hmp.config import Config, Role
from hmp.errors import ConfigError, RemoteError, RequestError
from hmp.messages import Ack, Drop, Init, Kind, Leave, Message, Params, Pull, Push, Replicas, Replicate
from hmp.nodes.base import Node
from hmp.ps.checkpoint import CheckpointError, write as write_checkpoint
from hmp.ps.optim import chunk_optimizer_of
from hmp.ps.shard_core import AwaitRound, AwaitStaleness, Refuse, Released, ReplyNow, ShardCore
from hmp.ps.sharding import initial_replicas
from hmp.transport.endpoint import Client
from hmp.transport.shm import Arena, ShmSettings, open_process_arena


#: seconds before a forward the backup refused (it may not know the new map yet) is sent again
FORWARD_RETRY_S = 0.05


class PSShardNode(Node):
    role = Role.PS

    def __init__(self, cfg: Config, node_id: str, resume: bool = False) -> None:
        super().__init__(cfg, node_id)
        sharded = self.sharded = job.sharded_model(cfg)
        self.shard_ids = [s.id for s in cfg.shards]
        initial = sharded.initial_chunks(self.shard_ids.index(node_id))
        self.core = self._new_core(node_id)
        #: the chunk groups this shard serves as primary (its own; more once it took over a lost one's)
        self.cores: dict[str, ShardCore] = {node_id: self.core}
        #: [ps] replicas = 2: the groups it keeps a copy of, fed by their primaries' forwards
        self.backups: dict[str, ShardCore] = {}
        #: group -> (primary, backup) as the scheduler last said (at first: shard_ids order, initial_replicas)
        self.replica_of: dict[str, tuple[str, str]] = (initial_replicas(self.shard_ids)
                                                       if cfg.ps.replicas > 1 else {})
        self.replica_epoch = 0
        for group, (_, backup) in self.replica_of.items():
            if backup == node_id:  # every node builds the same initial values: the copy starts identical
                self.backups[group] = self._new_core(group)
        self._forwarded: dict[str, int] = {}  # primary side: forwards sent per group (Replicate.fseq)
        self._backup_clients: dict[str, Client] = {}  # by backup shard id: one ordered connection each
        self._replicas_changed: asyncio.Future | None = None  # resolved at the next replicas message
        self._round_forward: dict[str, asyncio.Task] = {}  # sync: a finished round's forward, per group
        self._resumed = resume
        self.shard_addresses: dict[str, str] = {}  # by shard id, as the scheduler says (where backups are)
        self.checkpoint_path = job.checkpoint_dir(cfg) / f"{node_id}.pt"
        # The next write rotates the current checkpoint into the previous one's place, except after
        # a resume that had to fall back: the damaged file is then replaced and the good one kept.
        self._keep_previous = True
        if resume:
            self._resume()
        self.step = self.core.version  # the heartbeats' step: a restart's lost updates are counted from it
        self.log.info("chunks_owned", chunks=len(initial), bytes=sum(t.numel() * t.element_size() for t in initial.values()))
        #: the pushes waiting (sync: by group and round, resolved with the round's values; ssp: by group and
        #: ticket, resolved with the push's reply and forward once applied, None if it will not be)
        self._rounds: dict[tuple[str, int], asyncio.Future] = {}
        self._ssp: dict[tuple[str, int], asyncio.Future] = {}
        self._last_checkpoint = self.core.updates_applied  # updates in the last checkpoint written
        # The last checkpoint tried, written or not: a failing disk is retried at the configured pace, not
        # on every push.
        self._last_attempt = self.core.updates_applied
        self._last_attempt_at = time.monotonic()
        self._checkpointing: asyncio.Task | None = None  # the checkpoint being written, if any
        self.stats = {"pushes": 0, "pulls": 0, "rejected": 0, "checkpoints": 0, "checkpoint_failures": 0,
                      "drops": 0, "duplicates": 0, "forwards": 0, "forwards_applied": 0, "promotions": 0,
                      "copies_sent": 0, "unreplicated_acks": 0, "rows_pushed": 0, "rows_pulled": 0}
        #: where reply copies go (main() opens the process arena; the server finds it there)
        self.arena: Arena | None = None

    def _new_core(self, group: str) -> ShardCore:
        """A core for chunk group ``group`` (the chunks first assigned to shard ``group``) at the model's
        initial values, counting the job's workers."""
        initial = self.sharded.initial_chunks(self.shard_ids.index(group))
        return ShardCore(group, initial, *chunk_optimizer_of(self.cfg), self.cfg.train.consistency,
                         self.cfg.train.staleness, workers=[w.id for w in self.cfg.workers],
                         row_dims={c.key: c.dim for c in self.sharded.layout.chunks if c.dim and c.key in initial},
                         buffer_keys=self.sharded.buffer_keys & initial.keys(),
                         # A sweep's members are independent: one diverging member's NaN stays in its own slice
                         # of every chunk, and refusing the push would stop the others too (its report shows it).
                         reject_nonfinite=self.cfg.ps.reject_nonfinite and not self.cfg.sweep.members, node=self.id)

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
                Kind.LEAVE: self.on_leave, Kind.DROP: self.on_drop, Kind.REPLICAS: self.on_replicas,
                Kind.REPLICATE: self.on_replicate}

    def status(self) -> dict[str, Any]:
        st = super().status()
        st.update(version=self.core.version, updates=self.core.updates_applied, samples=self.core.samples,
                  chunks=len(self.core.chunks), live_workers=sorted(self.core.live_workers), **self.stats)
        if self.replica_of:
            st.update(primary_of=sorted(self.cores), backup_of=sorted(self.backups), replica_epoch=self.replica_epoch,
                      versions={g: c.version for g, c in {**self.backups, **self.cores}.items()})
        return st

    def _params(self, keys: tuple[int, ...], core: ShardCore | None = None, row_keys: tuple[int, ...] = (),
                rows: tuple[torch.Tensor, ...] = ()) -> Params:
        """The reply carrying the chunks' current values, as copies.

        The copy is needed: a zero-copy reply would hand libzmq the shard's own chunk tensors, and
        libzmq reads them until the last byte is on the wire (over inproc://, until the receiver
        drops the frames), so the next update would have to wait for every reply still in flight
        or the reply would carry values of that later update. The copy was as fast in bench/reply.py
        (docs/architecture.md) and needs no trackers, no waits before a mutation and no ordering
        between updates and replies.

        With a shared-memory arena the copy goes into a reply slot (the same one copy): workers on
        this host read it in place; for the others it is sent as frames, like a clone.
        ``core``: the chunk group's (default: this shard's own). ``row_keys``, ``rows``: rows of row-sparse
        chunks the reply carries too (gathered: that is their copy)."""
        core = core or self.core
        values = core.values(keys)
        copies = self.arena.reply_copies(values) if self.arena is not None else None
        if copies is None:  # no arena, small values, or no free slot: as before
            copies = tuple(v.clone() for v in values)
        if not row_keys:
            return Params(sender=self.id, keys=keys, values=copies, version=core.version)
        self.stats["rows_pulled"] += sum(r.numel() for r in rows)
        return Params(sender=self.id, keys=keys, values=copies, version=core.version, row_keys=row_keys,
                      row_values=core.row_values(row_keys, rows))

    def _primary_core(self, keys: tuple[int, ...], what: str) -> ShardCore:
        """The core of the chunk group this shard serves ``keys`` from (by the first key; ``check`` refuses
        keys of another group). A key this shard only backs up is refused, naming its primary."""
        if keys:
            for core in self.cores.values():
                if keys[0] in core.chunks:
                    return core
            for group, core in self.backups.items():
                if keys[0] in core.chunks:
                    primary = self.replica_of.get(group, ("?", ""))[0]
                    raise RequestError(f"{what}: shard {self.id} holds chunk {keys[0]} as the backup of group "
                                       f"{group}; its primary is {primary}", "unknown_key")
        return self.core

    async def on_push(self, msg: Push, peer: bytes) -> Message:
        """Move a push to its group's core and its decision back (:meth:`ShardCore.push`)."""
        try:
            core = self._primary_core(msg.keys or msg.row_keys or msg.want_keys, "push")
            forwarding = self._round_forward.get(core.shard_id)
            if forwarding is not None and not forwarding.done() and not core.seen(msg.sender, msg.seq):
                # The last round's gradients are its aggregation buffers, sent to the backup as they are:
                # the next round may write them only once the backup has them (a retry writes none).
                await asyncio.wait({forwarding}, timeout=self.cfg.limits.request_timeout_s)
            back = msg.sender in core.departed
            decision = core.push(msg, self.stopping.is_set())
        except RequestError:
            self.stats["rejected"] += 1
            raise
        self.stats["pushes"] += 1
        self.stats["rows_pushed"] += sum(r.numel() for r in msg.rows)
        if back and msg.sender not in core.departed:  # left or dropped, and pushing again: it came back
            for c in self._all_cores():
                c.add_worker(msg.sender)
            self.log.info("worker_back", worker=msg.sender)
        return await self._answer(core, msg, decision)

    async def _answer(self, core: ShardCore, msg: Push, decision: ReplyNow | AwaitRound | AwaitStaleness | Refuse
                      ) -> Params:
        """The reply to ``msg`` as ``decision`` says: now, or when the round or the SSP bound lets it."""
        group, worker, timeout = core.shard_id, msg.sender, self.cfg.limits.request_timeout_s
        self.stats["duplicates"] += getattr(decision, "duplicate", False)
        if isinstance(decision, Refuse):
            raise RequestError(decision.text, decision.code)
        if isinstance(decision, ReplyNow):
            reply = self._params(msg.keys, core, msg.want_keys, msg.want_rows)  # this update's values, now
            forward = None if decision.forward is None else self._forward(group, decision.forward)
            self._release(core)
            if forward is not None:  # acknowledged once the backup has it too
                await forward
            return reply
        if isinstance(decision, AwaitRound):
            round_done = self._rounds.get((group, decision.round))
            if round_done is None:
                round_done = self._rounds[(group, decision.round)] = asyncio.get_running_loop().create_future()
            self._release(core)
            try:
                result = await asyncio.wait_for(asyncio.shield(round_done), timeout)
            except TimeoutError:
                raise RequestError(f"sync round {core.version} incomplete after {timeout} s" + (
                    "" if decision.duplicate else f"; waiting for {sorted(core.live_workers - core.round_members)}"),
                    "timeout") from None
            return self._round_reply(msg, *result, core)
        key = (group, decision.ticket)
        if decision.duplicate:  # a retry of a push still waiting for the SSP bound: answered once it is applied
            try:
                applied = await asyncio.wait_for(asyncio.shield(self._ssp[key]), timeout)
            except TimeoutError:
                raise RequestError(f"{worker}'s push {msg.seq} still waits for the SSP bound", "timeout") from None
            if applied is not None:
                return self._params(msg.keys, core, msg.want_keys, msg.want_rows)
            return await self._answer(core, msg, core.push(msg, self.stopping.is_set()))  # it was not: anew
        waiter = self._ssp[key] = asyncio.get_running_loop().create_future()
        try:
            try:
                applied = await asyncio.wait_for(asyncio.shield(waiter), timeout)
            except TimeoutError:
                raise RequestError(f"{worker} stayed more than {core.staleness} updates ahead for {timeout} s",
                                   "timeout") from None
        finally:
            if not waiter.done():  # not applied: a retry waiting with it is decided anew
                waiter.set_result(None)
            core.withdraw(decision.ticket)
            self._ssp.pop(key, None)
        if applied is None:
            raise RequestError(f"shard {self.id} is stopping; {worker}'s push waited for the SSP bound and was "
                               "not applied", "shutting_down")
        reply, forward = applied
        if forward is not None:
            await forward
        return reply

    def _round_reply(self, msg: Push, version: int, values: dict[int, torch.Tensor], wanted: dict[str, Any],
                     core: ShardCore) -> Params:
        """A sync member's reply: its chunks as copied when the round finished, and the rows it wanted as
        gathered then (``wanted``, by worker; a retried push's rows are gathered now if the round took
        none for it)."""
        rows = wanted.get(msg.sender)
        if msg.want_keys and (rows is None or rows[0] != msg.want_keys):
            rows = (msg.want_keys, core.row_values(msg.want_keys, msg.want_rows))
        row_keys, row_values = rows or ((), ())
        return Params(sender=self.id, keys=msg.keys, values=tuple(values[k] for k in msg.keys), version=version,
                      row_keys=row_keys, row_values=row_values)

    def _all_cores(self) -> list[ShardCore]:
        """Every chunk group this shard holds, served or backed up: membership changes apply to all, so
        that a backup promoted later counts the same workers as its primary did."""
        return [*self.cores.values(), *self.backups.values()]

    def _release(self, core: ShardCore) -> None:
        """Answer the waiters the last change to ``core`` released (:meth:`ShardCore.next_release`), each
        reply's values copied and its forward started before the next update: in the order applied."""
        group = core.shard_id
        while (done := core.next_release()) is not None:
            if isinstance(done, Released):
                reply = self._params(done.push.keys, core, done.push.want_keys, done.push.want_rows)
                waiter = self._ssp.get((group, done.ticket))
                forward = self._forward(group, done.forward)
                if waiter is not None and not waiter.done():
                    waiter.set_result((reply, forward))
                continue
            round_done = self._rounds.pop((group, done.round), None)
            if round_done is None or round_done.done():
                continue
            # The replies' values, copied now (see _params): a member that has its reply may push into the
            # next round before another member's reply is sent.
            every = self._params(done.reply_keys, core)
            result = (every.version, dict(zip(every.keys, every.values)), done.wanted)
            forward = self._forward(group, done.forward)
            if forward is None:
                round_done.set_result(result)
            else:  # the members are answered once the backup applied the round too
                self._round_forward[group] = asyncio.ensure_future(self._answer_round(forward, round_done, result))
        self.step = self.core.version
        self._maybe_checkpoint()

    @staticmethod
    async def _answer_round(forward: asyncio.Future, round_done: asyncio.Future, result: Any) -> None:
        try:
            await forward
        except BaseException as exc:  # the members get the forward's error (a stop)
            if not round_done.done():
                round_done.set_exception(exc if isinstance(exc, Exception) else
                                         RequestError("the round's replication was cancelled", "shutting_down"))
            return
        if not round_done.done():
            round_done.set_result(result)

    async def on_pull(self, msg: Pull, peer: bytes) -> Message:
        core = self._primary_core(msg.keys or msg.row_keys, "pull")
        core.check_keys(msg.keys)
        core.check_rows(msg.row_keys, msg.rows, None, "pull", msg.keys)
        self.stats["pulls"] += 1
        return self._params(msg.keys, core, msg.row_keys, msg.rows)

    async def on_init(self, msg: Init, peer: bytes) -> Message:
        core = self._primary_core(msg.keys, "init")
        core.check(msg.keys, msg.values, "init")
        if core.reject_nonfinite:
            core.check_finite(msg.keys, msg.values, "init")
        core.set_values(msg.keys, msg.values)
        forward = self._forward(core.shard_id, Replicate(group=core.shard_id, fseq=0, op="init", keys=msg.keys,
                                                         grads=msg.values))
        if forward is not None:
            await forward
        return Ack(detail=f"{len(msg.keys)} chunks set")

    async def on_leave(self, msg: Leave, peer: bytes) -> Message:
        """A worker is done: it no longer holds back sync rounds or the SSP bound."""
        self._remove_worker(msg.sender)
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
        self._remove_worker(msg.node)
        self.stats["drops"] += 1
        self.log.info("worker_dropped", worker=msg.node, reason=msg.reason, was_live=known)
        return Ack(detail=f"{msg.node} dropped" if known else f"{msg.node} was not counted")

    def _remove_worker(self, worker: str) -> None:
        """Take ``worker`` out of sync rounds and SSP bounds; answer what waited for it."""
        for c in self._all_cores():
            c.remove_worker(worker)
        for c in list(self.cores.values()):
            self._release(c)

    def _release_waiters(self) -> None:
        """On the way out, pushes waiting for a sync round or the SSP bound get a ``shutting_down`` error now
        rather than at ``request_timeout_s`` (the round will not complete: its members are told so)."""
        for (group, _), round_done in self._rounds.items():
            if not round_done.done():
                version = self.cores[group].version if group in self.cores else "?"
                round_done.set_exception(RequestError(
                    f"shard {self.id} is stopping; sync round {version} of {group} will not complete",
                    "shutting_down"))
        for (group, ticket), waiter in self._ssp.items():
            if not waiter.done():  # not applied: a retry waiting with it is decided anew (and refused)
                waiter.set_result(None)
                if group in self.cores:
                    self.cores[group].withdraw(ticket)
        self._wake_forwards()

    # ---------------------------------------------------------------- replicas ([ps] replicas = 2)
    def _forward(self, group: str, msg: Replicate) -> asyncio.Future | None:
        """Send what was just applied to ``group`` to its backup, now (in the order applied: the request is
        queued on the backup's one connection before this returns); the future is done once the backup
        applied it, or the group has no backup any more. None: the group has no backup."""
        backup = self.replica_of.get(group, ("", ""))[1]
        if not backup or backup == self.id or group not in self.cores:
            return None
        fseq = self._forwarded[group] = self._forwarded.get(group, 0) + 1
        msg = msg.replace(fseq=fseq)
        self.stats["forwards"] += 1
        # Zero copy: the tensors are the received push's frames (or the round's buffers), kept alive until
        # the backup's ack, which also says it read them (the request/reply pair orders both).
        first = asyncio.ensure_future(self._send_forward(backup, msg))
        return asyncio.ensure_future(self._replicated(group, backup, msg, first))

    async def _send_forward(self, backup: str, msg: Replicate) -> Message:
        """Send ``msg`` to shard ``backup`` on its one connection. Forwards are tasks started in the order
        the updates were applied, and nothing here suspends before the message is queued (``connect`` does
        not), so they leave in that order; the backup checks ``fseq`` all the same. The backup's address
        comes with the scheduler's ``replicas`` message, which the first pushes may precede: they wait for it."""
        timeout = self.cfg.limits.request_timeout_s
        while not self.shard_addresses.get(backup):
            try:
                await asyncio.wait_for(asyncio.shield(self._next_replicas_change()), timeout)
            except TimeoutError:
                raise RequestError(f"shard {self.id} was not told where its backup {backup} is within {timeout} s",
                                   "timeout") from None
        address = self.shard_addresses[backup]
        c = self._backup_clients.get(backup)
        if c is None or c.address != address:
            # Plain frames, no shared memory: the frames forwarded are views of other peers' memory.
            old, c = c, Client(address, name=self.id, limits=self.limits, frame_bytes=self.cfg.limits.frame_bytes,
                               timeout_s=timeout, job_token=self.cfg.job.token, shm=False)
            await c.connect()
            self._backup_clients[backup] = c
            if old is not None:
                await old.close()
        return await c.request(msg)

    async def _replicated(self, group: str, backup: str, msg: Replicate, first: asyncio.Future) -> None:
        """Wait for the backup's ack of ``msg``. A backup that refuses it (it has not heard the scheduler's
        new map yet, or an earlier forward is not in yet) is asked again shortly; one that does not answer
        (lost) is left to the scheduler's next ``replicas``: a new backup receives a copy taken after this
        update (so it holds it), no backup leaves it unreplicated (acknowledged). Bounded by
        ``request_timeout_s``; a stop ends the wait with ``shutting_down``."""
        timeout = self.cfg.limits.request_timeout_s
        deadline = time.monotonic() + timeout
        request, error = first, None
        while True:
            changed = self._next_replicas_change()
            stop = asyncio.ensure_future(self.stopping.wait())
            try:
                await asyncio.wait({request, changed, stop}, timeout=max(0.0, deadline - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if request.done() and not changed.done() and not self.stopping.is_set():
                    error = request.exception() if not request.cancelled() else None
                    if error is None and not request.cancelled():
                        self.stats["forwards_applied"] += 1
                        return
                    if isinstance(error, RemoteError) and time.monotonic() < deadline:
                        # Refused: asked again shortly, unless the map changes meanwhile.
                        await asyncio.wait({changed, stop}, timeout=FORWARD_RETRY_S, return_when=asyncio.FIRST_COMPLETED)
                        if not changed.done() and not self.stopping.is_set():
                            request = asyncio.ensure_future(self._send_forward(backup, msg))
                            continue
                    elif not isinstance(error, RemoteError):  # no answer: the scheduler says what now
                        self.log.warning("forward_failed", group=group, backup=backup, fseq=msg.fseq, error=str(error))
                        await asyncio.wait({changed, stop}, timeout=max(0.0, deadline - time.monotonic()),
                                           return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if request.done() and not request.cancelled() and request.exception() is None:
                self.stats["forwards_applied"] += 1
                return
            if self.stopping.is_set():
                request.cancel()
                raise RequestError(f"shard {self.id} is stopping; the update of {group} was not replicated to "
                                   f"{backup}", "shutting_down")
            if not changed.done():
                request.cancel()
                raise RequestError(f"replication of {group} to {backup} failed and the scheduler named no other "
                                   f"backup within {timeout} s: {error or 'no answer'}", "timeout")
            now_backup = self.replica_of.get(group, ("", ""))[1] if group in self.cores else ""
            if now_backup != backup:
                request.cancel()
                if not now_backup:
                    self.stats["unreplicated_acks"] += 1
                # A new backup was sent a copy taken after this update (apply_replicas), or there is none.
                return
            if request.done():  # the same backup, still named: once more (it checks fseq)
                request = asyncio.ensure_future(self._send_forward(backup, msg))

    def _next_replicas_change(self) -> asyncio.Future:
        if self._replicas_changed is None or self._replicas_changed.done():
            self._replicas_changed = asyncio.get_running_loop().create_future()
        return self._replicas_changed

    def _wake_forwards(self) -> None:
        if self._replicas_changed is not None and not self._replicas_changed.done():
            self._replicas_changed.set_result(None)

    async def on_replicas(self, msg: Replicas, peer: bytes) -> Message:
        """The scheduler: who is primary and backup of each chunk group now. Promotes the groups this
        shard backed up and now serves, drops copies it no longer keeps, and sends each group it serves
        whose backup changed a whole copy (before any later forward, on the same connection)."""
        scheduler = self.cfg.scheduler.id
        if msg.sender != scheduler:
            raise RequestError(f"replicas from {msg.sender!r}: only the scheduler ({scheduler!r}) may send it",
                               "unauthorized")
        try:
            groups = {str(g): (str(p), str(b)) for g, p, b in msg.groups}
        except ValueError:
            raise RequestError("replicas: groups must be [group, primary, backup] triples", "bad_request") from None
        unknown = sorted(set(groups) - set(self.shard_ids))
        if unknown:
            raise RequestError(f"replicas: unknown chunk groups {unknown}; this job's are {self.shard_ids}",
                               "bad_request")
        if msg.epoch <= self.replica_epoch:
            return Ack(detail=f"change {msg.epoch} is older than {self.replica_epoch}")
        missing = [g for g, (p, _) in groups.items() if p == self.id and g not in self.cores and g not in self.backups]
        if missing:  # nothing changes: the scheduler must not route these groups here
            raise RequestError(f"shard {self.id} holds no copy of groups {missing}; cannot serve them", "bad_request")
        self.apply_replicas(groups, msg.epoch, {str(sid): str(addr) for sid, addr in msg.shards})
        return Ack(detail=f"change {msg.epoch}: primary of {sorted(self.cores)}, backup of {sorted(self.backups)}")

    def apply_replicas(self, groups: dict[str, tuple[str, str]], epoch: int,
                       addresses: dict[str, str] | None = None) -> None:
        """Act on a replica map (``on_replicas``, a rejoin's welcome)."""
        old, had_epoch = self.replica_of, self.replica_epoch > 0
        if addresses:
            self.shard_addresses.update(addresses)
        self.replica_of, self.replica_epoch = dict(groups), epoch
        for group, (primary, backup) in groups.items():
            if primary == self.id and group not in self.cores and group in self.backups:
                self.cores[group] = self.backups.pop(group)
                self.stats["promotions"] += 1
                self.log.warning("promoted", group=group, version=self.cores[group].version, epoch=epoch)
            elif primary != self.id and group in self.cores:  # failed over while this shard was away
                del self.cores[group]
            if backup != self.id and primary != self.id and group in self.backups:
                del self.backups[group]
            elif backup == self.id and group not in self.backups:
                # Its primary sends a whole copy: until then a placeholder at the initial values.
                self.backups[group] = self._new_core(group)
                self.backups[group].applied_forward = -1  # nothing but the copy is applied first
        for group in list(self.cores):
            backup = groups.get(group, ("", ""))[1]
            if not backup:
                if old.get(group, ("", ""))[1]:
                    self.log.warning("unreplicated", group=group, epoch=epoch, why="no live shard to keep a backup")
                continue
            # A new backup, a group just taken over, or (the first map after --resume) a backup still at
            # the initial values while this shard resumed from its checkpoint: a whole copy.
            first_after_resume = self._resumed and not had_epoch
            if first_after_resume or backup != old.get(group, ("", ""))[1] or old.get(group, ("", ""))[0] != self.id:
                self._send_copy(group, backup)
        self._wake_forwards()

    def _send_copy(self, group: str, backup: str) -> None:
        """Send ``backup`` a whole copy of ``group`` as it is now, queued before any later forward."""
        fseq = self._forwarded[group] = self._forwarded.get(group, 0) + 1
        msg = Replicate(group=group, fseq=fseq, op="state", grads=(self.cores[group].replica_bytes(),))
        self.stats["copies_sent"] += 1
        self.log.info("copy_sent", group=group, backup=backup, version=self.cores[group].version)
        first = asyncio.ensure_future(self._send_forward(backup, msg))
        task = asyncio.ensure_future(self._replicated(group, backup, msg, first))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self.log.warning(
            "copy_failed", group=group, backup=backup, error=str(t.exception())))

    async def on_replicate(self, msg: Replicate, peer: bytes) -> Message:
        """A primary's forward: apply it to the group's copy, in the primary's order."""
        group = msg.group
        primary, backup = self.replica_of.get(group, ("", ""))
        if not self.replica_of:
            raise RequestError(f"replicate from {msg.sender!r}: this job keeps no replicas ([ps] replicas = 1)",
                               "bad_request")
        if msg.sender != primary or msg.sender == self.id:
            raise RequestError(f"replicate of {group!r} from {msg.sender!r}: only the group's primary "
                               f"({primary or 'none'!r}) may forward it", "unauthorized")
        core = self.backups.get(group)
        if backup != self.id or core is None:
            raise RequestError(f"replicate of {group!r}: shard {self.id} is not its backup (epoch {self.replica_epoch})",
                               "bad_request")
        detail = core.replicate(msg)
        if msg.op == "state":
            self.log.info("copy_received", group=group, version=core.version, fseq=msg.fseq)
        return Ack(detail=detail)

    def _maybe_checkpoint(self) -> None:
        """Start writing a checkpoint in the background when one is due (``checkpoint_every`` updates since
        the last try, or ``checkpoint_every_s`` seconds with new updates) and none is being written (a due
        one that finds a write in progress waits for the next update or timer tick after it)."""
        if self._checkpointing is not None and not self._checkpointing.done():
            return
        updates = self._updates()
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
        # Every group this shard serves, each to its own file (a group taken over from a lost shard is
        # written where that shard wrote it, so a whole-job --resume finds it there).
        snapshots = {group: core.snapshot() for group, core in self.cores.items()}
        updates = self._updates()
        self._last_attempt, self._last_attempt_at = updates, time.monotonic()
        for group, snapshot in snapshots.items():
            path = self.checkpoint_path if group == self.id else self.checkpoint_path.with_name(f"{group}.pt")
            keep_previous = self._keep_previous if group == self.id else True
            try:
                await asyncio.to_thread(write_checkpoint, snapshot, path, keep_previous)
            except OSError as exc:
                self.stats["checkpoint_failures"] += 1
                self.log.error("checkpoint_failed", path=str(path), version=snapshot["version"],
                               error=f"{exc.strerror or exc} (errno {exc.errno})" if exc.errno else str(exc),
                               kept=str(path) if path.exists() else "none yet")
                return False
            if group == self.id:
                self._keep_previous = True
            self.log.info("checkpoint_written", path=str(path), version=snapshot["version"],
                          updates=updates, seconds=round(time.perf_counter() - t0, 4))
        self._last_checkpoint = max(self._last_checkpoint, updates)
        self.stats["checkpoints"] += 1
        return True

    def _updates(self) -> int:
        """Updates applied to the groups this shard serves (what checkpoints are counted in)."""
        return sum(core.updates_applied for core in self.cores.values())

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
            if not self._resumed and (self.cfg.job.restarts.get("ps", 0) or self.cfg.ps.replicas > 1):
                # A shard that may be restarted (or whose group may be restarted elsewhere) needs a checkpoint
                # from the start: killed before its first periodic one, it could not resume at all.
                self._checkpointing = self.spawn(self.checkpoint(), name="checkpoint")
            replicas = welcome.info.replicas
            if replicas and replicas.epoch > self.replica_epoch:  # a rejoin: the map as it is now
                self.apply_replicas({g: (p, b) for g, p, b in replicas.groups}, replicas.epoch,
                                    dict(welcome.info.shards))
            if welcome.info.workers is not None:  # a rejoin: the workers gone meanwhile hold no round or bound back
                for worker in sorted(self.core.live_workers - set(welcome.info.workers)):
                    self._remove_worker(worker)
            await self.stopping.wait()
        finally:
            # Every way out comes here: stopped (signal, shutdown, job over), the scheduler lost (fail()
            # cancels main), a background task failed, or refused at join.
            self.step = self.core.version
            self._release_waiters()
            if self._checkpointing is not None:  # one write at a time: the final one goes last
                await asyncio.gather(self._checkpointing, return_exceptions=True)
            if self.welcome is not None or self._updates() > self._last_checkpoint:
                await self.checkpoint()
            if self.welcome is not None:
                await self.leave(self.failed or "stopped")
            for c in self._backup_clients.values():
                await c.close()
