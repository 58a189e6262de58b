"""What every daemon shares: its server, its link to the scheduler, heartbeats, graceful stop.

A node runs in one ``asyncio.TaskGroup``: the role's ``main()`` and, for every node but the
scheduler, the heartbeat loop. SIGTERM/SIGINT set ``stopping``; ``main()`` is expected to notice,
finish or refuse in-flight work, and return. The server then closes (in-flight handlers get a
grace period) and the process exits 0, or 1 if the node failed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import structlog

from hmp.config import Config, NodeConfig
from hmp.errors import HmpError, RemoteError, RequestTimeout
from hmp.messages import Ack, Heartbeat, Join, Kind, Leave, Message, Shutdown, Status, Welcome
from hmp.transport.codec import Limits
from hmp.transport.endpoint import Client, Handler, Server


class Node:
    """Base of the four daemons. Subclasses set ``role``, fill ``handlers()`` and write ``main()``."""

    role = "node"

    def __init__(self, cfg: Config, node_id: str) -> None:
        self.cfg = cfg
        self.node: NodeConfig = cfg.node(node_id)
        self.id = node_id
        self.limits = Limits.of(cfg.limits)
        self.log = structlog.get_logger("hmp").bind(role=self.node.role, node_id=node_id)
        self.stopping = asyncio.Event()
        self.failed: str | None = None
        self.server: Server | None = None
        self.scheduler: Client | None = None
        self.welcome: Welcome | None = None
        self.started = time.monotonic()
        self.step = 0

    # ---------------------------------------------------------------- overridables
    def handlers(self) -> dict[Kind, Handler]:
        return {Kind.STATUS: self.on_status, Kind.SHUTDOWN: self.on_shutdown}

    async def main(self) -> None:
        await self.stopping.wait()

    def status(self) -> dict[str, Any]:
        return {"role": self.node.role, "id": self.id, "uptime_s": time.monotonic() - self.started, "step": self.step}

    # ---------------------------------------------------------------- handlers
    async def on_status(self, msg: Message, peer: bytes) -> Message:
        return Status(state=self.status())

    async def on_shutdown(self, msg: Shutdown, peer: bytes) -> Message:
        self.log.info("shutdown_requested", by=msg.sender, reason=msg.reason)
        self.stopping.set()
        return Ack(detail="stopping")

    # ---------------------------------------------------------------- plumbing
    def client(self, address: str, name: str | None = None) -> Client:
        return Client(address, name=name or self.id, limits=self.limits, frame_bytes=self.cfg.limits.frame_bytes,
                      timeout_s=self.cfg.limits.request_timeout_s)

    @property
    def advertised(self) -> str:
        assert self.server is not None
        return self.node.advertise or self.server.address

    async def join(self) -> Welcome | None:
        """Join the scheduler (retrying while it starts) and return its welcome; None if stopped meanwhile."""
        sched = self.cfg.scheduler
        self.scheduler = self.client(sched.advertise or sched.bind)
        await self.scheduler.connect()
        deadline = time.monotonic() + self.cfg.job.join_timeout_s
        while True:
            request = asyncio.create_task(self.scheduler.request(
                Join(role=self.node.role, address=self.advertised, pid=os.getpid()),
                timeout_s=min(5.0, self.cfg.job.join_timeout_s)))
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait({request, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not request.done():  # a signal arrived while joining: a graceful stop
                request.cancel()
                await asyncio.gather(request, stop, return_exceptions=True)
                return None
            try:
                reply = request.result()
            except RequestTimeout:
                if time.monotonic() > deadline:
                    raise
                continue
            if isinstance(reply, Shutdown):
                raise HmpError(f"scheduler refused to admit {self.id}: {reply.reason}")
            assert isinstance(reply, Welcome)
            self.welcome = reply
            self.log.info("joined", scheduler=self.scheduler.address, address=self.advertised)
            return reply

    async def heartbeat_loop(self) -> None:
        """Heartbeat the scheduler; stop when it says so or when it has been silent 3 intervals."""
        assert self.scheduler is not None
        interval = self.cfg.job.heartbeat_interval_s
        last_ok = time.monotonic()
        while not self.stopping.is_set():
            try:
                reply = await self.scheduler.request(Heartbeat(step=self.step), timeout_s=interval * 3)
                last_ok = time.monotonic()
                if isinstance(reply, Shutdown):
                    self.log.info("job_over", reason=reply.reason)
                    self.stopping.set()
                    return
            except (RequestTimeout, RemoteError) as exc:
                if time.monotonic() - last_ok > interval * 3:
                    self.fail(f"scheduler lost: {exc}")
                    return
            try:
                await asyncio.wait_for(self.stopping.wait(), interval)
            except TimeoutError:
                pass

    async def leave(self, reason: str) -> None:
        if self.scheduler is None:
            return
        try:
            await self.scheduler.request(Leave(reason=reason), timeout_s=2.0)
        except HmpError as exc:
            self.log.info("leave_unanswered", error=str(exc))

    def fail(self, why: str) -> None:
        self.log.error("node_failed", reason=why)
        self.failed = why
        self.stopping.set()

    async def run(self, pending_signals: list[int] | None = None) -> int:
        """Serve until stopped; returns the process exit code. ``pending_signals`` are signals that arrived before
        the loop took them over (see ``hmp.nodes.main``); they stop the node as soon as it starts."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        for sig in list(pending_signals or ()):
            self._on_signal(sig)
        self.server = Server(self.node.bind, self.handlers(), name=self.id, limits=self.limits,
                             frame_bytes=self.cfg.limits.frame_bytes)
        await self.server.start()
        self.log.info("serving", address=self.server.address, pid=os.getpid())
        try:
            await self.main()
        except HmpError as exc:
            self.fail(f"{exc.__class__.__name__}: {exc}")
        except Exception as exc:  # a crash must still close sockets and report
            self.log.exception("node_crashed")
            self.failed = f"{exc.__class__.__name__}: {exc}"
        finally:
            await self.shutdown()
        self.log.info("stopped", failed=self.failed)
        return 1 if self.failed else 0

    def _on_signal(self, sig: int) -> None:
        self.log.info("signal", signal=signal.Signals(sig).name)
        self.stopping.set()

    async def shutdown(self) -> None:
        if self.server is not None:
            await self.server.close(grace_s=2.0)
        if self.scheduler is not None:
            await self.scheduler.close()
