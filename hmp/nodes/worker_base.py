"""What the PS worker (:mod:`hmp.nodes.worker`) and the allreduce worker (:mod:`hmp.nodes.ring_worker`)
share: the device and batch size, the progress counters and their report to the scheduler, the clock
of reports and evaluations, and racing a request against a stop. Each trains, evaluates and says
what else its reports carry in its own module."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from hmp.config import Config, Role
from hmp.errors import HmpError
from hmp.messages import Assign, Report
from hmp.nodes.base import Node


def resolve_device(role: str, requested: str, node_id: str) -> torch.device:
    """The worker's device; a GPU worker without CUDA fails unless its config says device = "cpu"."""
    name = requested or ("cuda" if role == Role.GPU_WORKER else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise HmpError(f"{role} {node_id}: CUDA is not available on this machine; set device = \"cpu\" in its "
                       f"[[nodes]] entry to run it on the CPU")
    return torch.device(name)


class WorkerBase(Node):
    """A training worker: subclasses write ``main()`` and build their reports on :meth:`progress_metrics`."""

    def __init__(self, cfg: Config, node_id: str) -> None:
        super().__init__(cfg, node_id)
        self.device = resolve_device(self.node.role, self.node.device, node_id)
        if self.node.role == Role.GPU_WORKER and self.device.type == "cpu":
            self.log.info("gpu_worker_on_cpu", reason="config says device = \"cpu\"")
        self.batch_size = self.node.batch_size or cfg.train.batch_size
        self.stop_requested = False
        self.metrics: dict[str, float] = {"samples": 0, "updates": 0, "loss": float("nan"), "epoch": 0}
        self.busy_s = 0.0
        self.t_train0 = 0.0
        self.samples_before = 0  # --resume: the samples of the previous parts
        self._stop_waiter: asyncio.Future | None = None  # one task for every race against `stopping`

    def status(self) -> dict[str, Any]:
        return {**super().status(), **self.metrics, "batch_size": self.batch_size, "device": str(self.device)}

    async def unless_stopped(self, request: asyncio.Future) -> bool:
        """Wait for ``request`` (a task) unless the node stops first: True when it finished (its
        ``result()`` is then the caller's to read, raising what it raised); False when ``stopping``
        was set first, in which case it is cancelled (and waited for: the cancellation has reached
        it when this returns)."""
        if self._stop_waiter is None or self._stop_waiter.done():
            self._stop_waiter = asyncio.ensure_future(self.stopping.wait())
        if not request.done():
            await asyncio.wait({request, self._stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
        if request.done():
            return True
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        return False

    def start_clock(self, index: int) -> None:
        """Training starts now: schedule the first report and (worker or rank ``index`` 0) evaluation."""
        t = self.cfg.train
        self.t_train0 = time.monotonic()
        self.next_report = self.t_train0 + t.report_interval_s
        self.next_eval = self.t_train0 + t.eval_every_s if index == 0 else float("inf")

    def progress_metrics(self) -> dict[str, float]:
        """The counters and the rates since training started (a resumed part's rate is its own)."""
        wall = max(1e-9, time.monotonic() - self.t_train0)
        done_here = self.metrics["samples"] - self.samples_before
        return {**self.metrics, "samples_per_s": done_here / wall, "busy_fraction": self.busy_s / wall,
                "batch_size": float(self.batch_size), "busy_s": self.busy_s}

    async def send_report(self, metrics: dict[str, float], done: bool = False) -> Assign | None:
        """Report ``metrics`` (``done``: the final report); a progress report gives way to a stop, and
        the final one, sent while stopping, waits for a dead scheduler only briefly. Returns the
        scheduler's answer (None: none came), whose stop is taken here."""
        assert self.scheduler is not None
        timeout = 2.0 if self.stopping.is_set() else 10.0
        try:
            request = asyncio.ensure_future(self.scheduler.request(Report(metrics=metrics, done=done),
                                                                   timeout_s=timeout))
            if done:
                await asyncio.wait({request})
            elif not await self.unless_stopped(request):
                return None
            reply = request.result()
        except HmpError as exc:
            self.log.warning("report_failed", error=str(exc))
            return None
        if not isinstance(reply, Assign):
            return None
        if reply.stop:
            self.stop_requested = True
        return reply

    async def say_goodbye(self) -> None:
        """Leave the job (failed or done) and end the race against ``stopping``."""
        await self.leave(f"failed: {self.failed}" if self.failed else "done")
        if self._stop_waiter is not None:
            self._stop_waiter.cancel()
