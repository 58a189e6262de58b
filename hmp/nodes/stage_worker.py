"""The worker daemon of a ``[placement]`` job: runs whatever pipeline stage the scheduler assigns.

It waits for a ``stage_assign``, pulls its stage's parameters from the PS shards and runs the
micro-batch schedule of :mod:`hmp.pipeline.microbatches`, pushing its chunks' gradients every step; a
later assignment (a re-plan) aborts the step in flight and continues with the new layers. One
engine task handles every event in arrival order, so a push's reply never rewrites parameters a
forward or backward saved. The step, the overlapped push, held messages, backpressure and faults
are described in docs/pipeline.md.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hmp.client import PSClient
from hmp.train.task import task_of
from hmp.config import Config
from hmp.errors import HmpError
from hmp import job
from hmp.messages import Ack, Activations, Assign, Gradients, Kind, Message, Report, StageAssign
from hmp.nodes.base import Node
from hmp.nodes.shard_follower import ShardFollower
from hmp.pipeline.chunks import stage_chunk_keys
from hmp.pipeline.microbatches import ExampleOrder, micro_batches_of, worker_for
from hmp.pipeline.stage import StageCompute
from hmp.flat import chunk_views
from hmp.placement.profiler import param_layers
from hmp.transport.eager import start_eager
from hmp.transport.endpoint import Client

#: Seconds the last push of a worker that was told to stop (SIGTERM, the scheduler's shutdown) may
#: still take to be answered before it is abandoned: a live shard answers in milliseconds, a frozen
#: or dead one never does.
LAST_PUSH_GRACE_S = 1.0


class Stopped(Exception):
    """The node was told to stop while the engine waited on a peer (internal: ends the engine)."""


class StagePSClient(PSClient):
    """A PS client whose ``pull``/``push`` touch only the chunks given to :meth:`restrict`, with two
    gradient buffers: a step accumulates into one while the other's push is in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        layout, flat = self.sharded.layout, self.sharded.flat
        # The second buffer costs one more copy of the gradients' memory, no copying: each push
        # sends the chunks of the buffer it was made from, zero-copy.
        bufs = [flat.grads, {d: torch.zeros_like(b) for d, b in flat.grads.items()}]
        self._grad_sets = [chunk_views(b, layout.chunks) for b in bufs]
        self._param_grads = [layout.param_views(b) for b in bufs]
        self._named = dict(self.sharded.model.named_parameters())
        self.buffer = 0

    def use_buffer(self, i: int, names: Iterable[str] | None = None) -> None:
        """Make gradient buffer ``i`` the one pushes send and backward accumulates into (for the
        parameters ``names``, default all), its stage chunks zeroed."""
        self.buffer = i
        self.use_gradients(self._grad_sets[i])
        self.zero_grads()
        views = self._param_grads[i]
        for n in (self._named if names is None else names):
            self._named[n].grad = views[n]

    def reset_buffers(self) -> None:
        """Both gradient buffers zeroed, every parameter's gradient back in the first (a new stage)."""
        for views in self._grad_sets:
            for g in views.values():
                g.zero_()
        self.buffer = 0
        self.use_gradients(self._grad_sets[0])
        views = self._param_grads[0]
        for n, p in self._named.items():
            p.grad = views[n]

    def push_buffer(self, buffer: int, samples: int, seq: int) -> list[Any]:
        """The push requests of gradient buffer ``buffer`` (:meth:`PSClient.push_requests`), whichever
        buffer is in use now: a push sent again after a shard change sends the buffer it was made from."""
        in_use, self._grads = self._grads, self._grad_sets[buffer]
        try:
            return self.push_requests(samples=samples, seq=seq)
        finally:
            self._grads = in_use

    @property
    def grads(self) -> dict[int, torch.Tensor]:
        """The chunk views of the gradient buffer in use (what the next push sends)."""
        return self._grad_sets[self.buffer]

    def zero_grads(self) -> None:
        """Zero the gradient chunks of this stage only (the other layers' never receive any here)."""
        grads = self._grad_sets[self.buffer]
        for k in self.keys:
            grads[k].zero_()


