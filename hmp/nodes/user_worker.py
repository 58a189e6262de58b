"""The nodes behind :class:`hmp.Worker`: a worker of the job (``role = "user_worker"``) whose training loop
is the user's own program, not one hmp runs (docs/own_loop.md).

It joins, heartbeats, reports and leaves as the built-in workers do, from whom it inherits everything but
the loop: :class:`UserPSWorkerNode` is a :class:`~hmp.nodes.worker.WorkerNode` (pushes to the PS shards,
async, sync or ssp), :class:`UserRingWorkerNode` a :class:`~hmp.nodes.ring_worker.RingWorkerNode` (the same
buckets, op numbers and stop votes as the built-in ring members, so both kinds share one ring). Instead of
a loop of its own, ``main()`` serves the user's calls (``next_batch``, ``user_step``, ``user_close``) until
the user closes it or the job stops it; progress reports go on a timer, so a stop reaches a user who is
inside ``step()``. The node runs on an event loop of its own thread (:mod:`hmp.nodes.user_handle`), which
is why it leaves the process's signals alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import IO, Any

import structlog
import torch

from hmp import job
from hmp.client import PSClient
from hmp.collective import RingError
from hmp.collective.buckets import plan_buckets
from hmp.config import Config, Consistency
from hmp.data import ShuffledBatches
from hmp.ema import ema
from hmp.messages import RingAssign
from hmp.nodes.ring_worker import RingWorkerNode, params_crc32
from hmp.nodes.worker import WorkerNode
from hmp.ps.optim import chunk_optimizer_of, make_chunk_optimizer
from hmp.train.evaluate import evaluate
from hmp.train.task import task_of
from hmp.train.stop_rule import target_reason

#: What a user call answers when the worker has stopped (the job is over, or the user closed it).
STOPPED = None


def file_logger(stream: IO[str], role: str, node_id: str) -> Any:
    """A structlog logger writing JSON lines to ``stream`` only: the user's process keeps its own logging."""
    return structlog.wrap_logger(
        structlog.PrintLogger(stream),
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO)).bind(role=role, node_id=node_id)


