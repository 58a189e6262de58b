"""The scheduler daemon: membership, heartbeats, batch-size assignments, job end and the report.

Request flow: nodes ``join`` (workers are held until every PS shard has joined, so their welcome
can list the shards), then ``heartbeat`` every interval; workers ``report`` progress and get an
``assign`` back. A node silent for 3 heartbeat intervals is declared lost: the job fails, every
node is told to shut down, and the scheduler exits non-zero. When every worker has finished, the
scheduler evaluates the final parameters (pulled from the shards), writes the run report and tells
the shards to stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from hmp.client import PSClient
from hmp.config import WORKER_ROLES, Config
from hmp.errors import RequestError
from hmp.messages import Ack, Assign, Heartbeat, Join, Kind, Leave, Message, Report, Shutdown, Welcome, Work
from hmp import job
from hmp.nodes.base import Node
from hmp.nodes.placement_loop import PlacementLoop
from hmp.report import RunReport, write_report
from hmp.batching.policy import BatchPolicy, make_batch_policy
from hmp.transport.endpoint import Client


@dataclasses.dataclass
class Member:
    id: str
    role: str
    address: str = ""
    pid: int = 0
    last_seen: float = 0.0
    state: str = "expected"  # expected | joined | done | left | lost


class SchedulerNode(Node):
    role = "scheduler"

    def __init__(self, cfg: Config, node_id: str) -> None:
        super().__init__(cfg, node_id)
        self.members = {n.id: Member(n.id, n.role) for n in cfg.nodes if n.role != "scheduler"}
        self.shards_ready = asyncio.Event()
        self.workers_done = asyncio.Event()
        self.job_over = asyncio.Event()
        self.job_failed: str | None = None
        self._join_generation: dict[str, int] = {}  # worker -> joins received (see on_join)
        self.t0: float | None = None
        self.stop_reason = ""
        self.report = RunReport(job=cfg.job.name, config=cfg.path, consistency=cfg.train.consistency,
                                policy=cfg.train.policy)
        self.policy: BatchPolicy = make_batch_policy(cfg)
        self.best_accuracy = 0.0
        self.best_test_loss = float("inf")
        sharded = job.sharded_model(cfg)
        self.report.sharding = sharded.report().as_dict()
        # Loaded now, before serving: blocking work after the nodes join would delay heartbeats.
        self.dataset = job.dataset(cfg)
        # First-come-first-served data (Hogbatch): a cursor over each epoch's shuffled order.
        self.work_epoch, self.work_cursor = 0, 0
        self.work_taken: dict[str, int] = {}
        self.log.info("chunk_placement", **{k: v for k, v in self.report.placement.items() if not isinstance(v, list)})
        # [placement] jobs: the loop that plans the pipeline and re-plans when workers come and go.
        self.placement: PlacementLoop | None = PlacementLoop(self) if cfg.placement.enabled else None
        self.worker_clients: dict[str, Client] = {}

    def handlers(self):
        return {**super().handlers(), Kind.JOIN: self.on_join, Kind.HEARTBEAT: self.on_heartbeat,
                Kind.REPORT: self.on_report, Kind.LEAVE: self.on_leave, Kind.WORK: self.on_work}

    def _member(self, msg: Message) -> Member:
        m = self.members.get(msg.sender)
        if m is None:
            raise RequestError(f"{msg.sender!r} is not a node of this topology ({sorted(self.members)})", "unknown_node")
        m.last_seen = time.monotonic()
        return m

    def _worker(self, msg: Message) -> Member:
        """The sending member, which must be a worker: reports and work units are theirs alone."""
        m = self._member(msg)
        if m.role not in WORKER_ROLES:
            raise RequestError(f"{msg.kind.value!r} is for workers; {m.id!r} is a {m.role}", "bad_role")
        return m

    # ---------------------------------------------------------------- handlers
    async def on_join(self, msg: Join, peer: bytes) -> Message:
        m = self._member(msg)
        if msg.role != m.role:
            raise RequestError(f"{msg.sender} joined as {msg.role!r}; the config says {m.role!r}", "bad_role")
        if self.job_over.is_set():
            return Shutdown(reason=self.stop_reason or "job over")
        m.address, m.pid, m.state = msg.address, msg.pid, "joined"
        self.log.info("node_joined", node=m.id, node_role=m.role, address=m.address)
        if all(self.members[s.id].state == "joined" for s in self.cfg.shards):
            self.shards_ready.set()
        info: dict[str, Any] = {"shards": [[s.id, self.members[s.id].address] for s in self.cfg.shards]
                                if self.shards_ready.is_set() else []}
        if m.role in WORKER_ROLES:
            # Held until every shard has joined. The worker re-sends its join every few seconds
            # meanwhile; only the newest one of a worker is answered, so that held joins do not
            # all wake at once (each would re-run placement's membership hook).
            generation = self._join_generation[m.id] = self._join_generation.get(m.id, 0) + 1
            await asyncio.wait_for(self.shards_ready.wait(), self.cfg.job.join_timeout_s)
            if self._join_generation[m.id] != generation:
                raise RequestError(f"{m.id} joined again since this join; the newest join is answered",
                                   "bad_request")
            ids = [w.id for w in self.cfg.workers]
            info = {"shards": [[s.id, self.members[s.id].address] for s in self.cfg.shards],
                    "worker_index": ids.index(m.id), "num_workers": len(ids),
                    "batch_size": self.policy.initial(m.id)}
            if self.t0 is None:
                self.t0 = time.monotonic()
            if self.placement is not None:
                self.placement.on_membership(m.id, "joined")
        return Welcome(heartbeat_interval_s=self.cfg.job.heartbeat_interval_s, info=info)

    async def on_heartbeat(self, msg: Heartbeat, peer: bytes) -> Message:
        m = self._member(msg)
        if m.state == "lost" and self.placement is not None and m.role in WORKER_ROLES and not self.job_over.is_set():
            # A pipeline worker that was only stalled (a busy machine) is back: plan with it again.
            m.state = "joined"
            self.placement.on_membership(m.id, "joined")
        if self.job_over.is_set():
            return Shutdown(reason=self.job_failed or self.stop_reason or "job over")
        return Ack()

    async def on_report(self, msg: Report, peer: bytes) -> Message:
        m = self._worker(msg)
        now = self.elapsed()
        self.report.add_sample(m.id, now, msg.metrics)
        if self.placement is not None:
            self.placement.on_report(m.id, msg.metrics)
            if self.placement.pipeline_done and not self.stop_reason:
                self.stop_reason = f"epochs done ({self.placement.steps} steps)"
        acc = msg.metrics.get("test_accuracy")
        if acc is not None:
            self.best_accuracy = max(self.best_accuracy, acc)
        test_loss = msg.metrics.get("test_loss")
        if test_loss is not None:
            self.best_test_loss = min(self.best_test_loss, test_loss)
        if msg.done:
            m.state = "done"
            self.report.finish_worker(m.id, msg.metrics)
            self._check_workers_done()
            return Assign(batch_size=0, stop=True)
        if not self.stop_reason:
            t = self.cfg.train
            if t.target_accuracy and self.best_accuracy >= t.target_accuracy:
                self.stop_reason = f"target accuracy {t.target_accuracy} reached ({self.best_accuracy:.4f})"
            elif t.target_loss and self.best_test_loss <= t.target_loss:
                self.stop_reason = f"target test loss {t.target_loss} reached ({self.best_test_loss:.4f})"
            elif now > t.max_seconds:
                self.stop_reason = f"time limit of {t.max_seconds} s reached"
            if self.stop_reason:
                self.log.info("stopping_workers", reason=self.stop_reason, elapsed_s=round(now, 2))
        batch, share = self.policy.update(m.id, msg.metrics, now)
        return Assign(batch_size=batch, data_share=share, stop=bool(self.stop_reason or self.job_failed))

    async def on_work(self, msg: Work, peer: bytes) -> Message:
        """Hand out the next ``msg.count`` examples of the current epoch to whoever asks first."""
        m = self._worker(msg)
        if msg.count < 1:
            raise RequestError(f"work count must be >= 1, got {msg.count}", "bad_request")
        n = len(self.dataset.y_train)
        if self.work_cursor >= n:
            self.work_epoch, self.work_cursor = self.work_epoch + 1, 0
        if self.work_epoch >= self.cfg.train.epochs or self.stop_reason or self.job_failed:
            return Work(count=0, epoch=self.work_epoch)
        start = self.work_cursor
        count = min(msg.count, n - start)
        self.work_cursor += count
        self.work_taken[m.id] = self.work_taken.get(m.id, 0) + count
        return Work(count=count, epoch=self.work_epoch, start=start)

    async def on_leave(self, msg: Leave, peer: bytes) -> Message:
        m = self._member(msg)
        if m.role in WORKER_ROLES and m.state != "done":
            self.report.finish_worker(m.id, {})
        m.state = "left"
        self.log.info("node_left", node=m.id, reason=msg.reason)
        if self.placement is not None and m.role in WORKER_ROLES and not self.stop_reason:
            self.placement.on_membership(m.id, "left")
        if msg.reason.startswith("failed:") and not self.job_failed and self.placement is None:
            self.job_failed = f"node {m.id} ({m.role}) {msg.reason}"
        self.policy.forget(m.id)
        self._check_workers_done()
        return Ack()

    def _check_workers_done(self) -> None:
        # A pipeline job re-plans around lost workers instead of failing, so they count as gone.
        gone = ("done", "left", "lost") if self.placement is not None else ("done", "left")
        if all(self.members[w.id].state in gone for w in self.cfg.workers):
            self.workers_done.set()

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def status(self) -> dict[str, Any]:
        st = super().status()
        st.update(elapsed_s=self.elapsed(), stop_reason=self.stop_reason, failed=self.job_failed or "",
                  members={m.id: m.state for m in self.members.values()},
                  workers=self.report.latest(), best_accuracy=self.best_accuracy,
                  best_test_loss=self.best_test_loss if self.best_test_loss != float("inf") else None)
        if self.placement is not None:
            st["pipeline"] = self.placement.status()
        return st

    async def worker_client(self, worker_id: str) -> Client:
        """A connection to a worker's server (the placement loop tells workers their stages)."""
        m = self.members[worker_id]
        c = self.worker_clients.get(worker_id)
        if c is None or c.address != m.address:
            if c is not None:
                await c.close()
            c = self.worker_clients[worker_id] = self.client(m.address)
            await c.connect()
        return c

    # ---------------------------------------------------------------- loops
    async def monitor(self) -> None:
        """Declare nodes lost after 3 silent heartbeat intervals; fail the job if one is."""
        interval = self.cfg.job.heartbeat_interval_s
        deadline = time.monotonic() + self.cfg.job.join_timeout_s
        while not self.job_over.is_set():
            now = time.monotonic()
            for m in self.members.values():
                if m.state in ("joined", "done") and now - m.last_seen > 3 * interval:
                    m.state = "lost"
                    if self.placement is not None and m.role in WORKER_ROLES:
                        self.log.warning("worker_lost", node=m.id, silent_s=round(now - m.last_seen, 2))
                        self.placement.on_membership(m.id, "lost")
                        self._check_workers_done()
                        continue
                    self.job_failed = f"node {m.id} ({m.role}) lost: silent for {now - m.last_seen:.1f} s"
                    self.log.error("node_lost", node=m.id, silent_s=round(now - m.last_seen, 2))
                if m.state == "expected" and now > deadline:
                    self.job_failed = f"node {m.id} ({m.role}) did not join within {self.cfg.job.join_timeout_s} s"
                    self.log.error("node_missing", node=m.id)
            if self.job_failed:
                return
            await asyncio.sleep(interval / 2)

    async def main(self) -> None:
        placement = asyncio.create_task(self.placement.run(), name="placement") if self.placement else None
        try:
            await self._main()
        finally:
            if placement is not None:
                placement.cancel()
                await asyncio.gather(placement, return_exceptions=True)
            for c in self.worker_clients.values():
                await c.close()

    async def _main(self) -> None:
        monitor = asyncio.create_task(self.monitor(), name="monitor")
        done = asyncio.create_task(self.workers_done.wait())
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({monitor, done, stop}, return_when=asyncio.FIRST_COMPLETED)
        if monitor.done() and not monitor.cancelled() and monitor.exception() is not None:
            # The monitor (stop rules, liveness) broke: the job cannot be judged any more. That
            # is a failure with its cause, not a graceful stop.
            exc = monitor.exception()
            self.log.error("monitor_failed", error=f"{exc.__class__.__name__}: {exc}")
            self.job_failed = self.job_failed or f"scheduler monitor failed: {exc.__class__.__name__}: {exc}"
        for t in (monitor, done, stop):
            t.cancel()
        await asyncio.gather(monitor, done, stop, return_exceptions=True)
        if self.job_failed:
            self.failed = self.job_failed
        elif not self.workers_done.is_set():
            # Stopped by a signal or a shutdown request: a graceful stop, not a failure (exit 0),
            # but every node is told the job is over.
            self.stop_reason = "scheduler stopped before the job finished"
            self.log.info("job_interrupted")
        else:
            await self.finish()
        self.job_over.set()
        await self.drain()

    async def finish(self) -> None:
        """Evaluate the final parameters, write the report."""
        try:
            shards = [(s.id, self.members[s.id].address) for s in self.cfg.shards]
            async with PSClient.from_config(self.cfg, shards, name=self.id) as ps:
                await ps.pull()
                # In a thread: the event loop keeps answering heartbeats meanwhile.
                final = await asyncio.to_thread(ps.evaluate, self.dataset)
        except Exception as exc:
            self.log.exception("final_evaluation_failed")
            final = {"error": f"{exc.__class__.__name__}: {exc}"}
        # best_reported_accuracy is what the workers measured on their replicas while training (what the stop rule
        # saw); test_accuracy is the PS parameters at the end, after the updates still in flight when it stopped.
        if self.placement is not None:
            self.report.pipeline = self.placement.report()
        self.report.final = {**final, "elapsed_s": self.elapsed(), "stop_reason": self.stop_reason or "epochs done",
                             "best_reported_accuracy": self.best_accuracy}
        paths = await asyncio.to_thread(write_report, self.report, self.cfg.report_dir)
        self.log.info("job_finished", **{k: v for k, v in final.items() if isinstance(v, (int, float, str))},
                      report=str(paths[0]))

    async def drain(self) -> None:
        """Let every live node hear 'shutdown' through its heartbeat, then stop (bounded)."""
        deadline = time.monotonic() + 3 * self.cfg.job.heartbeat_interval_s + 5.0
        while time.monotonic() < deadline:
            live = [m for m in self.members.values() if m.state in ("joined", "done")]
            if not live:
                break
            await asyncio.sleep(0.05)
