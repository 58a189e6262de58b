"""The worker daemon of an allreduce job (``[train] consistency = "allreduce"``): no PS, a ring.

Every worker holds a full replica of the model in flat buffers (:mod:`hmp.flat`), all-reduces its
gradient buckets over the ring while backward runs, and steps the same optimizer, so the replicas
stay bit-identical. Stopping is agreed in each step's control all-reduce; a lost or joining member
gets a new ring generation and the members resync. The step, membership changes and the data
order are described in docs/collective.md.
"""

from __future__ import annotations

import asyncio
import functools
import io
import time
import zlib
from typing import Any

import torch

from hmp import job
from hmp.collective import BufferMean, GradientBuckets, Ring, RingBroken, RingError, RingHost
from hmp.collective.resync import OPS as RESYNC_OPS
from hmp.collective.resync import resync
from hmp.config import Config
from hmp.data import ShuffledBatches
from hmp.ema import ema
from hmp.errors import HmpError, RequestError
from hmp.messages import Ack, Kind, Message, RingAssign
from hmp.nodes.worker_base import WorkerBase
from hmp.export import write_model
from hmp.ps.optim import chunk_optimizer_of, make_chunk_optimizer
from hmp.ps.lr_schedule import lr_at
from hmp.ps.sharding import ShardedModel
from hmp.train.stop_rule import target_reason
from hmp.train.task import evaluation_of, task_of
from hmp.transport.shm import ShmSettings, open_process_arena

#: Seconds a member told to stop (SIGTERM, the scheduler's shutdown) lets the step in flight finish,
#: which carries its stop vote so that every member stops after the same step; a step blocked on a
#: frozen or dead member cannot finish, so the ring is aborted then and the member stops between rings.
STOP_GRACE_S = 1.0


