"""Your loop, our gradient exchange: :class:`Worker` (asyncio) and :class:`SyncWorker` (plain code) let a
program of the user's train as one worker of a job (docs/own_loop.md).

The user writes the loop (forward, loss, ``backward()``); ``step()`` exchanges the gradients (a push to the
PS shards, or a ring all-reduce) and leaves the new parameter values in the model. The worker node itself
(:mod:`hmp.nodes.user_worker`) runs on an event loop in a thread of its own, so heartbeats and progress
reports go on while the user's code computes, whether that code is async or not; every wait on it is
bounded, and closing ends the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from numbers import Real
from typing import Any

import torch
import uvloop

from hmp import job
from hmp.config import Config, Role
from hmp.errors import ConfigError, HmpError
from hmp.nodes.user_worker import STOPPED, UserPSWorkerNode, UserRingWorkerNode, node_class

#: Seconds beyond ``[job] join_timeout_s`` that :meth:`SyncWorker.start` waits for the worker to be admitted
#: (building the model, then pulling the parameters or forming the ring).
START_SLACK_S = 30.0


class _Host:
    """One user-loop node on an event loop of its own thread; calls from other threads are submitted to it."""

    def __init__(self, cfg: Config, node_id: str, evaluate: bool) -> None:
        self.cfg, self.node_id, self.evaluate = cfg, node_id, evaluate
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.node: UserPSWorkerNode | UserRingWorkerNode | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._open = False  # calls are taken (the loop runs or is about to)
        self.log_path = cfg.report_dir / "logs" / f"{node_id}.log"
        self.thread = threading.Thread(target=self._run, name=f"hmp-{node_id}", daemon=True)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.thread.start()

    def _run(self) -> None:
        loop = uvloop.new_event_loop()  # as the daemons run
        asyncio.set_event_loop(loop)
        self.loop = loop
        try:
            with open(self.log_path, "a") as log:
                try:
                    node = node_class(self.cfg)(self.cfg, self.node_id, ready=self.ready, evaluate=self.evaluate,
                                                log=log)
                    self.node = node
                    with self._lock:
                        self._open = True
                    self.exit_code = loop.run_until_complete(node.run())
                except BaseException as exc:  # noqa: BLE001 - handed to the user's thread (start(), close())
                    self.error = exc
                finally:
                    with self._lock:
                        self._open = False
                    loop.run_until_complete(self._drain())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            if not self.ready.done():
                why = (self.node.failed if self.node is not None else None) or self.error or "it stopped"
                self.ready.set_exception(self.error if isinstance(self.error, HmpError) else
                                         HmpError(f"worker {self.node_id} was not admitted to the job: {why}"))

    async def _drain(self) -> None:
        """Calls submitted as the node ended: each is answered (STOPPED), none left hanging."""
        await asyncio.sleep(0)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future | None:
        """``fn(*args)`` (a coroutine function of the node) on the node's loop; None when the node has ended."""
        with self._lock:
            if not self._open or self.node is None or self.loop is None:
                return None
            return asyncio.run_coroutine_threadsafe(self.node.user_call(fn(*args)), self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` (plain, quick) on the node's loop, not waited for; nothing once the node has ended."""
        with self._lock:
            if self._open and self.loop is not None:
                self.loop.call_soon_threadsafe(fn, *args)


def _resolve_config(config: Config | str | os.PathLike, token: str | None) -> Config:
    cfg = config if isinstance(config, Config) else job.with_env(job.load(config))
    if token is not None:
        cfg = cfg.replace(job=dataclasses.replace(cfg.job, token=token))
    return cfg


def _loss_value(loss: Any) -> float:
    """The loss as a float (a tensor's ``item()``: on the user's thread, after their backward)."""
    if loss is None:
        return float("nan")
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"step(loss=...): a scalar loss, got a tensor of shape {list(loss.shape)}")
        return float(loss.detach().item())
    if isinstance(loss, Real) and not isinstance(loss, bool):
        return float(loss)
    raise TypeError(f"step(loss=...): a number or a scalar tensor, got {type(loss).__name__}")


class _Handle:
    """What :class:`Worker` and :class:`SyncWorker` share: the config, the node's thread, the model."""

    def __init__(self, config: Config | str | os.PathLike, node_id: str, *, token: str | None = None,
                 evaluate: bool = True, timeout_s: float | None = None) -> None:
        cfg = _resolve_config(config, token)
        node = cfg.node(node_id)  # a ConfigError naming the ids there are
        if node.role != Role.USER_WORKER:
            raise ConfigError(cfg.path, f"nodes[id={node_id}].role",
                              f"\"user_worker\" for a worker whose loop is yours (hmp.Worker; the launcher starts "
                              f"a {node.role} itself), got {str(node.role)!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: a number of seconds > 0, got {timeout_s!r}")
        self.cfg = cfg
        self.id = node_id
        #: the longest a step, a batch or closing may take before the worker gives up (seconds): a sync round
        #: or a ring step waits on the other workers at most about two request timeouts
        self.timeout_s = timeout_s or (2 * max(cfg.limits.request_timeout_s, cfg.collective.timeout_s)
                                       + 3 * cfg.job.heartbeat_interval_s)
        self._host = _Host(cfg, node_id, evaluate)
        self._started = False
        self._closed = False
        self._last_batch = 0

    # ---------------------------------------------------------------- what the job gave this worker
    @property
    def _node(self) -> UserPSWorkerNode | UserRingWorkerNode:
        node = self._host.node
        if not self._started or node is None:
            raise HmpError(f"worker {self.id} has not joined yet: start() it (or enter it with async with / with)")
        return node

    @property
    def model(self) -> torch.nn.Module:
        """The job's model (``[model]``), its parameters the job's current values. Run forward and backward on
        it; do not step an optimizer of your own: ``step()`` applies the job's."""
        return self._node.sharded.model

    @property
    def device(self) -> torch.device:
        """Where the model lives (the ``[[nodes]] device`` of this worker; default the CPU)."""
        return self._node.device

    @property
    def index(self) -> int:
        """This worker's index: its data share (PS jobs) or its rank in the ring (allreduce jobs); worker 0
        evaluates."""
        return self._node.index

    @property
    def workers(self) -> int:
        """How many workers share the data (the ring's members)."""
        return self._node.count

    @property
    def batch_size(self) -> int:
        """The batch size the scheduler gives this worker now (``[train] policy`` may change it)."""
        return self._node.batch_size

    @property
    def steps(self) -> int:
        """Steps this worker has completed (its updates)."""
        return self._node.step

    @property
    def failed(self) -> str | None:
        """Why the worker failed (lost the scheduler, refused by a shard, ...), or None."""
        node = self._host.node
        return node.failed if node is not None else None

    @property
    def running(self) -> bool:
        """Whether the worker's node still runs (on its thread): False before start() and once it has left."""
        return self._host.thread.is_alive()

    @property
    def log_path(self) -> str:
        """This worker's structured log (``<report_dir>/logs/<id>.log``, as each daemon's)."""
        return str(self._host.log_path)

    def zero_grad(self) -> None:
        """Zero the gradients in place (``step()`` does so after using them; call this to drop a backward's
        gradients without a step). The model's own ``zero_grad()`` works too, at the cost of a copy."""
        self._node.sharded.flat.zero_grad()

    def report(self, **metrics: float) -> None:
        """Numbers for the next progress report, e.g. ``test_accuracy`` and ``test_loss`` of your own
        evaluation (the scheduler's stop rules read them, the run report keeps them)."""
        bad = {k: v for k, v in metrics.items() if not isinstance(v, Real) or isinstance(v, bool)}
        if bad:
            raise TypeError(f"report(): numbers only, got {', '.join(f'{k}={v!r}' for k, v in bad.items())}")
        self._host.call_soon(self._node.user_report, {k: float(v) for k, v in metrics.items()})

    # ---------------------------------------------------------------- plumbing
    def _step_args(self, loss: Any, samples: int | None) -> tuple[float, int]:
        n = (self._last_batch or self.batch_size) if samples is None else samples
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"step(samples=...): the batch's number of examples, an int >= 0, got {samples!r}")
        return _loss_value(loss), n

    def _answer(self, fut: concurrent.futures.Future | None) -> Any:
        """A finished call's answer (STOPPED for a call the ended node did not answer); a failed worker's
        error is raised."""
        if fut is None or fut.cancelled():
            value = STOPPED
        else:
            value = fut.result()
        if (value is STOPPED or value is False) and self.failed and not self._closed:
            raise HmpError(f"worker {self.id} failed: {self.failed}")
        return value

    def _timed_out(self, what: str, fut: concurrent.futures.Future) -> HmpError:
        fut.cancel()
        self._host.call_soon(self._node.fail, f"{what} got no answer within {self.timeout_s:g} s")
        return HmpError(f"worker {self.id}: {what} got no answer within {self.timeout_s:g} s (timeout_s); the "
                        f"worker leaves the job")

    def _start_thread(self) -> None:
        if self._started or self._closed:
            raise HmpError(f"worker {self.id} was started already" if self._started else
                           f"worker {self.id} is closed")
        self._host.start()

    def _joined(self, exc: BaseException | None) -> None:
        if exc is not None:
            raise exc
        self._started = True

    def _finish_close(self, failed: str | None) -> None:
        """Blocking: tell the node the user is done (or failed) and wait, bounded, for its thread to end."""
        host = self._host
        if not host.thread.is_alive():
            return
        host.submit(lambda: self._node_close(failed))
        host.thread.join(self.timeout_s)
        if host.thread.is_alive():  # its goodbyes are bounded; this is the backstop
            host.call_soon(lambda: host.node.stopping.set() if host.node is not None else None)
            host.thread.join(10.0)

    async def _node_close(self, failed: str | None) -> None:
        node = self._host.node
        if node is not None:
            await node.user_close(failed)


class SyncWorker(_Handle):
    """A worker of a running job whose loop is plain (not async) code (docs/own_loop.md)::

        with hmp.SyncWorker("job.toml", "me") as worker:
            for x, y in worker.batches():
                loss = F.cross_entropy(worker.model(x), y)
                loss.backward()
                if not worker.step(loss):
                    break

    ``config``: the job's config file (its token from ``$HMP_JOB_TOKEN`` or ``[job] token``) or a
    :class:`~hmp.config.Config` such as a :class:`~hmp.cluster.LocalCluster`'s ``cfg`` (its token included);
    ``node_id``: a ``[[nodes]]`` entry with ``role = "user_worker"``. ``evaluate``: worker 0 evaluates the
    model on the job's test set every ``[train] eval_every_s``, inside ``step()``, as a built-in worker 0
    does (False: only what you give :meth:`report`). ``timeout_s``: the longest any call waits."""

    def start(self) -> SyncWorker:
        """Join the job; returns once admitted, with the job's parameters in :attr:`model`."""
        self._start_thread()
        wait_s = self.cfg.job.join_timeout_s + START_SLACK_S
        done, _ = concurrent.futures.wait({self._host.ready}, timeout=wait_s)
        if not done:
            self._finish_close("not admitted in time")
            raise HmpError(f"worker {self.id} was not admitted within {wait_s:g} s (is the job's scheduler running, "
                           f"with this token?)")
        self._joined(self._host.ready.exception())
        return self

    def batches(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """``(x, y)`` batches of this worker's share of ``[data]`` for the job's epochs (or work units the
        scheduler hands out), on :attr:`device`; it ends when the epochs are used up or the job stops. One
        ``step()`` per batch. Your own data works as well: then give ``step()`` the batch's ``samples``."""
        while True:
            batch = self._wait("the next batch", self._host.submit(self._node.next_batch))
            if batch is STOPPED:
                return
            self._last_batch = len(batch[1])
            yield batch

    def step(self, loss: Any = None, *, samples: int | None = None) -> bool:
        """After ``loss.backward()``: send the gradients (a push to the shards, or the ring's all-reduce) and
        put the new parameter values into :attr:`model`; the gradients are zeroed. ``loss`` (a number or a
        scalar tensor) goes into the progress reports; ``samples``: the batch's examples (default: the last
        batch's from :meth:`batches`). False when the job is stopping (the gradients may not have been used):
        end the loop. A failed worker raises :class:`~hmp.errors.HmpError`."""
        lv, n = self._step_args(loss, samples)
        return bool(self._wait("step()", self._host.submit(self._node.user_step, lv, n)))

    def _wait(self, what: str, fut: concurrent.futures.Future | None) -> Any:
        if fut is not None:
            done, _ = concurrent.futures.wait({fut}, timeout=self.timeout_s)
            if not done:
                raise self._timed_out(what, fut)
        return self._answer(fut)

    def close(self, failed: str | None = None) -> None:
        """Leave the job: the final report (worker 0: after a last evaluation), goodbyes, the thread ended.
        ``failed``: leave as failed, with that reason (the job drops the worker, as it drops a crashed one).
        Idempotent; bounded by ``timeout_s``."""
        if self._closed:
            return
        self._closed = True
        self._finish_close(failed)

    def __enter__(self) -> SyncWorker:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(None if exc is None else f"{exc_type.__name__}: {exc}")


class Worker(_Handle):
    """A worker of a running job whose loop is the user's asyncio code (docs/own_loop.md)::

        async with hmp.LocalCluster("job.toml") as cluster:   # starts every node but the user workers
            async with hmp.Worker(cluster.cfg, "me") as worker:
                async for x, y in worker.batches():
                    loss = F.cross_entropy(worker.model(x), y)
                    loss.backward()
                    if not await worker.step(loss):
                        break
            report = await cluster.train()

    The arguments and methods are :class:`SyncWorker`'s, awaited. The worker's node runs on a thread of its
    own, so a long forward or backward on this event loop does not hold up its heartbeats."""

    async def start(self) -> Worker:
        """Join the job; returns once admitted, with the job's parameters in :attr:`model`."""
        self._start_thread()
        wait_s = self.cfg.job.join_timeout_s + START_SLACK_S
        ready = asyncio.wrap_future(self._host.ready)
        done, _ = await asyncio.wait({ready}, timeout=wait_s)
        if not done:
            await asyncio.to_thread(self._finish_close, "not admitted in time")
            raise HmpError(f"worker {self.id} was not admitted within {wait_s:g} s (is the job's scheduler running, "
                           f"with this token?)")
        self._joined(ready.exception())
        return self

    async def batches(self) -> AsyncIterator[tuple[Any, torch.Tensor]]:
        """:meth:`SyncWorker.batches`, asynchronously."""
        while True:
            batch = await self._wait("the next batch", self._host.submit(self._node.next_batch))
            if batch is STOPPED:
                return
            self._last_batch = len(batch[1])
            yield batch

    async def step(self, loss: Any = None, *, samples: int | None = None) -> bool:
        """:meth:`SyncWorker.step`, awaited."""
        lv, n = self._step_args(loss, samples)
        return bool(await self._wait("step()", self._host.submit(self._node.user_step, lv, n)))

    async def _wait(self, what: str, fut: concurrent.futures.Future | None) -> Any:
        if fut is not None:
            wrapped = asyncio.wrap_future(fut)
            try:
                done, _ = await asyncio.wait({wrapped}, timeout=self.timeout_s)
            except asyncio.CancelledError:
                fut.cancel()  # the caller gave up: so does the node's side of the call
                raise
            if not done:
                raise self._timed_out(what, fut)
        return self._answer(fut)

    async def close(self, failed: str | None = None) -> None:
        """:meth:`SyncWorker.close`, awaited."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._finish_close, failed)

    async def __aenter__(self) -> Worker:
        return await self.start()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.close(None if exc is None else f"{exc_type.__name__}: {exc}")


__all__ = ["START_SLACK_S", "SyncWorker", "Worker"]