class StageWorkerNode(ShardFollower, Node):
    def __init__(self, cfg: Config, node_id: str) -> None:
        super().__init__(cfg, node_id)
        # Unbounded as a queue: assignments, stop wake-ups and replayed held messages go in at once. The data
        # from peers is bounded by on_data, which waits while the engine has ``events_bound`` events queued.
        self.events: asyncio.Queue[Message | None] = asyncio.Queue()
        self.events_bound = 4 * cfg.placement.micro_batches
        self._room = asyncio.Event()
        self.eval_ps: PSClient | None = None
        self.train_data: Any = None  # the training split, once this worker is assigned stage 0 (load_train())
        self.held: list[Message] = []
        self.assign: StageAssign | None = None
        self.compute: StageCompute | None = None
        self.peers: dict[str, Client] = {}
        self.stop_requested = False
        self.step_mbs: tuple[int, ...] = ()
        # Pushes in flight, oldest first: (gradient buffer, replies). Their new values are written
        # in this order at points where no micro-batch's graph is saved.
        self.pushes: collections.deque[tuple[int, asyncio.Future[list[Message]]]] = collections.deque()
        self.stage_params: tuple[str, ...] = ()
        self.done_mbs: set[int] = set()
        self.started_step = False
        self.metrics: dict[str, float] = {"samples": 0, "updates": 0, "loss": float("nan"), "epoch": 0,
                                          "plan": -1, "stage": -1, "aborted_micro_batches": 0}
        self.busy_s = 0.0
        self.push_s = 0.0  # awaiting the PS push's replies (the per-step sync)
        self.idle_s = 0.0  # waiting for an event (activations, gradients) with nothing to do
        self.t0 = time.monotonic()
        self.plan_t0, self.plan_samples, self.plan_busy = self.t0, 0, 0.0
        self.plan_push, self.plan_idle = 0.0, 0.0
        self._stop_waiter: asyncio.Future | None = None  # one task for every race against `stopping`
        # Resolved when a plan newer than the one running arrives (a send to a neighbour gives way to it).
        self._new_plan: asyncio.Future | None = None
        self.newest_plan = -1
        self.init_shard_view()  # the PS shards as the scheduler last said (hmp.nodes.shard_follower)
        self.push_seq = time.time_ns() // 1000  # new to every shard after a restart of this worker
        self.push_retries = 0

    def handlers(self):
        return {**super().handlers(), Kind.STAGE_ASSIGN: self.on_stage_assign,
                Kind.ACTIVATIONS: self.on_data, Kind.GRADIENTS: self.on_data, Kind.SHARDS: self.on_shards}

    def status(self) -> dict[str, Any]:
        return {**super().status(), **self.metrics}

    async def on_stage_assign(self, msg: StageAssign, peer: bytes) -> Message:
        self.events.put_nowait(msg)
        if msg.plan > self.newest_plan:
            self.newest_plan = msg.plan
            if self._new_plan is not None and not self._new_plan.done():
                self._new_plan.set_result(msg.plan)
        return Ack(detail=f"plan {msg.plan}")

    async def on_data(self, msg: Message, peer: bytes) -> None:
        """Activations or gradients (one-way: no reply), queued for the engine; waits while the queue is full."""
        while self.events.qsize() >= self.events_bound:
            self._room.clear()
            await self._room.wait()
        self.events.put_nowait(msg)

    def _take(self) -> Message | None:
        ev = self.events.get_nowait()
        self._room.set()
        return ev

    # ---------------------------------------------------------------- main
    async def main(self) -> None:
        # Only stage 0 reads examples (the labels travel with the activations to the last stage), and the stages
        # change with each plan: the training split is loaded when this worker is first assigned stage 0
        # (load_train()). The test set (the last stage's evaluation, the warm-up's rows) is loaded by every worker.
        self.data = await self.in_thread(job.dataset, self.cfg, "test")
        self.log.info("data_loaded", part="test", train_rows=0, test_rows=len(self.data.y_test))
        self.sharded = await self.in_thread(job.sharded_model, self.cfg)

        def warm_up() -> None:
            # One untimed pass before joining: first calls initialise kernels and autograd (slow on a busy machine).
            if len(self.data.y_test):
                self.sharded.model(self.data.x_test[:2]).sum().backward()
                self.sharded.flat.zero_grad()

        await self.in_thread(warm_up)
        welcome = await self.join()
        if welcome is None:
            return
        shards = [tuple(s) for s in welcome.info.shards]
        self.learn_welcome_shards(welcome.info)
        self.ps = StagePSClient(self.sharded, shards, name=self.id, cfg=self.cfg,
                                timeout_s=self.cfg.limits.request_timeout_s)
        await self.ps.connect()
        self.order = ExampleOrder(self.data.n_train, self.cfg.train.batch_size,
                                  self.cfg.placement.micro_batches, self.cfg.data.seed)
        self.start_heartbeat()
        # A report loop that dies (an evaluation that fails) fails the node at once (Node.spawn).
        reports = self.spawn(self.report_loop(), name="reports")
        try:
            await self.engine()
        except Stopped:
            self.log.info("engine_stopped", step=self.step)
        except Exception as exc:
            self.failed = f"{exc.__class__.__name__}: {exc}"
            raise
        finally:
            try:
                # The last update lands before the worker leaves; stopped, it is given a moment only.
                await self.or_stop(self.settle_push(), grace_s=LAST_PUSH_GRACE_S)
            except Stopped:
                self.abandon_pushes()
            except Exception as exc:
                self.log.warning("last_push_failed", error=str(exc))
            reports.cancel()
            await asyncio.wait({reports})
            if not self.failed:
                await self.send_report(done=True)
            # Stopped (SIGTERM, the scheduler's stop): a frozen shard is not waited for long.
            await self.ps.leave(self.failed or "done", timeout_s=1.0 if self.stopping.is_set() else 5.0)
            await self.ps.close()
            if self.eval_ps is not None:
                await self.eval_ps.close()
            for c in self.peers.values():
                await c.close()
            await self.leave(f"failed: {self.failed}" if self.failed else "done")
            if self._stop_waiter is not None:
                self._stop_waiter.cancel()

    # ---------------------------------------------------------------- waits that give way
    async def or_stop(self, aw: Any, grace_s: float = 0.0) -> Any:
        """``await aw`` (a coroutine or future) and return its result, unless the node is told to stop
        (``stopping``: SIGTERM, the scheduler's shutdown, a failure) first and ``aw`` does not finish
        within ``grace_s`` more: then it is cancelled (and waited for) and this raises Stopped."""
        task = asyncio.ensure_future(aw)
        if self._stop_waiter is None or self._stop_waiter.done():
            self._stop_waiter = asyncio.ensure_future(self.stopping.wait())
        try:
            if not task.done():
                await asyncio.wait({task, self._stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and grace_s > 0:
                await asyncio.wait({task}, timeout=grace_s)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Stopped()

    async def with_shards(self, request: Callable[[], Any], what: str, client: PSClient | None = None) -> Any:
        """:meth:`~hmp.nodes.shard_follower.ShardFollower.follow_shards` for ``client`` (default the stage's);
        the caller makes it give way to a stop."""
        return await self.follow_shards(self.ps if client is None else client, request, what)

    def abandon_pushes(self) -> None:
        """Stopped with pushes unanswered (a frozen or dead shard): give them up."""
        if self.pushes:
            self.log.info("push_abandoned", pushes=len(self.pushes), reason="stopping")
        for _, task in self.pushes:
            task.cancel()
        self.pushes.clear()

    async def engine(self) -> None:
        stop = asyncio.create_task(self._stop_signal())
        try:
            while not (self.stopping.is_set() or self.stop_requested):
                if self.should_drive():
                    await self.drive_step()
                    await self.maybe_finish_step()
                    await asyncio.sleep(0)  # let the reader hand over what arrived meanwhile
                    if self.events.empty():
                        continue
                if self.events.empty():
                    t0 = time.perf_counter()
                    ev = await self.events.get()
                    self._room.set()
                    dt = time.perf_counter() - t0
                    self.idle_s += dt
                    self.plan_idle += dt
                else:
                    ev = self._take()
                if ev is None:
                    break
                await self.handle(ev)
                await self.maybe_finish_step()
        finally:
            stop.cancel()

    async def _stop_signal(self) -> None:
        await self.stopping.wait()
        self.events.put_nowait(None)

    # ---------------------------------------------------------------- plan changes
    async def load_train(self) -> None:
        """The training split (stage 0's examples), loaded once, the first time this worker is assigned stage 0;
        scaled by the statistics the test set was scaled by. A stop ends the wait (Stopped)."""
        if self.train_data is None:
            load = functools.partial(job.dataset, self.cfg, "train", stats=self.data.stats)
            self.train_data = await self.or_stop(self.in_thread(load))
            self.log.info("data_loaded", part="train", train_rows=len(self.train_data.y_train), test_rows=0)

    async def reconfigure(self, a: StageAssign) -> None:
        if self.compute is not None:
            self.metrics["aborted_micro_batches"] += self.compute.abort()
        await self.or_stop(self.settle_push())  # the old stage's last updates land; the buffers are free again
        if a.stage == 0:
            await self.load_train()  # before the plan's clock starts: its throughput is the pipeline's, not the load's
        self.ps.reset_buffers()
        self.assign, self.compute = a, None
        # Keep what arrived for this plan before its assignment did (a neighbour that got its own
        # assignment first may already have sent step 0's activations: dropping them would stall
        # the pipeline for good) and for newer plans; handle() then drops steps before start_step.
        self.held = [m for m in self.held if getattr(m, "plan", -1) >= a.plan]
        self.step = a.start_step
        self.started_step = False
        self.metrics.update(plan=a.plan, stage=a.stage)
        self.plan_t0, self.plan_samples, self.plan_busy = time.monotonic(), 0, 0.0
        self.plan_push, self.plan_idle = 0.0, 0.0
        if a.stage < 0:
            self.ps.restrict(())
            self.log.info("standby", plan=a.plan)
            return
        loss_fn = task_of(self.cfg).loss_fn  # a whole-model step is refused at load (hmp.train.task.check_config)
        assert loss_fn is not None
        self.compute = StageCompute(self.sharded.model, a.start, a.stop, loss_fn)
        owner = param_layers(self.sharded.model)
        self.stage_params = tuple(n for n, i in owner.items() if a.start <= i < a.stop)
        self.ps.restrict(stage_chunk_keys(self.sharded.layout, a.start, a.stop, owner))
        await self.or_stop(self.with_shards(self.ps.pull, "pull"))  # this stage's parameters, from the shards
        self.step_mbs = micro_batches_of(a.index, a.width, a.micro_batches)
        self.done_mbs = set()
        self.log.info("stage_assigned", plan=a.plan, stage=a.stage, layers=f"{a.start}-{a.stop - 1}",
                      index=a.index, micro_batches=self.step_mbs, start_step=a.start_step, keys=len(self.ps.keys))
        for c in (*a.prev, *a.next):
            if c not in self.peers:
                self.peers[c] = self.client(c)
                await self.peers[c].connect()
        held, self.held = self.held, []
        for m in held:
            self.events.put_nowait(m)

    # ---------------------------------------------------------------- events
    async def handle(self, ev: Message) -> None:
        if isinstance(ev, StageAssign):
            if self.assign is None or ev.plan > self.assign.plan:
                await self.reconfigure(ev)
            return
        assert isinstance(ev, (Activations, Gradients))
        a = self.assign
        if a is None or ev.plan > a.plan or (ev.plan == a.plan and ev.step > self.step):
            self.held.append(ev)  # for a plan or step this worker has not reached yet
            return
        if ev.plan < a.plan or ev.step < self.step or self.compute is None:
            return  # from an aborted plan or step
        if isinstance(ev, Activations):
            await self.forward(ev.micro_batch, ev.values, ev.labels)
        else:
            await self.backward(ev.micro_batch, ev.grads)

    def should_drive(self) -> bool:
        """Stage 0 starts the next step once the previous one is pushed."""
        a = self.assign
        return (a is not None and a.stage == 0 and self.compute is not None and not self.started_step
                and self.step < a.steps)

    async def drive_step(self) -> None:
        """Fill: send every micro-batch this worker handles forward, back to back."""
        self.started_step = True
        x, y = self.train_data.x_train, self.train_data.y_train
        self.metrics["epoch"] = self.order.epoch_of(self.step)
        for m in self.step_mbs:
            ids = self.order.ids(self.step, m)
            # x[ids] gathers the micro-batch's examples: the one copy on this path, needed because a
            # shuffled micro-batch is not a contiguous slice; every later hop is zero-copy.
            await self.forward(m, x[ids], y[ids])

    async def forward(self, m: int, x: torch.Tensor, labels: torch.Tensor) -> None:
        a, compute = self.assign, self.compute
        assert a is not None and compute is not None
        self.started_step = True
        if not compute.saved:
            self.write_done_pushes()  # no graph holds the parameters: take the new values that are here
        if compute.last:
            loss, grad, dt = await self.in_thread(self._forward_backward, compute, m, x, labels)
            self.busy(dt)
            self.loss(loss)
            self.done_mbs.add(m)
            if grad is not None:
                await self.send_to(a.prev, Gradients(sender=self.id, plan=a.plan, step=self.step, micro_batch=m,
                                                     grads=grad))
            return
        out, dt = await self.in_thread(self._timed, compute.forward, m, x, labels)
        self.busy(dt)
        await self.send_to(a.next, Activations(sender=self.id, plan=a.plan, step=self.step, micro_batch=m,
                                               values=out, labels=labels))

    async def backward(self, m: int, grad: torch.Tensor) -> None:
        a, compute = self.assign, self.compute
        assert a is not None and compute is not None
        if m not in compute.saved:
            return  # not ours, or already done
        grad_in, dt = await self.in_thread(self._timed, compute.backward, m, grad)
        self.busy(dt)
        self.done_mbs.add(m)
        if grad_in is not None:
            await self.send_to(a.prev, Gradients(sender=self.id, plan=a.plan, step=self.step, micro_batch=m,
                                                 grads=grad_in))

    @staticmethod
    def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """``fn(*args)`` and the seconds it took (on the compute thread)."""
        t0 = time.perf_counter()
        return fn(*args), time.perf_counter() - t0

    @staticmethod
    def _forward_backward(compute: StageCompute, m: int, x: torch.Tensor,
                          labels: torch.Tensor) -> tuple[float, torch.Tensor | None, float]:
        """The last stage's forward, loss and backward (on the compute thread): (loss, input gradient, seconds)."""
        t0 = time.perf_counter()
        loss = float(compute.forward(m, x, labels))
        grad = compute.backward(m)
        return loss, grad, time.perf_counter() - t0

    async def send_to(self, addresses: tuple[str, ...], msg: Activations | Gradients) -> None:
        """One-way, zero-copy: the tensor is not touched again (it is freed once sent). This does not
        wait for the peer: the frames are handed to libzmq at once (the await only yields when the
        peer's high-water mark is reached: a neighbour that stopped reading). Such a wait gives way
        to a stop (Stopped) and to a newer plan (the message is dropped: the new plan aborts this step)."""
        peer = self.peers[addresses[worker_for(msg.micro_batch, len(addresses))]]
        task = start_eager(peer.send(msg), asyncio.get_running_loop())
        if task is None:
            return
        if self._new_plan is None or self._new_plan.done():
            self._new_plan = asyncio.get_running_loop().create_future()
        if self.assign is not None and self.newest_plan > self.assign.plan:
            self._new_plan.set_result(self.newest_plan)
        try:
            await self.or_stop(self._first(task, self._new_plan))
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled():
            task.result()
            return
        self.log.info("send_abandoned", peer=peer.address, reason="a new plan", plan=self.newest_plan)

    @staticmethod
    async def _first(task: asyncio.Future, other: asyncio.Future) -> None:
        """Returns once ``task`` is done or ``other`` resolved (neither is cancelled)."""
        await asyncio.wait({task, other}, return_when=asyncio.FIRST_COMPLETED)

    async def maybe_finish_step(self) -> None:
        """Drain done: push this stage's gradients (the mean over its micro-batches) without waiting
        for the reply, switch to the other gradient buffer, move to the next step and replay what
        arrived early for it (which may finish it too)."""
        while self.assign is not None and self.compute is not None and self.step_mbs \
                and len(self.done_mbs) >= len(self.step_mbs):
            n = len(self.step_mbs)
            samples = n * self.order.micro_batch_size
            keys = self.ps.keys
            if keys:
                # No graph is saved now: new values that arrived can be written.
                self.write_done_pushes()
                grads = self.ps.grads
                with torch.no_grad():
                    for k in keys:
                        grads[k].div_(n)  # n per-micro-batch mean gradients were summed
                self.push_seq += 1
                self.pushes.append((self.ps.buffer, self.start_push(self.ps.buffer, samples, self.push_seq)))
                # The next step accumulates into the other buffer once its push (the previous
                # step's) has been answered: the reply implies the shards received its frames.
                other = 1 - self.ps.buffer
                await self.wait_pushes(lambda b: b == other)
                self.write_done_pushes()
                self.ps.use_buffer(other, self.stage_params)
                if self.cfg.placement.overlap_push:
                    await asyncio.sleep(0)  # let the requests go out now, not after the next step's fill
                else:
                    await self.wait_pushes()  # the next step runs on the values this push produces
                    self.write_done_pushes()
            self.metrics.update(samples=self.metrics["samples"] + samples, updates=self.metrics["updates"] + 1)
            self.plan_samples += samples
            self.step += 1
            self.done_mbs = set()
            self.started_step = False
            held, self.held = self.held, []
            for m in held:
                await self.handle(m)

    def start_push(self, buffer: int, samples: int, seq: int) -> asyncio.Future[list[Message]]:
        """Push gradient buffer ``buffer`` (its replies, once answered); sent again after a shard change,
        with the same ``seq``, so that a shard applies it once."""
        return asyncio.ensure_future(self.with_shards(
            lambda: asyncio.gather(*self.ps.push_buffer(buffer, samples, seq)), "push"))

    async def wait_pushes(self, which: Callable[[int], bool] = lambda b: True) -> None:
        """Wait for the replies of the pushes in flight from the buffers ``which`` selects; Stopped
        when the node is told to stop first (the pushes stay in flight: see main())."""
        pending = [t for b, t in self.pushes if which(b) and not t.done()]
        if not pending:
            return
        t0 = time.perf_counter()
        try:
            await self.or_stop(asyncio.wait(pending))
        finally:
            dt = time.perf_counter() - t0
            self.push_s += dt
            self.plan_push += dt

    def write_done_pushes(self) -> None:
        """Write the new values of the answered pushes, oldest first, up to the first unanswered one
        (call only with no saved graph: the writes are in place). A failed push raises here."""
        while self.pushes and self.pushes[0][1].done():
            _, task = self.pushes.popleft()
            for r in task.result():
                self.ps.write(r)

    async def settle_push(self) -> None:
        """Wait for every push in flight and write its values (call only with no saved graph)."""
        pending = [t for _, t in self.pushes if not t.done()]
        if pending:
            t0 = time.perf_counter()
            try:
                await asyncio.wait(pending)  # not wait_pushes: the caller decides how this gives way to a stop
            finally:
                dt = time.perf_counter() - t0
                self.push_s += dt
                self.plan_push += dt
        self.write_done_pushes()

    # ---------------------------------------------------------------- metrics
    def busy(self, dt: float) -> None:
        self.busy_s += dt
        self.plan_busy += dt

    def loss(self, value: float) -> None:
        prev = self.metrics["loss"]
        self.metrics["loss"] = value if prev != prev else 0.95 * prev + 0.05 * value

    def current_metrics(self) -> dict[str, float]:
        now = time.monotonic()
        plan_wall = max(1e-9, now - self.plan_t0)
        return {**self.metrics, "step": float(self.step), "busy_s": self.busy_s, "push_s": self.push_s,
                "idle_s": self.idle_s,
                "samples_per_s": self.metrics["samples"] / max(1e-9, now - self.t0),
                "busy_fraction": self.busy_s / max(1e-9, now - self.t0),
                # This plan only: what the stage moved (pipeline rate) and what its compute alone could.
                "stage_samples_per_s": self.plan_samples / plan_wall,
                "stage_capacity": self.plan_samples / self.plan_busy if self.plan_busy else 0.0,
                # Where this plan's wall time went: compute, awaiting the PS push, waiting for messages.
                "stage_busy_fraction": self.plan_busy / plan_wall, "stage_push_fraction": self.plan_push / plan_wall,
                "stage_idle_fraction": self.plan_idle / plan_wall,
                "plan_seconds": plan_wall, "bytes_out": float(self.ps.bytes_out), "bytes_in": float(self.ps.bytes_in),
                "pipeline_done": float(self.assign is not None and self.assign.stage == 0
                                       and self.step >= self.assign.steps)}

    async def report_loop(self) -> None:
        t = self.cfg.train
        next_eval = time.monotonic() + t.eval_every_s
        while not (self.stopping.is_set() or self.stop_requested):
            await asyncio.sleep(t.report_interval_s)
            a = self.assign
            if a is not None and a.stage == a.stages - 1 and a.index == 0 and time.monotonic() >= next_eval:
                self.metrics.update(await self.evaluate())
                next_eval = time.monotonic() + t.eval_every_s
            await self.send_report()

    async def evaluate(self) -> dict[str, float]:
        """The task's test metrics of the whole model as the shards hold it now (a separate replica)."""
        if self.eval_ps is None:
            shards = self.ps.shard_addresses
            model = await asyncio.to_thread(job.sharded_model, self.cfg)
            self.eval_ps = PSClient(model, shards, name=f"{self.id}-eval", cfg=self.cfg,
                                    timeout_s=self.cfg.limits.request_timeout_s)
            await self.eval_ps.connect()
        await self.with_shards(self.eval_ps.pull, "pull", self.eval_ps)
        return await asyncio.to_thread(task_of(self.cfg).evaluate, self.eval_ps.model, self.data.x_test, self.data.y_test)

    async def send_report(self, done: bool = False) -> None:
        assert self.scheduler is not None
        if self.scheduler_lost:
            return
        try:
            # Stopping (SIGTERM, a failure): a frozen or dead scheduler is not waited for long.
            reply = await self.scheduler.request(Report(metrics=self.current_metrics(), done=done),
                                                 timeout_s=2.0 if self.stopping.is_set() else 10.0)
        except HmpError as exc:
            self.log.warning("report_failed", error=str(exc))
            return
        if isinstance(reply, Assign) and reply.stop and not self.stop_requested:
            self.stop_requested = True
            self.events.put_nowait(None)