class UserLoop:
    """What both user-loop nodes share; mixed in before their built-in worker class."""

    handles_signals = False  # the user's process owns its signals (hmp.nodes.base.Node.run)

    # set by the node classes this is mixed into
    cfg: Config
    id: str
    log: Any
    metrics: dict[str, float]
    stopping: asyncio.Event
    failed: str | None
    step: int
    busy_s: float
    stop_requested: bool
    batch_size: int
    device: torch.device

    def __init__(self, cfg: Config, node_id: str, *, ready: Future, evaluate: bool = True,
                 log: IO[str] | None = None) -> None:
        super().__init__(cfg, node_id)  # type: ignore[call-arg]
        if log is not None:
            self.log = file_logger(log, self.node.role, node_id)  # type: ignore[attr-defined]
        #: resolved once the worker is admitted and holds the job's parameters (True), or with why not
        self.ready = ready
        self.auto_evaluate = evaluate
        self.user_done = asyncio.Event()  # the user closed the worker: done, not failed
        self.index = 0  # the data share (PS jobs) or ring rank (allreduce jobs): index 0 evaluates
        self.count = 1  # the workers sharing the data (the ring's members)
        self.sharded: Any = None  # the job's model over its flat buffers, once built
        self._user_calls: set[asyncio.Task] = set()
        self._loss_avg: float | None = None
        self._idle_since = 0.0  # when the last step returned: the time since is the user's compute
        self._warned_rebind = False

    # ---------------------------------------------------------------- the user's calls
    async def user_call(self, call: Coroutine[Any, Any, Any]) -> Any:
        """Run one call of the user's (submitted from their thread); an error in it fails the node, as an
        error in a built-in worker's loop does, and reaches the user too."""
        task = asyncio.current_task()
        assert task is not None
        self._user_calls.add(task)
        try:
            return await call
        except asyncio.CancelledError:
            return STOPPED  # the node ended (or the user gave up waiting): the call has no answer
        except Exception as exc:
            if not self.failed:
                self.fail(f"{exc.__class__.__name__}: {exc}")  # type: ignore[attr-defined]
            raise
        finally:
            self._user_calls.discard(task)

    async def user_close(self, failed: str | None) -> None:
        """The user is done: leave the job (``failed``: with that reason, and the job drops this worker)."""
        if failed:
            self.fail(f"the user's loop ended with {failed}")  # type: ignore[attr-defined]
        else:
            self.user_done.set()

    def user_report(self, metrics: dict[str, float]) -> None:
        """Metrics of the user's (e.g. ``test_accuracy``) for the next progress report."""
        self.metrics.update(metrics)

    @property
    def user_stopped(self) -> bool:
        return self.stopping.is_set() or self.user_done.is_set()

    # ---------------------------------------------------------------- helpers of main() and the steps
    def admitted(self) -> None:
        """The worker is in the job and holds its parameters: the user's loop may begin."""
        self.start_clock(self.index)  # type: ignore[attr-defined]
        self._idle_since = time.monotonic()
        self.spawn(self.report_loop(), name="reports")  # type: ignore[attr-defined]
        if not self.ready.done():
            self.ready.set_result(True)
        self.log.info("user_loop_admitted", index=self.index, workers=self.count, batch_size=self.batch_size,
                      device=str(self.device))

    async def until_user_done(self) -> None:
        """Until the user closes the worker or the node is stopped; then end the user's calls still running
        (they race the stop, so a stopped node's end at once)."""
        done = asyncio.ensure_future(self.user_done.wait())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            stop.cancel()
        calls = list(self._user_calls)
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.wait(calls)

    async def report_loop(self) -> None:
        """Report progress every ``report_interval_s`` whether or not the user is stepping, so that the
        scheduler's stop (its answer to a report) reaches a user blocked in ``step()``."""
        interval = self.cfg.train.report_interval_s
        while not self.user_stopped:
            try:
                await asyncio.wait_for(self.stopping.wait(), interval)
                return
            except TimeoutError:
                pass
            if self.user_done.is_set():
                return
            await self.send_progress()
            if self.stop_requested:
                self.on_stop_requested()

    async def send_progress(self) -> None:
        raise NotImplementedError

    def on_stop_requested(self) -> None:
        raise NotImplementedError

    def bind_grads(self) -> None:
        """Every parameter's ``.grad`` as its view of the flat gradient buffer, which the step sends: a
        gradient the user's ``zero_grad()`` set to None (and backward made anew) is copied in, a missing one
        is zero. On the compute thread, while the user waits in ``step()``."""
        flat, layout = self.sharded.flat, self.sharded.layout
        params = dict(self.sharded.model.named_parameters())
        rebound = 0
        for slot in layout.slots:
            p = params[slot.name]
            view = flat.grads[slot.dtype][slot.offset:slot.offset + slot.numel].view(slot.shape)
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                rebound += 1
            else:
                continue
            p.grad = view
        if rebound and not self._warned_rebind:
            self._warned_rebind = True
            self.log.warning("gradients_copied", parameters=rebound,
                             why="their .grad was replaced (zero_grad(set_to_none=True)?); step() zeroes the "
                                 "gradients itself, or call the worker's zero_grad()")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the user's backward has finished before the gradients travel

    def note_step(self, loss: float, samples: int) -> None:
        self.step += 1
        if not math.isnan(loss):
            self._loss_avg = ema(self._loss_avg, loss, 0.9)
        self.metrics.update(samples=self.metrics["samples"] + samples, updates=self.step,
                            loss=self._loss_avg if self._loss_avg is not None else float("nan"))

    def began_step(self) -> None:
        self.busy_s += time.monotonic() - self._idle_since  # the user's forward and backward

    def ended_step(self) -> None:
        self._idle_since = time.monotonic()

    def evaluation_due(self) -> bool:
        return self.auto_evaluate and self.index == 0 and time.monotonic() >= self.next_eval  # type: ignore[attr-defined]


