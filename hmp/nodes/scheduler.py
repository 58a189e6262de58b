"""The scheduler daemon: the asyncio shell around :class:`hmp.scheduler.core.SchedulerCore`.

Its handlers pass each request and the clock to the core and turn the decisions into replies and
messages (to workers, shards and the placement loop); a monitor task ticks the core. When the
workers have finished it evaluates the final parameters, writes ``model.pt`` and the run report,
and shuts the job down; it saves its state for ``--resume``. The rules are in docs/architecture.md
and docs/resilience.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from hmp import job
from hmp.client import PSClient
from hmp.config import WORKER_ROLES, Config, Role
from hmp.errors import ConfigError, HmpError, RequestError
from hmp.export import exportable, write_atomically, write_model
from hmp.messages import (Ack, Assign, Discover, Drop, Heartbeat, Join, Kind, Leave, Message, Replicas, Report,
                          RingAssign, Shards, Shutdown, StageAssign, Welcome, Work)
from hmp.nodes.base import Node
from hmp.nodes.placement_loop import PlacementLoop
from hmp.report import STATUSES, write_report
from hmp.report import draw as draw_report
from hmp.scheduler.core import (Admitted, Held, JobFailed, MemberChanged, Refused, ReplicasChanged, RingFormed,
                                SchedulerCore, ShardsChanged, ShardsReady, StopDecided, TargetReported, WorkerDropped, WorkersDone)
from hmp.scheduler.membership import CONNECTED, LOST_AFTER, TICK, MemberState
from hmp.train.task import evaluation_of
from hmp.transport.endpoint import Client


#: seconds between saves of the scheduler's state (``scheduler.json``) while the job runs
STATE_EVERY_S = 2.0


class SchedulerNode(Node):
    role = Role.SCHEDULER

    def __init__(self, cfg: Config, node_id: str, resume: bool = False) -> None:
        super().__init__(cfg, node_id)
        sharded = job.sharded_model(cfg) if cfg.shards else None  # allreduce: no PS
        sharding = sharded.report().as_dict() if sharded is not None else {}
        # What a client outside the topology needs to use the PS (docs/protocol.md, "Taking part from
        # outside"): the chunk layout and which shard owns which chunk; the addresses come per status.
        self.ps_layout: dict[str, Any] = {} if sharded is None else {
            "chunks": [[c.key, c.dtype, c.start, c.numel] for c in sharded.layout.chunks],
            "assignment": {str(i): list(keys) for i, keys in sharded.assignment.items()},
            "parameters": [[p.name, p.dtype, p.offset, p.numel, list(p.shape)] for p in sharded.layout.slots],
            "tables": [[t.name, t.dtype, t.offset, t.rows, t.dim] for t in sharded.layout.tables],
            # module buffers (docs/buffers.md): their own flat buffers and chunks, keys after the parameters'
            "buffer_chunks": [[c.key, c.dtype, c.start, c.numel] for c in sharded.layout.buffer_chunks],
            "buffers": [[b.name, b.dtype, b.offset, b.numel, list(b.shape)] for b in sharded.layout.buffers]}
        # Loaded now, before serving: blocking work after the nodes join would delay heartbeats.
        # Only what it evaluates: the test set (a pipeline's planner also profiles a batch of training rows).
        self.dataset = job.dataset(cfg, "all" if cfg.placement.enabled else "test")
        self.core = SchedulerCore(cfg, n_train=self.dataset.n_train, sharding=sharding,
                                  confirm_targets=bool(cfg.shards) and not cfg.sweep.members)
        #: where the state a resumed scheduler continues from is saved (next to the shards' checkpoints)
        self.state_path = job.checkpoint_dir(cfg) / "scheduler.json"
        if resume:
            self._resume()
        self.log.info("chunk_placement", **{k: v for k, v in sharding.items() if not isinstance(v, list)})
        # Set once worker joins are answered: every shard has joined (PS jobs) or the ring is formed.
        self.admitting = asyncio.Event()
        if self.core.admitting:
            self.admitting.set()
        self.workers_done = asyncio.Event()
        # One evaluation of the shards' parameters at a time (a target's confirmation, the final one); the
        # client of the last (its model holds the values evaluated: what model.pt is written from), and the
        # confirmed target's evaluation, which is then the job's result.
        self.evaluating = asyncio.Lock()
        self.evaluated: PSClient | None = None
        self.unplotted: dict[str, Any] | None = None  # the report's JSON, for loss.png after the drain
        self.result: dict[str, Any] | None = None
        self.job_failed = asyncio.Event()
        # [placement] jobs: the loop that plans the pipeline and re-plans when workers come and go.
        self.placement: PlacementLoop | None = (PlacementLoop(cfg, self.dataset, self.core, self.tell_worker, self.log)
                                                if cfg.placement.enabled else None)
        self.worker_clients: dict[str, Client] = {}
        self.shard_clients: dict[str, Client] = {}  # for drop messages
        #: the report's status if the job is stopped before it finishes (a launcher's shutdown may say "timeout")
        self.end_status = "interrupted"

    def _resume(self) -> None:
        """``--resume``: continue from the saved state. None saved (a job that ended before schedulers
        saved one) starts the counters from zero, saying so; an unreadable one or another job's is a
        config error naming the file."""
        path = self.state_path
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            self.log.warning("no_scheduler_state", path=str(path),
                             consequence="the shards resume; epochs and the report start from zero")
            return
        except (OSError, ValueError) as exc:
            raise ConfigError(str(path), "--resume", f"a readable scheduler state (scheduler.json) "
                                                     f"({exc.__class__.__name__}: {exc})") from None
        try:
            self.core.resume(state, str(path))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(str(path), "--resume", f"the scheduler state of this job ({exc})") from None
        self.log.info("resumed", path=str(path), epoch=self.core.work_epoch, cursor=self.core.work_cursor,
                      elapsed_s=round(self.core.time_offset, 3), workers=sorted(self.core.resumed_progress))

    async def save_state(self) -> None:
        """Write the core's state (JSON, atomically) off the event loop; a failed write is logged, not fatal."""
        state = self.core.state_dict(time.monotonic())
        try:
            await self.in_thread(_write_json, state, self.state_path)
        except (OSError, TypeError, ValueError) as exc:
            self.log.error("scheduler_state_failed", path=str(self.state_path), error=str(exc))

    async def _save_state_periodically(self) -> None:
        while not self.core.over and not self.stopping.is_set():
            try:
                await asyncio.wait_for(self.stopping.wait(), STATE_EVERY_S)
                return
            except TimeoutError:
                pass
            if self.core.t0 is not None:  # training has begun
                await self.save_state()

    def handlers(self):
        return {**super().handlers(), Kind.JOIN: self.on_join, Kind.HEARTBEAT: self.on_heartbeat,
                Kind.REPORT: self.on_report, Kind.LEAVE: self.on_leave, Kind.WORK: self.on_work,
                Kind.DISCOVER: self.on_discover}

    # ---------------------------------------------------------------- core events
    def _dispatch_events(self) -> None:
        """Act on what the core decided: logs, the placement loop, the shell's asyncio events."""
        for ev in self.core.take_events():
            if isinstance(ev, MemberChanged):
                self._log_change(ev)
                if ev.roster and self.placement is not None:
                    self.placement.on_membership(ev.change.node, ev.change.new)
            elif isinstance(ev, ShardsReady):
                self.admitting.set()
            elif isinstance(ev, ShardsChanged):
                self.log.warning("shards_changed", epoch=ev.epoch, down=list(ev.down), why=ev.why)
                self._spawn_quietly(self.tell_workers_shards(ev), name=f"shards-{ev.epoch}")
            elif isinstance(ev, ReplicasChanged):
                self.log.warning("replicas_changed", epoch=ev.epoch, groups=[list(g) for g in ev.groups], why=ev.why)
                for group, primary, backup in ev.groups:
                    if not backup:
                        self.log.warning("unreplicated", group=group, primary=primary,
                                         why="no other live shard to keep its backup")
                self._spawn_quietly(self.tell_replicas(ev), name=f"replicas-{ev.epoch}")
            elif isinstance(ev, RingFormed):
                self.log.info("ring_formed", generation=ev.generation, members=list(ev.members))
                if ev.generation == 1:
                    self.admitting.set()  # the welcomes carry it
                else:
                    self.spawn(self.tell_ring(ev), name=f"ring-{ev.generation}")
            elif isinstance(ev, WorkerDropped):
                self.log.warning("worker_dropped", worker=ev.node, reason=ev.reason)
                if self.cfg.shards:
                    self._spawn_quietly(self.tell_shards_drop(ev), name=f"drop-{ev.node}")
            elif isinstance(ev, WorkersDone):
                self.workers_done.set()
            elif isinstance(ev, StopDecided):
                self.log.info("stopping_workers", reason=ev.reason, elapsed_s=round(ev.elapsed_s, 2))
            elif isinstance(ev, TargetReported):
                self._spawn_quietly(self.confirm_target(ev.candidate), name="confirm-target")
            elif isinstance(ev, JobFailed):
                self.log.error("job_failed", reason=ev.reason)
                self.job_failed.set()

    def _log_change(self, ev: MemberChanged) -> None:
        c = ev.change
        fields = {"node": c.node, "node_role": c.role, "old": c.old.value, "why": c.why}
        if c.new == MemberState.LIVE and c.old in (MemberState.JOINING, MemberState.EXPECTED, MemberState.LEFT):
            self.log.info("node_joined", address=self.core.membership[c.node].address, **fields)
        elif c.new == MemberState.LOST:
            if c.role in WORKER_ROLES and self.core.tolerate_worker_loss:
                self.log.warning("worker_lost", **fields)
            else:
                self.log.error("node_lost", **fields)
        elif c.new == MemberState.SUSPECT:
            self.log.warning("node_suspect", **fields)
        elif c.new == MemberState.LEFT:
            self.log.info("node_left", **fields)
        else:
            self.log.info("node_state", state=c.new.value, **fields)

    # ---------------------------------------------------------------- handlers
    async def on_join(self, msg: Join, peer: bytes) -> Message:
        try:
            decision = self.core.join(msg.sender, msg.role, msg.address, msg.pid, time.monotonic())
        finally:
            self._dispatch_events()
        if isinstance(decision, Held):
            await asyncio.wait_for(self.admitting.wait(), self.cfg.job.join_timeout_s)
            try:
                decision = self.core.admit(msg.sender, decision.generation, time.monotonic())
            finally:
                self._dispatch_events()
        if isinstance(decision, Refused):
            return Shutdown(reason=decision.reason)
        assert isinstance(decision, Admitted)
        return Welcome(heartbeat_interval_s=self.cfg.job.heartbeat_interval_s, info=decision.info)

    async def on_heartbeat(self, msg: Heartbeat, peer: bytes) -> Message:
        try:
            refused = self.core.heartbeat(msg.sender, time.monotonic(), msg.step)
        finally:
            self._dispatch_events()
        return Shutdown(reason=refused.reason) if refused is not None else Ack()

    async def on_report(self, msg: Report, peer: bytes) -> Message:
        now = time.monotonic()
        try:
            if self.placement is not None:
                self.core.check_worker(msg.sender, "report", now)  # a shard's report must not reach the loop
                self.placement.on_report(msg.sender, msg.metrics)
                if self.placement.pipeline_done:
                    self.core.request_stop(f"epochs done ({self.placement.steps} steps)", now)
            a = self.core.report(msg.sender, msg.metrics, msg.done, now)
        finally:
            self._dispatch_events()
        return Assign(batch_size=a.batch_size, data_share=a.data_share, stop=a.stop)

    async def on_work(self, msg: Work, peer: bytes) -> Message:
        """Hand out the next ``msg.count`` examples of the current epoch to whoever asks first."""
        try:
            w = self.core.work(msg.sender, msg.count, time.monotonic())
        finally:
            self._dispatch_events()
        return Work(count=w.count, epoch=w.epoch, start=w.start)

    async def on_shutdown(self, msg: Shutdown, peer: bytes) -> Message:
        """``finish``: end the job as a stop rule would (final evaluation, report); else interrupt it (a reason
        that is a report status, e.g. the launcher's ``timeout``, is the report's ``final.status``)."""
        if not msg.finish:
            if msg.reason in STATUSES:
                self.end_status = msg.reason
            return await super().on_shutdown(msg, peer)
        self.log.info("finish_requested", by=msg.sender, reason=msg.reason)
        try:
            self.core.request_stop(f"finish requested by {msg.sender or 'a client'}: {msg.reason}".rstrip(": "),
                                   time.monotonic())
        finally:
            self._dispatch_events()
        return Ack(detail="finishing")

    async def on_leave(self, msg: Leave, peer: bytes) -> Message:
        try:
            self.core.leave(msg.sender, msg.reason, time.monotonic())
        finally:
            self._dispatch_events()
        return Ack()

    def status(self) -> dict[str, Any]:
        st = super().status()
        st.update(self.core.status(time.monotonic()))
        if self.ps_layout:
            st["ps"] = self.ps_directory()
        if self.placement is not None:
            st["pipeline"] = self.placement.status()
        return st

    def ps_directory(self) -> dict[str, Any]:
        """Where the parameter server is and how its chunks are laid out (the ``discover`` answer)."""
        if not self.ps_layout:
            return {}
        return {"shards": self.core.shard_addresses() if self.core.shards_ready else [], **self.ps_layout}

    async def on_discover(self, msg: Discover, peer: bytes) -> Message:
        """Open to any holder of the job token: what a client outside the topology needs to use the PS."""
        return Discover(ps=self.ps_directory())

    # ---------------------------------------------------------------- the placement loop's link to workers
    async def worker_client(self, worker_id: str) -> Client:
        """A connection to a worker's server (the placement loop tells workers their stages)."""
        address = self.core.membership[worker_id].address
        c = self.worker_clients.get(worker_id)
        if c is None or c.address != address:
            if c is not None:
                await c.close()
            c = self.worker_clients[worker_id] = self.client(address)
            await c.connect()
        return c

    def _spawn_quietly(self, coro: Any, name: str) -> None:
        """A background task, unless the node is not running (any more): then it is not needed."""
        try:
            self.spawn(coro, name=name)
        except RuntimeError:
            pass

    async def tell_shards_drop(self, ev: WorkerDropped) -> None:
        """Tell every PS shard that worker ``ev.node`` is gone (all at once). Failing to reach a shard
        is logged, not fatal: a shard that is itself gone is the liveness rules' business."""
        async def tell(shard_id: str) -> None:
            address = self.core.membership[shard_id].address
            if not address:
                return
            c = self.shard_clients.get(shard_id)
            try:
                if c is None or c.address != address:
                    if c is not None:
                        await c.close()
                    c = self.shard_clients[shard_id] = self.client(address)
                    await c.connect()
                await c.request(Drop(node=ev.node, reason=ev.reason),
                                timeout_s=max(1.0, 3 * self.cfg.job.heartbeat_interval_s))
            except HmpError as exc:
                self.log.warning("drop_failed", shard=shard_id, worker=ev.node, error=str(exc))

        await asyncio.gather(*(tell(s) for s in self.core.shard_ids if s not in self.core.failed_over))

    async def shard_client(self, shard_id: str) -> Client | None:
        """The connection to a shard's server (None: it has no address yet)."""
        address = self.core.membership[shard_id].address
        if not address:
            return None
        c = self.shard_clients.get(shard_id)
        if c is None or c.address != address:
            if c is not None:
                await c.close()
            c = self.shard_clients[shard_id] = self.client(address)
            await c.connect()
        return c

    async def tell_replicas(self, ev: ReplicasChanged) -> None:
        """Tell every live shard who serves and backs up each chunk group (all at once); once they
        answered, the failover is done (the report's ``promote_s``) and the workers are told where each
        group is served now: the promoted shards serve before any push is routed to them."""
        msg = Replicas(groups=ev.groups, shards=ev.addresses, epoch=ev.epoch)
        timeout = max(1.0, 3 * self.cfg.job.heartbeat_interval_s)

        async def tell(shard_id: str) -> None:
            try:
                c = await self.shard_client(shard_id)
                if c is not None:
                    await c.request(msg, timeout_s=timeout)
            except HmpError as exc:  # a shard that is itself gone is the liveness rules' business
                self.log.warning("replicas_update_failed", shard=shard_id, epoch=ev.epoch, error=str(exc))

        live = [s for s in self.core.shard_ids if s not in self.core.failed_over
                and self.core.membership[s].state in (MemberState.LIVE, MemberState.SUSPECT)]
        await asyncio.gather(*(tell(s) for s in live))
        self.core.replicas_applied(ev.epoch, time.monotonic())
        self._dispatch_events()
        if ev.tell_workers:
            await self.tell_workers_shards(ShardsChanged(ev.epoch, ev.shards, (), ev.why))

    async def tell_workers_shards(self, ev: ShardsChanged) -> None:
        """Tell every worker still in the job that a shard went down or came back (all at once): they
        hold their pushes to a shard that is down and re-send those in flight once it is back. A
        worker that does not answer is left to the liveness rules."""
        msg = Shards(shards=ev.shards, down=ev.down, epoch=ev.epoch)

        async def tell(worker_id: str) -> None:
            try:
                reply = await (await self.worker_client(worker_id)).request(
                    msg, timeout_s=max(1.0, 3 * self.cfg.job.heartbeat_interval_s))
            except HmpError as exc:
                self.log.warning("shards_update_failed", worker=worker_id, epoch=ev.epoch, error=str(exc))
                return
            # The worker's answer: the version of its last reply from each shard, which tells how far a
            # shard that is down had got (the report's updates lost).
            try:
                versions = json.loads(reply.detail).get("versions", {}) if isinstance(reply, Ack) else {}
                for shard in ev.down:
                    if shard in versions:
                        self.core.shard_version_seen(shard, int(versions[shard]))
            except (ValueError, TypeError, AttributeError, RequestError) as exc:
                self.log.warning("shards_answer_unreadable", worker=worker_id, error=str(exc))

        workers = self.core.membership.ids({MemberState.LIVE, MemberState.SUSPECT, MemberState.JOINING}, workers=True)
        await asyncio.gather(*(tell(w) for w in workers if self.core.membership[w].address))

    async def tell_worker(self, worker_id: str, msg: StageAssign | RingAssign) -> None:
        await (await self.worker_client(worker_id)).request(msg, timeout_s=10)

    async def tell_ring(self, ring: RingFormed) -> None:
        """Tell every member of a re-formed ring its place (all at once). A member that does not
        answer is left to the liveness rules (it will be lost, and the ring re-formed again)."""
        async def tell(rank: int, worker_id: str) -> None:
            msg = RingAssign(ring=ring.generation, members=ring.members, addresses=ring.addresses, rank=rank)
            try:
                await self.tell_worker(worker_id, msg)
            except HmpError as exc:
                self.log.warning("ring_assign_failed", worker=worker_id, generation=ring.generation, error=str(exc))

        await asyncio.gather(*(tell(r, w) for r, w in enumerate(ring.members)))

    # ---------------------------------------------------------------- loops
    async def monitor(self) -> None:
        """Tick the core every tenth of a heartbeat interval (``membership.TICK``) until the job is over or has
        failed. It does not raise: if ticking breaks, the job cannot be judged any more, which fails it with the cause."""
        interval = self.cfg.job.heartbeat_interval_s
        try:
            self.core.start(time.monotonic())
            while not self.core.over and not self.core.failed:
                self.core.tick(time.monotonic())
                self._dispatch_events()
                await asyncio.sleep(interval * TICK)
        except Exception as exc:
            self.log.exception("monitor_failed")
            self.core.fail(f"scheduler monitor failed: {exc.__class__.__name__}: {exc}")
        finally:
            self._dispatch_events()

    async def main(self) -> None:
        self.spawn(self.monitor(), name="monitor")
        self.spawn(self._save_state_periodically(), name="save_state")
        if self.placement is not None:
            self.spawn(self.placement.run(), name="placement")
        try:
            await self.run_job()
        finally:
            for c in [*self.worker_clients.values(), *self.shard_clients.values()]:
                await c.close()

    async def run_job(self) -> None:
        """Wait until every worker is done, the job fails or the scheduler is stopped; then finish
        (evaluate, write the report) and let every node hear that the job is over."""
        waits = [asyncio.create_task(e.wait()) for e in (self.workers_done, self.job_failed, self.stopping)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        self._dispatch_events()
        if self.core.failed:
            self.failed = self.core.failed
            status = "failed"
        elif not self.workers_done.is_set():
            # Stopped by a signal or a shutdown request: a graceful stop, not a failure (exit 0),
            # but every node is told the job is over.
            self.core.interrupt()
            self.log.info("job_interrupted")
            status = self.end_status
        else:
            status = "completed"
        if self.core.t0 is not None:  # training happened: its report and model, however the job ended
            await self.finish(status)
            await self.save_state()  # a --resume continues from here
        self.core.end()
        await self.drain()
        if self.unplotted is not None:
            try:
                await self.in_thread(draw_report, self.unplotted, self.cfg.report_dir / "loss.png")
            except Exception:  # noqa: BLE001 - a plot that cannot be drawn loses nothing: report.json has it all
                self.log.exception("plot_failed")

    async def confirm_target(self, candidate: str) -> None:
        """A worker reported a target reached on its replica: evaluate the parameters the shards hold now.
        If they meet the target the job stops, and these values are its result (``final``, ``model.pt``)."""
        async with self.evaluating:
            if self.core.stop_reason or self.core.failed:  # stopping anyway: the end's parameters are the result
                return
            metrics = await self.evaluate_shards()
            try:
                reason = self.core.target_judged(candidate, metrics, time.monotonic())
            finally:
                self._dispatch_events()
            if reason:
                self.result = {**metrics, "parameters": "at_stop"}
            else:
                self.log.info("target_unconfirmed", candidate=candidate,
                              **{k: v for k, v in metrics.items() if isinstance(v, (int, float, str))})

    async def export(self, final: dict[str, Any]) -> dict[str, Any]:
        """Write ``model.pt`` from the parameters ``final`` evaluated (:attr:`evaluated`); returns the report's
        ``model`` (the path written, or None with ``model_error`` saying why)."""
        why = exportable(self.cfg) or final.get("error") or ("" if self.evaluated is not None else "no evaluation")
        if why:
            return {"model": None, "model_error": why}
        client = self.evaluated
        try:
            metrics = evaluation_of(final)
            path = await self.in_thread(lambda: write_model(
                self.cfg.report_dir, self.cfg, client.model, parameters=final["parameters"], metrics=metrics,
                detail={"shard_versions": dict(client.shard_versions)}, stats=self.dataset.stats))
        except Exception as exc:  # a full disk fails the export, not the job: the report says so
            self.log.exception("model_export_failed")
            return {"model": None, "model_error": f"{exc.__class__.__name__}: {exc}"}
        self.log.info("model_exported", path=str(path), parameters=final["parameters"])
        return {"model": str(path)}

    async def finish(self, status: str = "completed") -> None:
        """Evaluate the final parameters (or take the confirmed target's), export them, write the report with
        ``status`` (how the job ended, :data:`hmp.report.STATUSES`)."""
        if self.cfg.shards:
            async with self.evaluating:
                final = self.result or {**await self.evaluate_shards(), "parameters": "end"}
                final.update(await self.export(final))
        else:
            # allreduce: no PS holds the parameters; every replica is the same, and the ring's rank 0
            # evaluated its own at the end, in its final report, and wrote model.pt from it.
            final = {**self.core.final_from_reports(), "parameters": "ring"}
            written = any(d["final"].get("model_exported") for d in self.core.run_report.workers.values())
            final.update({"model": str(self.cfg.report_dir / "model.pt")} if written else
                         {"model": None, "model_error": exportable(self.cfg) or "rank 0 wrote no model.pt"})
        if self.placement is not None:
            self.core.run_report.pipeline = self.placement.report()
        report = self.core.finish_report(final, time.monotonic())
        report.final["status"] = status
        if status == "failed":
            report.final["stop_reason"] = self.core.failed or self.failed or "failed"
        # report.json now; loss.png once every node has heard the job is over (run_job): drawing it is the
        # slowest part of the end, and a scheduler starved meanwhile must not look lost to the shards.
        paths = await self.in_thread(write_report, report, self.cfg.report_dir, False)
        if self.cfg.job.plot:
            self.unplotted = report.to_json()
        self.log.info("job_finished", **{k: v for k, v in final.items() if isinstance(v, (int, float, str))},
                      report=str(paths[0]))

    async def evaluate_shards(self) -> dict[str, Any]:
        """The test metrics of the parameters the shards hold now; the client that pulled them is kept
        (:attr:`evaluated`: its model holds the values evaluated). Call it holding :attr:`evaluating`."""
        self.evaluated = None
        # A shard that already left or was lost answers nothing: pulling from it would wait out the request
        # timeout (e.g. every daemon got SIGTERM at once and the shards stopped first).
        if gone := self.shards_gone():
            self.log.warning("final_evaluation_skipped", shards_gone=gone)
            return {"error": f"the shards' parameters cannot be read: {', '.join(gone)} no longer serving"}
        try:
            shards = [(s, address) for s, address in self.core.shard_addresses()]
            # Building the model and the report's plot are slow: on the compute thread, so that the
            # event loop keeps answering heartbeats meanwhile.
            client = await self.in_thread(lambda: PSClient.from_config(self.cfg, shards, name=self.id))
            async with client as ps:
                # A shard may stop while it is being read (every daemon got SIGTERM at once): the pull is
                # raced against the shards' membership, so that it gives way as soon as one leaves or is
                # lost instead of waiting out the request timeout.
                pull = asyncio.ensure_future(ps.pull())
                watch = asyncio.ensure_future(self.until_shard_gone())
                try:
                    await asyncio.wait({pull, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
                    if not pull.done():
                        pull.cancel()
                    await asyncio.gather(pull, watch, return_exceptions=True)
                if not pull.done() or pull.cancelled():
                    gone = self.shards_gone()
                    self.log.warning("final_evaluation_skipped", shards_gone=gone)
                    return {"error": f"the shards' parameters cannot be read: {', '.join(gone)} stopped during the read"}
                pull.result()
                metrics = await self.in_thread(ps.evaluate, self.dataset)
            self.evaluated = client
            return metrics
        except Exception as exc:
            self.log.exception("final_evaluation_failed")
            return {"error": f"{exc.__class__.__name__}: {exc}"}

    def shards_gone(self) -> list[str]:
        """The shards whose serving member has left or was lost, each with its state."""
        return [f"{s} ({m.state})" for s in self.core.shard_ids
                if (m := self.core.membership[self.core.primary_of(s)]).state not in CONNECTED]

    async def until_shard_gone(self) -> None:
        """Return once a shard's serving member is no longer connected (polled every membership tick)."""
        while not self.shards_gone():
            await asyncio.sleep(TICK * self.cfg.job.heartbeat_interval_s)

    async def drain(self) -> None:
        """Let every connected node hear 'shutdown' through its heartbeat, then stop (bounded)."""
        interval = self.cfg.job.heartbeat_interval_s
        deadline = time.monotonic() + 3 * interval + 5.0
        while time.monotonic() < deadline:
            # A member silent for the loss bound (dead, frozen) will not hear it: not waited for.
            now = time.monotonic()
            if not [m for m in self.core.membership if m.state in CONNECTED
                    and now - m.last_seen <= LOST_AFTER * interval]:
                break
            await asyncio.sleep(0.05)


def _write_json(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` as JSON to ``path`` atomically (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: f.write(json.dumps(state).encode()))