def params_crc32(params: dict[str, torch.Tensor]) -> int:
    """CRC-32 of the flat parameter buffers' bytes, in dtype order (a replica's fingerprint)."""
    crc = 0
    for d in sorted(params):
        crc = zlib.crc32(params[d].detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc


#: The control all-reduce's slots (float64): stop votes, loss x samples, samples; the module buffers follow
#: (their members' mean is each step's new value: hmp.collective.buffers, docs/buffers.md).
_VOTE, _LOSS, _SAMPLES = 0, 1, 2
_BUFFERS = 3


class RingWorkerNode(WorkerBase):
    """A CPU or GPU worker of an allreduce job (module docstring)."""

    def __init__(self, cfg: Config, node_id: str) -> None:
        super().__init__(cfg, node_id)
        c = cfg.collective
        self.collective_timeout_s = c.timeout_s or cfg.limits.request_timeout_s
        self.ring: Ring | None = None
        # Routes ring pieces to the current ring; a piece of a newer generation (a neighbour heard of
        # it first) waits for it, an older one is refused.
        self.ring_host = RingHost(timeout_s=self.collective_timeout_s)
        self.assigned: RingAssign | None = None  # the newest ring the scheduler told us of
        self.ring_changed = asyncio.Event()  # a newer ring was assigned or built
        self.epoch = 0
        self.cursor = 0  # examples of this epoch's order the ring has used
        self.resyncs = 0
        # Stopped while out of the ring (its step failed and no new ring came before the stop): the
        # replica is not the ring's, so no final evaluation, and no final report (the scheduler has
        # dropped this member already, or is ending the job).
        self.out_of_ring = False
        self.bytes_out = 0.0
        self.test_data: Any = None  # the test set, once this member evaluates (test_set())
        # Opened before the server starts (Node.run): the server and the ring's clients then offer shared
        # memory to members on this host, and the flat gradient buffer lives in it (main()), so ring pieces
        # to them carry a reference to the bucket, not its bytes (docs/shm.md).
        self.arena = (open_process_arena(cfg.job.name, node_id, ShmSettings.of(cfg.shm))
                      if cfg.shm.enabled and self.device.type == "cpu" else None)

    def handlers(self):
        return {**super().handlers(), Kind.RING: self.ring_host.on_piece, Kind.RING_ASSIGN: self.on_ring_assign}

    def status(self) -> dict[str, Any]:
        ring = self.ring
        return {**super().status(), "ring": None if ring is None else
                {"generation": ring.generation, "rank": ring.rank, "members": len(ring.addresses)}}

    # ---------------------------------------------------------------- handlers
    async def on_ring_assign(self, msg: RingAssign, peer: bytes) -> Message:
        """The scheduler re-formed the ring: fail the step in flight; the loop builds the new ring."""
        current = self.assigned.ring if self.assigned is not None else 0
        if msg.ring <= current:
            return Ack(detail=f"generation {msg.ring} is not newer than {current}")
        if not 0 <= msg.rank < len(msg.members) == len(msg.addresses) or msg.members[msg.rank] != self.id:
            raise RequestError(f"ring_assign does not place {self.id} at rank {msg.rank} of {list(msg.members)}",
                               "bad_request")
        self.log.info("ring_reformed", generation=msg.ring, rank=msg.rank, members=list(msg.members))
        self.assigned = msg
        if self.ring is not None:
            self.ring.abort(RingBroken(f"the ring was re-formed as generation {msg.ring} ({len(msg.members)} members)",
                                       blamed=-1, code="ring_reformed"))
        self.ring_changed.set()
        return Ack()

    async def abort_ring_when_stopped(self) -> None:
        """Once told to stop, give the step in flight :data:`STOP_GRACE_S` to carry the stop vote, then abort
        the ring: a collective blocked on a frozen member would otherwise wait for ``[collective] timeout_s``."""
        await self.stopping.wait()
        await asyncio.sleep(STOP_GRACE_S)
        ring = self.ring
        if ring is not None and ring.error is None:
            self.log.info("ring_abandoned", generation=ring.generation, reason="stopping")
            ring.abort(RingBroken(f"{self.id} is stopping", blamed=-1, code="stopped"))

    # ---------------------------------------------------------------- the ring
    async def use_assigned_ring(self) -> Ring:
        """Close the old ring, open the newest assigned one."""
        a = self.assigned
        assert a is not None
        old, self.ring = self.ring, None
        if old is not None:
            self.bytes_out += old.stats["bytes_sent"]
            await old.close()
        c = self.cfg.collective
        ring = Ring(rank=a.rank, addresses=list(a.addresses), generation=a.ring, name=self.id, limits=self.limits,
                    piece_bytes=min(c.piece_bytes, self.cfg.limits.frame_bytes), small_bytes=c.small_bytes,
                    algorithm=c.algorithm,
                    timeout_s=self.collective_timeout_s, frame_bytes=self.cfg.limits.frame_bytes,
                    max_ops_ahead=256)  # a step's buckets + 1 may all arrive early: bounded by the in-flight cap
        await ring.connect()
        self.ring_host.install(ring)
        self.ring = ring
        # which algorithm buckets above small_bytes take: the ring, or halving-doubling ([collective] algorithm)
        self.log.info("ring_ready", generation=ring.generation, rank=ring.rank, members=ring.size,
                      large_buckets="halving" if ring.halving else "ring")
        self.ring_changed.set()
        return ring

    # ---------------------------------------------------------------- main
    async def main(self) -> None:
        # Every member trains on any row (each step is a slice of one shuffled order of the whole training split,
        # and the member count changes when the ring is re-formed), so each loads the training split; only rank 0
        # evaluates, so only it loads the test set (test_set()).
        data = await self.in_thread(job.dataset, self.cfg, "train")
        self.log.info("data_loaded", part="train", train_rows=len(data.y_train), test_rows=len(data.y_test))
        if self.cfg.workers[0].id == self.id:
            # The first ring is the config's workers in order, so this one will be its rank 0: the test set is
            # loaded now, before the ring's first step (the other members would wait for the load inside it).
            await self.test_set(data)
        replica = await self.in_thread(job.sharded_model, self.cfg, self.device)
        if self.arena is not None:
            replica.layout.move_grads(replica.model, replica.flat, self.arena.alloc)
        welcome = await self.join()
        if welcome is None:
            return
        self.start_heartbeat()
        r = welcome.info.ring
        self.assigned = RingAssign(ring=r.generation, members=r.members, addresses=r.addresses, rank=r.rank)
        self.batch_size = int(welcome.info.batch_size or self.batch_size)
        self.spawn(self.abort_ring_when_stopped(), name="stop-watch")
        try:
            if self.assigned.rank == 0:
                await self.test_set(data)  # a restarted member welcomed as rank 0 (loaded already otherwise)
            await self.use_assigned_ring()
            await self.train_ring(replica, data)
        except Exception as exc:
            self.failed = f"{exc.__class__.__name__}: {exc}"
            raise
        finally:
            if not self.failed and not self.out_of_ring:
                await self.send_report(self.ring_metrics(), done=True)
            if self.ring is not None:
                self.bytes_out += self.ring.stats["bytes_sent"]
                await self.ring.close()
                self.ring = None
            await self.say_goodbye()

    async def test_set(self, data: Any) -> Any:
        """The test set, scaled by the training split's statistics; loaded once: before joining by the config's
        first worker (rank 0 of the first ring), else the first time this member is rank 0 (a re-formed ring made
        it so: the others then wait for the load in the next step's all-reduce, within ``[collective]
        timeout_s``)."""
        if self.test_data is None:
            self.test_data = await self.in_thread(functools.partial(job.dataset, self.cfg, "test", stats=data.stats))
            self.log.info("data_loaded", part="test", train_rows=0, test_rows=len(self.test_data.y_test))
        return self.test_data

    def ring_metrics(self) -> dict[str, float]:
        ring = self.ring
        return {**self.progress_metrics(), "resyncs": float(self.resyncs),
                "ring_generation": float(ring.generation if ring else 0),
                "bytes_out": self.bytes_out + (ring.stats["bytes_sent"] if ring else 0.0),
                "lr": lr_at(max(0, self.step - 1), self.cfg.optimizer)}  # the last update's rate

    async def train_ring(self, replica: ShardedModel, data: Any) -> None:
        model, flat = replica.model, replica.flat
        x, y = data.x_train, data.y_train
        if self.device.type != "cpu":
            x, y = x.to(self.device), y.to(self.device)
        name, hyper = chunk_optimizer_of(self.cfg)
        optimizers = {d: make_chunk_optimizer(name, p.numel(), dtype=p.dtype, device=p.device, **hyper)
                      for d, p in flat.params.items()}
        loop = asyncio.get_running_loop()
        ops: dict[int, asyncio.Future] = {}
        ready: dict[int, torch.Tensor] = {}
        step_ops = {"base": 0}

        def start_bucket(index: int, view: torch.Tensor) -> None:  # on the loop
            # Bucket i is op base + i on every member, and a ring's ops start in increasing order: a
            # bucket that completes before a lower-numbered one (a model whose backward does not run
            # in reverse parameter order) waits for it.
            ready[index] = view
            ring = self.ring
            while ring is not None and len(ops) in ready:
                i = len(ops)
                ops[i] = asyncio.ensure_future(ring.all_reduce(ready.pop(i), step_ops["base"] + i))

        buckets = GradientBuckets(model, replica.layout, flat.grads,
                                  lambda i, v: loop.call_soon_threadsafe(start_bucket, i, v),
                                  bucket_bytes=self.cfg.collective.bucket_bytes)
        n_ops = len(buckets) + 1  # the buckets, then the control all-reduce
        buffer_mean = BufferMean(flat.buffers)
        order = ShuffledBatches(len(y), seed=self.cfg.data.seed)  # the same on every worker
        t = self.cfg.train
        self.start_clock(self.ring.rank if self.ring else 1)
        self.log.info("training_allreduce", samples=len(y), batch_size=self.batch_size, buckets=len(buckets),
                      members=len(self.ring.addresses) if self.ring else 0, device=str(self.device))
        loss_avg = None
        task = task_of(self.cfg)
        ring_op = 0  # op numbers restart with each ring generation
        if self.ring is not None and self.ring.generation > 1:
            # Welcomed into a ring formed after the job began (this worker restarted, or came back):
            # its members resync on it first, and this one, at step 0, takes the most advanced state.
            try:
                ring_op = await self.resync(self.ring, flat, optimizers)
            except RingError as exc:
                self.log.warning("resync_failed", generation=self.ring.generation, error=str(exc))
                rejoined = await self.rejoin_ring(flat, optimizers)
                if rejoined is None:
                    self.out_of_ring = True
                    buckets.remove()
                    return
                ring_op = rejoined
        # Per-step wall time (compute, all-reduce, update; not evaluation or reports), for the job manager's
        # measured iteration time: the first step is left out (it connects the ring and warms up).
        timed_s, timed_steps = 0.0, 0
        try:
            while True:
                t_step = time.perf_counter()
                ring = self.ring
                assert ring is not None
                n, rank = len(ring.addresses), ring.rank
                global_batch = n * self.batch_size
                if self.cursor + global_batch > len(y):  # the rest of the epoch is shorter than a global batch
                    self.epoch, self.cursor = self.epoch + 1, 0
                epochs_done = self.epoch >= t.epochs
                vote = float(epochs_done or self.stop_requested or self.stopping.is_set())
                idx = None if epochs_done else order.order(self.epoch)[
                    self.cursor + rank * self.batch_size:self.cursor + (rank + 1) * self.batch_size]
                step_ops["base"] = ring_op
                ops.clear()
                ready.clear()
                control = torch.zeros(_BUFFERS + buffer_mean.numel, dtype=torch.float64)

                def compute() -> tuple[float, float]:
                    t0 = time.perf_counter()
                    flat.zero_grad()
                    buckets.reset()
                    if idx is None:  # voting to stop: contribute zero gradients, compute nothing
                        buckets.flush()
                        return float("nan"), time.perf_counter() - t0
                    # Each member's loss is its share of the global batch's mean, so the sum is the mean's gradient.
                    loss = task.loss(model, x[idx], y[idx])
                    (loss * (len(idx) / global_batch)).backward()
                    buckets.flush()  # parameters that took no part in this pass
                    lv = loss.item()
                    return lv, time.perf_counter() - t0

                try:
                    lv, busy = await self.in_thread(compute)
                    if idx is not None:
                        control[_LOSS], control[_SAMPLES] = lv * len(idx), len(idx)
                    control[_VOTE] = vote
                    buffer_mean.pack(control[_BUFFERS:])
                    await ring.all_reduce(control, ring_op + n_ops - 1)
                    buffer_mean.unpack(control[_BUFFERS:], n)
                    if len(ops) != len(buckets):
                        raise HmpError(f"backward readied {len(ops)} of {len(buckets)} gradient buckets")
                    await asyncio.gather(*ops.values())
                except RingError as exc:
                    await asyncio.gather(*ops.values(), return_exceptions=True)
                    self.log.warning("step_dropped", step=self.step, error=str(exc))
                    rejoined = await self.rejoin_ring(flat, optimizers)
                    if rejoined is None:
                        self.out_of_ring = True
                        break
                    ring_op = rejoined
                    continue
                ring_op += n_ops
                self.busy_s += busy
                if control[_VOTE] > 0:
                    self.log.info("stopping_together", step=self.step, votes=int(control[_VOTE]))
                    break

                def update() -> None:
                    for d, opt in optimizers.items():
                        opt.step(flat.params[d], flat.grads[d])

                await self.in_thread(update)
                self.cursor += global_batch
                self.step += 1
                if self.step > 1:
                    timed_s, timed_steps = timed_s + time.perf_counter() - t_step, timed_steps + 1
                    self.metrics["step_s"] = timed_s / timed_steps
                if control[_SAMPLES] > 0:
                    loss_avg = ema(loss_avg, float(control[_LOSS] / control[_SAMPLES]), 0.9)
                self.metrics.update(samples=self.metrics["samples"] + (len(idx) if idx is not None else 0),
                                    updates=self.step, loss=loss_avg if loss_avg is not None else float("nan"),
                                    epoch=self.epoch)
                await self.ring_tick(model, data)
        finally:
            buckets.remove()
        if self.out_of_ring:
            # Stopped between rings: this replica may be a step behind the ring's and is not evaluated.
            self.log.info("stopped_out_of_ring", step=self.step)
            return
        # The replica's fingerprint, for the report: every member's must be the same.
        self.metrics["params_crc32"] = float(params_crc32(flat.params))
        if flat.buffers:  # and of its module buffers, averaged every step: the same on every member too
            self.metrics["buffers_crc32"] = float(params_crc32(flat.buffers))
        if self.ring is not None and self.ring.rank == 0:
            test = await self.test_set(data)
            self.metrics.update(await self.in_thread(task.evaluate, model, test.x_test, test.y_test))
            await self.export_model(model)

    async def export_model(self, model: torch.nn.Module) -> None:
        """Rank 0 writes the job's ``model.pt`` from the replica it has just evaluated (every member's is the
        same); its final report says whether it did (``model_exported``). A failed write (a full disk) is
        logged and reported, not a failure of the job."""
        metrics = evaluation_of(self.metrics)
        detail = {"step": self.step, "ring_generation": self.ring.generation if self.ring else 0}
        try:
            stats = self.test_data.stats if self.test_data is not None else None  # [data] standardize's
            await self.in_thread(lambda: write_model(self.cfg.report_dir, self.cfg, model, parameters="ring",
                                                     metrics=metrics, detail=detail, stats=stats))
            self.metrics["model_exported"] = 1.0
        except Exception:
            self.log.exception("model_export_failed")
            self.metrics["model_exported"] = 0.0

    async def ring_tick(self, model: torch.nn.Module, data: Any) -> None:
        """After each step: evaluate (rank 0) and report to the scheduler when they are due."""
        now = time.monotonic()
        if self.ring is not None and self.ring.rank == 0 and self.next_eval == float("inf"):
            self.next_eval = now  # rank 0 of a re-formed ring (its old rank 0 was lost) evaluates from now on
        if self.ring is not None and self.ring.rank == 0 and now >= self.next_eval:
            test = await self.test_set(data)
            self.metrics.update(await self.in_thread(task_of(self.cfg).evaluate, model, test.x_test, test.y_test))
            self.next_eval = now + self.cfg.train.eval_every_s
            if target_reason(self.metrics, self.cfg.train):
                # Stop with these parameters: this vote goes into the next step's control all-reduce and every
                # member stops before that step's update, so the final evaluation (and model.pt) is this one's.
                self.stop_requested = True
        elif self.ring is not None and self.ring.rank != 0:
            self.next_eval = float("inf")
        if now >= self.next_report:
            await self.send_report(self.ring_metrics())
            self.next_report = now + self.cfg.train.report_interval_s

    # ---------------------------------------------------------------- losing a member
    async def rejoin_ring(self, flat: Any, optimizers: dict[str, Any]) -> int | None:
        """After a failed step: wait for the scheduler's re-formed ring (bounded: the liveness rules
        re-form it within 3 heartbeat intervals), build it and resync with the survivors; again if
        that ring breaks too. Returns the new ring's next op number, or None when the node was told
        to stop first (SIGTERM, the job's end, or the scheduler refusing a member that was dropped
        while it hung: a frozen member, thawed, finds the ring gone on without it): a stop, not a
        failure."""
        wait_s = 2 * self.collective_timeout_s + 3 * self.cfg.job.heartbeat_interval_s
        deadline = time.monotonic() + wait_s
        while True:
            if self.stopping.is_set():  # a new ring would only be aborted (abort_ring_when_stopped)
                return None
            while self.ring is not None and self.assigned is not None and self.assigned.ring <= self.ring.generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RingBroken(f"{self.id}: a ring step failed and no re-formed ring came within {wait_s:.1f} s",
                                     blamed=-1, code="timeout")
                if self.stopping.is_set():
                    return None
                self.ring_changed.clear()
                try:
                    await asyncio.wait_for(self.ring_changed.wait(), min(left, 0.5))
                except TimeoutError:
                    pass
            ring = await self.use_assigned_ring()
            try:
                return await self.resync(ring, flat, optimizers)
            except RingError as exc:
                self.log.warning("resync_failed", generation=ring.generation, error=str(exc))
                deadline = time.monotonic() + wait_s

    async def resync(self, ring: Ring, flat: Any, optimizers: dict[str, Any]) -> int:
        """Agree with the survivors on the step to go on from (:mod:`hmp.collective.resync`); returns
        the new ring's next op number."""

        def snapshot() -> bytes:
            buf = io.BytesIO()
            torch.save({"params": {d: p.cpu() for d, p in flat.params.items()},
                        "buffers": {d: b.cpu() for d, b in flat.buffers.items()},
                        "optimizers": {d: o.state_dict() for d, o in optimizers.items()},
                        "step": self.step, "epoch": self.epoch, "cursor": self.cursor}, buf)
            return buf.getvalue()

        def restore(blob: bytes) -> None:
            state = torch.load(io.BytesIO(blob), weights_only=True)
            with torch.no_grad():
                for d, p in flat.params.items():
                    p.copy_(state["params"][d])
                for d, b in flat.buffers.items():
                    b.copy_(state["buffers"][d])
            for d, o in optimizers.items():
                o.load_state_dict(state["optimizers"][d])
            self.step, self.epoch, self.cursor = int(state["step"]), int(state["epoch"]), int(state["cursor"])

        out = await resync(ring, self.step, snapshot, restore)
        if out.source is not None:
            self.resyncs += 1
        self.log.info("resynced", step=self.step, members=ring.size, generation=ring.generation,
                      steps=list(out.steps), source_rank=out.source)
        return RESYNC_OPS