class UserPSWorkerNode(UserLoop, WorkerNode):
    """A user's loop in a PS job (async, sync or ssp): ``user_step`` pushes the gradients and loads the new
    values the shards answer with, as the built-in worker's step does."""

    def __init__(self, cfg: Config, node_id: str, **kw: Any) -> None:
        super().__init__(cfg, node_id, **kw)
        self._data: Any = None
        self._x: Any = None
        self._y: Any = None
        self._batches: Any = None

    async def main(self) -> None:
        self.sharded = await self.in_thread(job.sharded_model, self.cfg, self.device)
        welcome = await self.join()
        if welcome is None:
            return
        self.start_heartbeat()
        info = welcome.info
        self.index, self.count = int(info.worker_index), int(info.num_workers)
        self.batch_size = int(info.batch_size or self.batch_size)
        resumed = info.resume or {}
        if resumed:  # a resumed job: the counters go on from the previous part's
            self.metrics.update({k: resumed[k] for k in ("samples", "updates", "epoch") if k in resumed})
            self.step = int(resumed.get("updates", 0))
            self.samples_before = self.metrics["samples"]
        self.start_epoch = int(info.start_epoch or 0)
        ps = PSClient(self.sharded, [tuple(s) for s in info.shards], name=self.id, cfg=self.cfg,
                      timeout_s=self.cfg.limits.request_timeout_s)
        self.ps = ps
        self.learn_welcome_shards(info)
        await ps.connect()
        try:
            if not await self.with_shards(ps, ps.pull, "pull"):
                return
            self.admitted()
            await self.until_user_done()
            if self._batches is not None:
                await self._batches.aclose()
            if self.user_done.is_set() and not self.stopping.is_set() and self.auto_evaluate and self.index == 0:
                # The user waits in close(): the model is ours to evaluate one last time, as worker 0 does.
                await self.evaluate_now()
        except Exception as exc:
            self.failed = self.failed or f"{exc.__class__.__name__}: {exc}"
            raise
        finally:
            if not self.failed:
                await self.report(ps, done=True)
            await ps.leave(self.failed or "done", timeout_s=1.0 if self.stopping.is_set() else 5.0)
            await ps.close()
            await self.say_goodbye()

    async def job_data(self) -> Any:
        """This worker's share of ``[data]`` (worker 0: with the test set), loaded at the first need."""
        if self._data is None:
            share = None if self.first_come_first_served else (self.index, self.count)
            self._data = await self.in_thread(job.dataset, self.cfg, "all" if self.index == 0 else "train", share)
            self._x, self._y = self._data.x_train, self._data.y_train
            if self.device.type != "cpu":
                self._x, self._y = self._x.to(self.device), self._y.to(self.device)
        return self._data

    async def next_batch(self) -> tuple[Any, torch.Tensor] | None:
        """The next ``(x, y)`` of this worker's share (static slices or work units, as the built-in worker
        trains them); None once the epochs are used up or the worker stopped."""
        if self.user_stopped:
            return STOPPED
        data = await self.job_data()
        if self._batches is None:
            self._batches = self.batches(data.n_train, self.index, self.count)
        idx = await anext(self._batches, None)
        if idx is None:
            self.metrics["epoch"] = self.cfg.train.epochs
            return STOPPED
        idx = idx - data.train_offset  # rows of the training split -> rows of this worker's share
        return self._x[idx], self._y[idx]

    async def user_step(self, loss: float, samples: int) -> bool:
        """Push the gradients the user's backward left in the flat buffer, load the new values; False when
        the worker was stopped first (the gradients may not have been applied)."""
        if self.user_stopped:
            return False
        self.began_step()
        await self.in_thread(self.bind_grads)
        ps = self.ps
        if not await self.push_unless_stopped(ps, samples):
            return False
        if ps.tables and not await self.fresh_tables(ps):  # row-sparse tables: pulled whole after each push
            return False
        await self.in_thread(self.sharded.flat.zero_grad)
        self.note_step(loss, samples)
        if self.evaluation_due():
            await self.evaluate_now()
        self.ended_step()
        return not self.user_stopped

    async def evaluate_now(self) -> dict[str, float]:
        """Evaluate the current parameters on the job's test set (what worker 0 reports)."""
        data = await self.job_data()
        if not await self.fresh_tables(self.ps, data):
            return {}
        out = await self.in_thread(self.evaluate, self.ps, data)
        self.metrics.update(out)
        self.next_eval = time.monotonic() + self.cfg.train.eval_every_s
        return out

    async def send_progress(self) -> None:
        await self.report(self.ps)

    def on_stop_requested(self) -> None:
        self.log.info("stop_requested", by="scheduler")
        self.stopping.set()  # a push in flight gives way; main() reports and leaves


