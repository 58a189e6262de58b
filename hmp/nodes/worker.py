"""CPU and GPU worker daemons: one training loop, differing in device, batch size and threads.

Per step a worker takes a batch of its data shard, runs forward and backward on the compute thread
(so the event loop keeps heartbeating), pushes the flat gradients to the shards and continues with
the values their replies carry; it reports progress to the scheduler, which answers with its batch
size and whether to stop. Shard restarts, row-sparse tables and resumed jobs are handled as
docs/protocol.md ("Shard restarts", "Row-sparse tables") and docs/resilience.md describe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from hmp.client import PSClient
from hmp.train.evaluate import evaluate_sweep
from hmp.train.hogwild import GradientAccumulator, HogwildTrainer
from hmp.config import BatchPolicyKind, Config
from hmp.data import ShuffledBatches, take_rows, whole_batch
from hmp.ema import ema
from hmp import job
from hmp.errors import HmpError, RemoteError
from hmp.messages import Kind, Work
from hmp.nodes.shard_follower import ShardFollower
from hmp.nodes.worker_base import WorkerBase
from hmp.ps.lr_schedule import lr_at
from hmp.train.task import task_of


async def _with_next(batches: AsyncIterator[torch.Tensor], ahead: bool) -> AsyncIterator[tuple[torch.Tensor, Any]]:
    """``(batch, next batch or None)`` of ``batches`` (``ahead``: one batch read ahead, so that a step knows
    the next batch's rows; else ``(batch, None)`` as they come, as before)."""
    if not ahead:
        async for idx in batches:
            yield idx, None
        return
    prev = None
    async for idx in batches:
        if prev is not None:
            yield prev, idx
        prev = idx
    if prev is not None:
        yield prev, None


class WorkerNode(ShardFollower, WorkerBase):
    def __init__(self, cfg: Config, node_id: str) -> None:
        super().__init__(cfg, node_id)
        self.init_shard_view()  # the PS shards as the scheduler last said (hmp.nodes.shard_follower)
        self.push_seq = time.time_ns() // 1000  # new to every shard after a restart (docs/protocol.md)
        self.push_retries = 0
        self.ps: PSClient | None = None  # once admitted
        self.start_epoch = 0  # --resume: the first epoch of a static data share
        self._eval_rows: dict[str, torch.Tensor] | None = None  # the table rows the test set reads

    def handlers(self):
        return {**super().handlers(), Kind.SHARDS: self.on_shards}

    async def main(self) -> None:
        # The model is built before joining, on the compute thread (signals are still heard); the data after, when
        # this worker knows its slice: it loads only what it trains on (docs/data.md, "Loading a part").
        sharded = await self.in_thread(job.sharded_model, self.cfg, self.device)
        welcome = await self.join()
        if welcome is None:
            return
        self.start_heartbeat()
        info = welcome.info
        index, count = int(info.worker_index), int(info.num_workers)
        # A static slice is this worker's share of the training rows; first-come-first-served work units may come
        # from anywhere. Only worker 0 evaluates, so only it loads the test set.
        share = None if self.first_come_first_served else (index, count)
        data = await self.in_thread(job.dataset, self.cfg, "all" if index == 0 else "train", share)
        self.batch_size = int(info.batch_size or self.batch_size)
        resumed = info.resume or {}
        if resumed:  # a resumed job: the counters go on from the previous part's
            self.metrics.update({k: resumed[k] for k in ("samples", "updates", "epoch") if k in resumed})
            self.step = int(resumed.get("updates", 0))
            self.samples_before = self.metrics["samples"]
        self.start_epoch = int(info.start_epoch or 0)
        ps = PSClient(sharded, [tuple(s) for s in info.shards], name=self.id, cfg=self.cfg,
                      timeout_s=self.cfg.limits.request_timeout_s)
        self.ps = ps
        self.learn_welcome_shards(info)
        await ps.connect()
        try:
            if not await self.with_shards(ps, ps.pull, "pull"):
                return
            await self.train(ps, data, index, count)
        except Exception as exc:
            self.failed = f"{exc.__class__.__name__}: {exc}"
            raise
        finally:
            if not self.failed:
                await self.report(ps, done=True)
            # Stopped (SIGTERM, the scheduler's stop): a frozen shard is not waited for long.
            await ps.leave(self.failed or "done", timeout_s=1.0 if self.stopping.is_set() else 5.0)
            await ps.close()
            await self.say_goodbye()

    async def push_unless_stopped(self, ps: PSClient, samples: int, want: Any = None) -> bool:
        """Push the gradient buffer; False when the node was told to stop first.

        A push can block until the request timeout: a sync round or an SSP bound waits on other
        workers, and any push waits on a frozen or dead shard. SIGTERM or the scheduler's stop
        must end it at once rather than after the timeout, so every push is raced against
        ``stopping`` (one task per push, besides the client's own per shard). ``want``: the rows of
        the row-sparse tables the reply is to carry (:meth:`PSClient.push`).
        """
        if self.stopping.is_set():
            return False
        self.push_seq += 1
        seq = self.push_seq  # the same in every retry of this push: a shard applies it once
        try:
            if not await self.with_shards(ps, lambda: ps.push(samples=samples, seq=seq, want=want), "push"):
                self.log.info("push_abandoned", reason="stopping")
                return False
            return True
        except RemoteError as exc:
            if exc.code != "shutting_down":
                raise
            # The shard closed before the scheduler's shutdown reached us: the job is over.
            self.log.info("push_abandoned", reason="shard shutting down")
            self.stop_requested = True  # stop, not fail
            return False

    async def with_shards(self, ps: PSClient, request: Any, what: str) -> bool:
        """:meth:`~hmp.nodes.shard_follower.ShardFollower.follow_shards` raced against a stop: True once
        ``request()`` (a pull or a push of ``ps``) completed, False when the node was told to stop first;
        raises what the request raised."""
        task = asyncio.ensure_future(self.follow_shards(ps, request, what))
        if not await self.unless_stopped(task):
            return False
        task.result()
        return True

    def current_metrics(self, ps: PSClient) -> dict[str, float]:
        out = {**self.progress_metrics(), "bytes_out": float(ps.bytes_out), "bytes_in": float(ps.bytes_in),
               "version": float(ps.version)}
        if ps.tables:
            out["rows_pushed"] = float(ps.rows_pushed)
        versions = getattr(ps, "shard_versions", None)
        if versions and not self.cfg.sweep.members:
            # The rate of the last update the shards applied, as far as this worker has heard (the lowest
            # shard version in its replies: a version counts the updates applied, docs/optimizers.md).
            out["lr"] = lr_at(max(0, min(versions.values()) - 1), self.cfg.optimizer)
        return out

    async def report(self, ps: PSClient, done: bool = False) -> None:
        """Report progress (:meth:`~hmp.nodes.worker_base.WorkerBase.send_report`) and take the batch size
        the scheduler answers with."""
        reply = await self.send_report(self.current_metrics(ps), done)
        if reply is not None and not reply.stop and 0 < reply.batch_size != self.batch_size:
            self.log.info("batch_size_changed", old=self.batch_size, new=reply.batch_size)
            self.batch_size = reply.batch_size

    @property
    def first_come_first_served(self) -> bool:
        """Hogbatch policies hand data out on demand; the others give each worker a fixed slice."""
        return self.cfg.train.policy in (BatchPolicyKind.HOGBATCH, BatchPolicyKind.ADAPTIVE)

    async def units(self, n: int, index: int, count: int) -> AsyncIterator[torch.Tensor]:
        """Index tensors into the training set, a unit of work at a time, until the epochs are used up.

        Static: this worker's contiguous slice, reshuffled each epoch (one unit per epoch).
        First-come-first-served: work units of a few batches fetched from the scheduler, ranges
        of the epoch's shuffled order (every node derives the same order from the seed), so
        faster workers take more of the data.
        """
        t = self.cfg.train
        if not self.first_come_first_served:
            lo, hi = n * index // count, n * (index + 1) // count
            mine = ShuffledBatches(hi - lo, seed=(self.cfg.data.seed, index))
            for epoch in range(self.start_epoch, t.epochs):
                self.metrics["epoch"] = epoch
                yield lo + mine.order(epoch)
            return
        assert self.scheduler is not None
        order = ShuffledBatches(n, seed=self.cfg.data.seed)  # the same on every worker
        while True:
            request = asyncio.ensure_future(self.scheduler.request(Work(count=self.batch_size * t.work_unit_batches)))
            if not await self.unless_stopped(request):
                return
            unit = request.result()
            assert isinstance(unit, Work)
            if unit.count == 0:
                return
            self.metrics["epoch"] = unit.epoch
            yield order.order(unit.epoch)[unit.start:unit.start + unit.count]

    async def batches(self, n: int, index: int, count: int) -> AsyncIterator[torch.Tensor]:
        """Batches of the work units; the batch size is read at every step, as the scheduler
        may change it at any report."""
        async for ids in self.units(n, index, count):
            pos = 0
            while pos < len(ids):
                yield ids[pos:pos + self.batch_size]
                pos += self.batch_size

    async def fresh_tables(self, ps: PSClient, data: Any = None) -> bool:
        """Before an evaluation (``data``: the data set; None: after a push), pull what the local row-sparse
        tables need fresh (they are fresh only in the rows the batches read): the rows the test set reads
        (``rows_touched``, worked out once), or the tables whole for a model without the method; False
        when the node was told to stop first. Nothing to do for a dense model."""
        if not ps.tables:
            return True
        rows_of = getattr(ps.model, "rows_touched", None)
        if data is not None and rows_of is not None:
            if self._eval_rows is None:
                self._eval_rows = await self.in_thread(lambda: rows_of(whole_batch(data.x_test)))
            rows = self._eval_rows
            return await self.with_shards(ps, lambda: ps.pull(keys=ps.table_keys if not rows else (), rows=rows),
                                          "pull")
        return await self.with_shards(ps, lambda: ps.pull(keys=ps.table_keys), "pull")

    async def tick(self, ps: PSClient, data: Any) -> None:
        """After each step: evaluate (worker 0) and report to the scheduler when they are due."""
        now = time.monotonic()
        if now >= self.next_eval:
            if not await self.fresh_tables(ps, data):
                return
            self.metrics.update(await self.in_thread(self.evaluate, ps, data))
            self.next_eval = now + self.cfg.train.eval_every_s
        if now >= self.next_report:
            await self.report(ps)
            self.next_report = now + self.cfg.train.report_interval_s

    async def train(self, ps: PSClient, data: Any, index: int, count: int) -> None:
        if self.node.hogwild_threads > 1 and ps.sharded.array is None:
            await self.train_hogwild(ps, data, index, count)
            return
        model = ps.model
        x, y = data.x_train, data.y_train
        if self.device.type != "cpu":
            x, y = x.to(self.device), y.to(self.device)
        t = self.cfg.train
        self.start_clock(index)
        self.log.info("training", samples=len(y), batch_size=self.batch_size, device=str(self.device),
                      data="first-come-first-served" if self.first_come_first_served else "static slice")
        loss_avg = None
        task = task_of(self.cfg)
        array, flat = ps.sharded.array, ps.sharded.flat
        # Sweep: the values before the step, to push the step's delta (a copy by necessity).
        before = {d: torch.empty_like(t) for d, t in flat.params.items()} if array is not None else {}
        # Row-sparse tables: the rows of the next batch come back with each push (None: whole tables are
        # pulled after it, for a model that cannot say which rows a batch reads).
        rows_of = getattr(model, "rows_touched", None) if ps.tables else None
        if ps.tables and rows_of is None:
            self.log.warning("whole_table_pulls", tables=list(ps.tables),
                             why="the model has no rows_touched(batch) method")

        def step(idx: torch.Tensor, batch: Any, next_idx: torch.Tensor | None) -> tuple[float, list[float], float,
                                                                                           Any, Any]:
            """One step's compute, on the compute thread: (loss, sweep members' losses, seconds, the next batch's
            rows of the row-sparse tables, the next batch when gathered for them)."""
            t0 = time.perf_counter()
            members: list[float] = []
            want = next_batch = None
            if array is None:
                flat.zero_grad()  # keeps .grad as views of the flat buffer (one op per dtype)
                loss = task.loss(model, x[idx] if batch is None else batch, y[idx])
                loss.backward()
                lv = loss.item()  # waits for the device: the push reads finished gradients
                if rows_of is not None and next_idx is not None:
                    next_batch = x[next_idx]
                    want = rows_of(next_batch)
            else:
                # HFTA sweep: the fused optimizer (per-member hyper-parameters) steps locally; the
                # delta old - new goes to the shards in the gradient buffer; they apply p -= 1 * delta.
                for d, values in flat.params.items():
                    before[d].copy_(values)
                member_losses = array.step(x[idx], y[idx])
                for d, values in flat.params.items():
                    torch.sub(before[d], values, out=flat.grads[d])
                members = member_losses.tolist()
                lv = sum(members) / len(members)
            return lv, members, time.perf_counter() - t0, want, next_batch

        batch = None
        async for idx, next_idx in _with_next(self.batches(data.n_train, index, count), rows_of is not None):
            idx = idx - data.train_offset  # rows of the training split -> rows of this worker's share
            if next_idx is not None:
                next_idx = next_idx - data.train_offset
            if self.stopping.is_set() or self.stop_requested:
                return
            lv, members, busy, want, batch = await self.in_thread(step, idx, batch, next_idx)
            self.busy_s += busy
            if members:
                self.metrics.update({f"member{b}_loss": v for b, v in enumerate(members)})
            if not await self.push_unless_stopped(ps, len(idx), want):
                return
            if ps.tables and rows_of is None and not await self.fresh_tables(ps):
                return
            self.step += 1
            loss_avg = ema(loss_avg, lv, 0.9)
            self.metrics.update(samples=self.metrics["samples"] + len(idx), updates=self.step, loss=loss_avg)
            await self.tick(ps, data)
        self.metrics["epoch"] = t.epochs
        if index == 0 and await self.fresh_tables(ps, data):
            self.metrics.update(await self.in_thread(self.evaluate, ps, data))

    def evaluate(self, ps: PSClient, data: Any) -> dict[str, float]:
        if ps.sharded.array is not None:
            return evaluate_sweep(ps.sharded.array, data.x_test, data.y_test)
        return task_of(self.cfg).evaluate(ps.model, data.x_test, data.y_test)

    async def train_hogwild(self, ps: PSClient, data: Any, index: int, count: int) -> None:
        """CPU Hogbatch: ``hogwild_threads`` threads update the local replica without locks
        (torch releases the GIL in its kernels) and add each update's gradient to an
        accumulator; meanwhile this task pushes the accumulated sum to the PS every few
        updates and the reply's values overwrite the replica (racing the threads, as Hogwild
        updates race each other). The PS applies the sum: every thread's update reaches it."""
        flat = ps.sharded.flat
        if len(flat.grads) != 1:
            raise HmpError("hogwild_threads > 1 needs a model with one parameter dtype")
        if ps.tables:  # the config check refuses it at load; this is for workers built by hand
            raise HmpError(f"hogwild_threads > 1 needs a model without row-sparse tables ({', '.join(ps.tables)}): "
                           "the threads sum dense gradients")
        (grad_buf,) = flat.grads.values()
        lr = self.cfg.optimizer.lr
        o = self.cfg.optimizer
        if o.name != "sgd" or o.momentum:
            # The PS applies the *sum* of the threads' gradients; momentum or Adam on the PS then
            # turns several Hogwild steps into one much larger step.
            self.log.warning("hogwild_with_momentum", optimizer=o.name, momentum=o.momentum,
                             advice="Hogbatch as in the paper uses plain SGD (momentum = 0)")
        trainer = HogwildTrainer(ps.model, self.node.hogwild_threads, lr, self.batch_size, step=task_of(self.cfg).loss)
        acc = GradientAccumulator.for_model(ps.model)
        self.start_clock(index)
        self.log.info("training_hogwild", threads=self.node.hogwild_threads, batch_size=self.batch_size)
        x, y = data.x_train, data.y_train

        async def push_pending() -> None:
            if self.stopping.is_set() or self.stop_requested:
                return  # an abandoned push may still hold grad_buf: leave it alone
            drained = acc.drain()
            if drained.updates == 0:
                return
            # A copy, on purpose: the threads keep accumulating into a fresh sum while this one is pushed, and the
            # push sends the flat gradient buffer (parameters() order == the flat layout's order).
            grad_buf.copy_(drained.grad_sum)
            if not await self.push_unless_stopped(ps, drained.samples):
                return
            self.step += drained.updates
            self.metrics.update(samples=self.metrics["samples"] + drained.samples, updates=self.step)

        async for ids in self.units(data.n_train, index, count):
            ids = ids - data.train_offset  # rows of the training split -> rows of this worker's share
            if self.stopping.is_set() or self.stop_requested:
                break
            trainer.batch_size = self.batch_size
            t0 = time.perf_counter()
            # take_rows: a unit of sparse rows stays CSRRows, from which the threads gather their own batches
            run = asyncio.create_task(asyncio.to_thread(trainer.accumulate_gradients, take_rows(x, ids), y[ids], acc,
                                                        epochs=1, seed=self.step))
            try:
                while not run.done():
                    await asyncio.wait({run}, timeout=0.005)
                    await push_pending()
                    if self.stopping.is_set() or self.stop_requested:
                        trainer.stop()
            finally:  # a failed push must not leave the threads training on into a closed PS client
                trainer.stop()
                await asyncio.wait({run})
            stats = run.result()
            await push_pending()
            self.busy_s += min(stats.busy_s / max(1, self.node.hogwild_threads), time.perf_counter() - t0)
            if stats.updates:
                self.metrics["loss"] = ema(self.metrics.get("loss"), stats.mean_loss, 0.9)
            await self.tick(ps, data)
        if index == 0:
            self.metrics.update(await self.in_thread(self.evaluate, ps, data))