class UserRingWorkerNode(UserLoop, RingWorkerNode):
    """A user's loop in an allreduce job: ``user_step`` sums the gradients over the ring (the built-in
    members' buckets, op numbers and control all-reduce, so both kinds of member share a ring) and steps the
    job's optimizer on the replica; every member stops after the same step."""

    def __init__(self, cfg: Config, node_id: str, **kw: Any) -> None:
        super().__init__(cfg, node_id, **kw)
        self._train: Any = None
        self._order: ShuffledBatches | None = None
        self.epochs_done = False
        self.stopped_together = False  # the ring agreed to stop: no more steps
        self.ring_op = 0
        self.optimizers: dict[str, Any] = {}
        self.bucket_views: tuple[torch.Tensor, ...] = ()

    async def main(self) -> None:
        replica = await self.in_thread(job.sharded_model, self.cfg, self.device)
        if self.arena is not None:
            replica.layout.move_grads(replica.model, replica.flat, self.arena.alloc)
        self.sharded = replica
        flat = replica.flat
        name, hyper = chunk_optimizer_of(self.cfg)
        self.optimizers = {d: make_chunk_optimizer(name, p.numel(), dtype=p.dtype, device=p.device, **hyper)
                           for d, p in flat.params.items()}
        # The built-in members' buckets (hmp.collective.GradientBuckets plans the same), all-reduced in step().
        self.bucket_views = tuple(flat.grads[b.dtype][b.start:b.end]
                                  for b in plan_buckets(replica.layout, self.cfg.collective.bucket_bytes))
        welcome = await self.join()
        if welcome is None:
            return
        self.start_heartbeat()
        r = welcome.info.ring
        self.assigned = RingAssign(ring=r.generation, members=r.members, addresses=r.addresses, rank=r.rank)
        self.batch_size = int(welcome.info.batch_size or self.batch_size)
        self.spawn(self.abort_ring_when_stopped(), name="stop-watch")
        try:
            ring = await self.use_assigned_ring()
            if ring.generation > 1:  # welcomed into a ring formed after the job began: take the ring's state
                try:
                    self.ring_op = await self.resync(ring, flat, self.optimizers)
                except RingError as exc:
                    self.log.warning("resync_failed", generation=ring.generation, error=str(exc))
                    rejoined = await self.rejoin_ring(flat, self.optimizers)
                    if rejoined is None:
                        self.out_of_ring = True
                        return
                    self.ring_op = rejoined
            self.index, self.count = self.ring.rank, self.ring.size
            self.admitted()
            await self.until_user_done()
            if self.user_done.is_set() and not self.stopping.is_set():
                await self.vote_to_stop()  # the user waits in close(): one last step, carrying our stop vote
        except Exception as exc:
            self.failed = self.failed or f"{exc.__class__.__name__}: {exc}"
            raise
        finally:
            if not self.failed and not self.out_of_ring:
                await self.send_report(self.ring_metrics(), done=True)
            if self.ring is not None:
                self.bytes_out += self.ring.stats["bytes_sent"]
                await self.ring.close()
                self.ring = None
            await self.say_goodbye()

    async def train_data(self) -> Any:
        """The training split, as every member loads it (each step takes a slice of one shuffled order)."""
        if self._train is None:
            self._train = await self.in_thread(job.dataset, self.cfg, "train")
            x, y = self._train.x_train, self._train.y_train
            if self.device.type != "cpu":
                x, y = x.to(self.device), y.to(self.device)
            self._x, self._y = x, y
            self._order = ShuffledBatches(len(y), seed=self.cfg.data.seed)  # the same on every member
        return self._train

    async def next_batch(self) -> tuple[Any, torch.Tensor] | None:
        """This member's slice of the ring's next global batch (as the built-in members take theirs); None
        once the epochs are used up (the next step, or close(), votes to stop) or the worker stopped."""
        if self.user_stopped or self.stopped_together or self.out_of_ring or self.epochs_done:
            return STOPPED
        await self.train_data()
        assert self.ring is not None and self._order is not None
        n, rank, b = self.ring.size, self.ring.rank, self.batch_size
        if self.cursor + n * b > len(self._y):  # the rest of the epoch is shorter than a global batch
            self.epoch, self.cursor = self.epoch + 1, 0
        if self.epoch >= self.cfg.train.epochs:
            self.epochs_done = True
            self.metrics["epoch"] = self.epoch
            return STOPPED
        idx = self._order.order(self.epoch)[self.cursor + rank * b:self.cursor + (rank + 1) * b]
        return self._x[idx], self._y[idx]

    async def user_step(self, loss: float, samples: int) -> bool:
        """All-reduce the gradients and step; False once the ring agreed to stop (this step not applied)."""
        if self.user_stopped or self.stopped_together or self.out_of_ring:
            return False
        self.began_step()
        await self.in_thread(self.bind_grads)
        outcome = await self.ring_round(loss, samples, self.stop_requested or self.epochs_done)
        if outcome == "dropped":
            # The ring broke and was re-formed; this step's gradients are gone (the survivors resynced): the
            # user goes on with the next batch, as a built-in member drops the step.
            await self.in_thread(self.sharded.flat.zero_grad)
        self.ended_step()
        return outcome in ("stepped", "dropped")

    async def vote_to_stop(self) -> None:
        """One step with zero gradients and a stop vote (the user closed the worker while the ring goes on);
        again on a re-formed ring if it breaks."""
        while not (self.stopped_together or self.out_of_ring or self.stopping.is_set()):
            await self.in_thread(self.sharded.flat.zero_grad)
            await self.ring_round(float("nan"), 0, True)

    async def ring_round(self, loss: float, samples: int, vote: bool) -> str:
        """One step of the ring: ``"stepped"``, ``"stopped"`` (the ring agreed to stop, nothing applied),
        ``"dropped"`` (the ring broke and was re-formed) or ``"out"`` (no ring to go on with)."""
        ring = self.ring
        assert ring is not None
        flat = self.sharded.flat
        global_batch = ring.size * self.batch_size
        # As the built-in members scale their loss: each gradient weighs its share of the global batch, so
        # the sum is the global batch's mean gradient.
        scale = samples / global_batch
        if samples and scale != 1.0:
            await self.in_thread(lambda: [g.mul_(scale) for g in flat.grads.values()])
        control = torch.zeros(3, dtype=torch.float64)
        control[0] = float(vote or self.stop_requested)
        if samples:
            control[1], control[2] = (0.0 if math.isnan(loss) else loss) * samples, samples
        base = self.ring_op
        # A ring's ops start in increasing order: the buckets' tasks, then the control's, start in the order made.
        ops = [asyncio.ensure_future(ring.all_reduce(view, base + i)) for i, view in enumerate(self.bucket_views)]
        ops.append(asyncio.ensure_future(ring.all_reduce(control, base + len(ops))))
        try:
            await asyncio.gather(*ops)
        except RingError as exc:
            await asyncio.gather(*ops, return_exceptions=True)
            self.log.warning("step_dropped", step=self.step, error=str(exc))
            rejoined = await self.rejoin_ring(flat, self.optimizers)
            if rejoined is None:
                self.out_of_ring = True
                return "out"
            self.ring_op = rejoined
            self.index, self.count = self.ring.rank, self.ring.size
            return "dropped"
        self.ring_op += len(ops)
        if control[0] > 0:
            self.log.info("stopping_together", step=self.step, votes=int(control[0]))
            self.stopped_together = True
            await self.finish_together()
            return "stopped"

        def update() -> None:
            for d, opt in self.optimizers.items():
                opt.step(flat.params[d], flat.grads[d])
            flat.zero_grad()

        await self.in_thread(update)
        self.cursor += global_batch
        total = float(control[2])
        self.note_step(float(control[1]) / total if total > 0 else float("nan"), samples)
        self.metrics["epoch"] = self.epoch
        await self.ring_evaluation()
        return "stepped"

    async def ring_evaluation(self) -> None:
        """Rank 0 evaluates every ``eval_every_s`` (inside the user's step: the model is still) and votes to
        stop at a target, as a built-in rank 0 does."""
        if self.ring is None or self.ring.rank != 0:
            self.next_eval = float("inf")
            return
        if self.next_eval == float("inf"):
            self.next_eval = time.monotonic()  # rank 0 of a re-formed ring evaluates from now on
        if self.evaluation_due():
            await self.evaluate_now()
            if target_reason(self.metrics, self.cfg.train):
                self.stop_requested = True  # carried by the next step's vote

    async def evaluate_now(self) -> dict[str, float]:
        test = await self.test_set(await self.train_data())
        task = task_of(self.cfg)
        out = await self.in_thread(lambda: evaluate(self.sharded.model, test.x_test, test.y_test, task=task))
        self.metrics.update(out)
        self.next_eval = time.monotonic() + self.cfg.train.eval_every_s
        return out

    async def finish_together(self) -> None:
        """The ring stopped: the replica's fingerprint for the report; rank 0's final evaluation and
        ``model.pt``, as a built-in rank 0 writes them."""
        self.metrics["params_crc32"] = float(params_crc32(self.sharded.flat.params))
        if self.ring is not None and self.ring.rank == 0:
            if self.auto_evaluate:
                await self.evaluate_now()
            await self.export_model(self.sharded.model)

    async def send_progress(self) -> None:
        await self.send_report(self.ring_metrics())

    def on_stop_requested(self) -> None:
        pass  # the next step (or close()) carries the stop vote: every member stops after the same step


def node_class(cfg: Config) -> type[UserPSWorkerNode] | type[UserRingWorkerNode]:
    """The user-loop node of ``cfg``'s kind of job."""
    return UserRingWorkerNode if cfg.train.consistency == Consistency.ALLREDUCE else UserPSWorkerNode


__all__ = ["STOPPED", "UserLoop", "UserPSWorkerNode", "UserRingWorkerNode", "node_class"]
