"""What every daemon shares: its server, its link to the scheduler, heartbeats, graceful stop.

A node runs its role's ``main()`` and background tasks in one ``asyncio.TaskGroup``: a failing task
fails the node, blocking work runs on a compute thread (``in_thread``) so heartbeats go on, and
SIGTERM/SIGINT set ``stopping`` for ``main()`` to finish. The rules are in docs/architecture.md,
"Life of a job".
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog
import zmq

from hmp.config import Config, NodeConfig
from hmp.errors import ConfigError, HmpError, RemoteError, RequestTimeout
from hmp.messages import Ack, Heartbeat, Join, Kind, Leave, Message, Shutdown, Status, Welcome
from hmp.transport.codec import Limits
from hmp.transport import security
from hmp.metrics import MetricsEndpoint
from hmp.transport import (Client, EndpointSettings, Handler, LatencyHistogram, Server, TransportMetrics,
                           set_process_settings)

T = TypeVar("T")
#: Heartbeat intervals without an answer after which a node declares its scheduler lost (and fails).
SCHEDULER_LOST_AFTER = 2.9

#: The sender id of the local launcher (``hmp.cluster.LocalCluster``, ``hmp-launch``): it may ask
#: for a node's status and shut it down.
LAUNCHER = "launcher"

#: Who may send each control kind (docs/protocol.md, "Trust"), checked by :meth:`Node.authorize`
#: for every message before its handler runs: ``scheduler`` (the scheduler's node id),
#: ``launcher`` (:data:`LAUNCHER`), ``member`` (any node id of the topology). Kinds not listed
#: (data: push, pull, init, ring pieces, activations; shared-memory handshakes) are open to any
#: holder of the job token, e.g. a client outside the topology reading parameters.
SENDERS: dict[Kind, frozenset[str]] = {
    Kind.SHUTDOWN: frozenset({"scheduler", "launcher"}),
    Kind.ASSIGN: frozenset({"scheduler"}),
    Kind.STAGE_ASSIGN: frozenset({"scheduler"}),
    Kind.RING_ASSIGN: frozenset({"scheduler"}),
    Kind.DROP: frozenset({"scheduler"}),
    Kind.SHARDS: frozenset({"scheduler"}),
    Kind.REPLICAS: frozenset({"scheduler"}),
    Kind.REPLICATE: frozenset({"member"}),  # the handler checks it comes from the group's primary
    Kind.JOIN: frozenset({"member"}),
    Kind.HEARTBEAT: frozenset({"member"}),
    # A leave is always the sender's own (it names nobody else). To the scheduler only a member leaves the
    # job; to a shard any token holder may say it is done (an API client, hmp.client.PSClient.leave).
    Kind.LEAVE: frozenset({"member"}),
    Kind.REPORT: frozenset({"member"}),
    Kind.WORK: frozenset({"member"}),
    Kind.STATUS: frozenset({"member", "launcher"}),
}


class Node:
    """Base of the four daemons. Subclasses set ``role``, fill ``handlers()`` and write ``main()``."""

    role = "node"
    #: whether :meth:`run` takes SIGTERM/SIGINT over (a daemon does; a node hosted on a thread of someone
    #: else's process, :mod:`hmp.nodes.user_worker`, leaves that process's signals alone)
    handles_signals = True

    def __init__(self, cfg: Config, node_id: str) -> None:
        self.cfg = cfg
        self.node: NodeConfig = cfg.node(node_id)
        self.id = node_id
        self._member_ids = frozenset(n.id for n in cfg.nodes)  # who may join, heartbeat, report (SENDERS)
        self.limits = Limits.of(cfg.limits)
        self.log = structlog.get_logger("hmp").bind(role=self.node.role, node_id=node_id)
        self.stopping = asyncio.Event()
        self.failed: str | None = None
        self.config_error: ConfigError | None = None  # main() found the config (its data) unusable: exit 2
        self.server: Server | None = None
        self.scheduler: Client | None = None
        self.welcome: Welcome | None = None
        self.scheduler_lost = False  # set when the heartbeats find it gone
        self.started = time.monotonic()
        self.step = 0
        self._task_group: asyncio.TaskGroup | None = None  # set while main() runs: where spawn() puts tasks
        self._main_task: asyncio.Task | None = None
        self._background_tasks: set[asyncio.Task] = set()
        self._heartbeat_task: asyncio.Task | None = None
        self._compute_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{node_id}-compute")
        #: round trips of the answered heartbeats, and the last one (seconds; None before the first)
        self.heartbeat_rtt = LatencyHistogram()
        self.heartbeat_last_rtt_s: float | None = None
        self.metrics_endpoint: MetricsEndpoint | None = None  # [metrics] enabled: serving while run() runs

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

    # ---------------------------------------------------------------- trust
    def authorize(self, msg: Message, peer: bytes) -> str | None:
        """Whether ``msg``'s sender may send its kind (:data:`SENDERS`): None, or why not. The server
        asks this for every message, before any handler (the job token is checked before this).

        The sender id is what the message says: with CURVE on, the server has already bound it to
        the sender's key (docs/security.md); without, anyone holding the job token may claim any id.
        """
        allowed = SENDERS.get(msg.kind)
        if allowed is None or (msg.kind == Kind.LEAVE and self.id != self.cfg.scheduler.id):
            return None
        sender = msg.sender
        if "scheduler" in allowed and sender == self.cfg.scheduler.id:
            return None
        if "launcher" in allowed and sender == LAUNCHER:
            return None
        if "member" in allowed and sender in self._member_ids:
            return None
        who = " or ".join(sorted({"scheduler": f"the scheduler ({self.cfg.scheduler.id!r})",
                                  "launcher": f"the launcher ({LAUNCHER!r})",
                                  "member": "a node of this topology"}[a] for a in allowed))
        return f"{self.id} refuses {msg.kind.value!r} from {sender or '?'!r}: only {who} may send it"

    # ---------------------------------------------------------------- plumbing
    def client(self, address: str, name: str | None = None) -> Client:
        return Client(address, name=name or self.id, limits=self.limits, frame_bytes=self.cfg.limits.frame_bytes,
                      timeout_s=self.cfg.limits.request_timeout_s, job_token=self.cfg.job.token)

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
            except RemoteError as exc:
                if exc.code != "unauthorized":
                    raise
                # Another job's scheduler on this address (its token differs): retrying cannot help,
                # and this node must not linger near a job that is not its own.
                raise HmpError(f"{self.id}: the scheduler at {self.scheduler.address} refused the join: "
                               f"{exc.remote_message}. Is another job using these ports?") from None
            if isinstance(reply, Shutdown):
                raise HmpError(f"scheduler refused to admit {self.id}: {reply.reason}")
            assert isinstance(reply, Welcome)
            self.welcome = reply
            self.log.info("joined", scheduler=self.scheduler.address, address=self.advertised)
            return reply

    async def heartbeat_loop(self) -> None:
        """Heartbeat the scheduler; stop when it says so, or fail when it has not answered for
        :data:`SCHEDULER_LOST_AFTER` intervals (a dead scheduler is noticed within 3 intervals of its last
        answer: each heartbeat waits only until that deadline, not a whole timeout of its own; but at least
        half an interval, so that a node whose own loop ran late, starved of CPU or busy, and sends its
        heartbeat just before the deadline does not blame the scheduler for its own delay)."""
        assert self.scheduler is not None
        interval = self.cfg.job.heartbeat_interval_s
        last_ok = time.monotonic()
        while not self.stopping.is_set():
            deadline = last_ok + SCHEDULER_LOST_AFTER * interval
            try:
                sent = time.monotonic()
                reply = await self.scheduler.request(Heartbeat(step=self.step),
                                                     timeout_s=max(0.5 * interval, deadline - time.monotonic()))
                last_ok = time.monotonic()
                self.heartbeat_last_rtt_s = last_ok - sent
                self.heartbeat_rtt.observe(last_ok - sent)
                if isinstance(reply, Shutdown):
                    self.log.info("job_over", reason=reply.reason)
                    self.stopping.set()
                    return
            except (RequestTimeout, RemoteError) as exc:
                if time.monotonic() >= deadline - 0.01 * interval:
                    self.scheduler_lost = True  # leave() does not wait for an answer that cannot come
                    self.fail(f"scheduler lost: no answer for {time.monotonic() - last_ok:.1f} s ({exc})")
                    return
            try:
                await asyncio.wait_for(self.stopping.wait(), interval)
            except TimeoutError:
                pass

    def start_heartbeat(self) -> asyncio.Task:
        """Heartbeat the scheduler from a background task (see :meth:`spawn`) until :meth:`leave`."""
        self._heartbeat_task = self.spawn(self.heartbeat_loop(), name="heartbeat")
        return self._heartbeat_task

    async def stop_heartbeat(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    # ---------------------------------------------------------------- tasks and threads
    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task:
        """Run ``coro`` as a background task of this node; if it raises, the node fails at once (module
        docstring). Only while ``main()`` runs: a node that is not running refuses (RuntimeError)."""
        if self._task_group is None:
            coro.close()
            raise RuntimeError(f"{self.id}: spawn({name!r}) outside main(): the node is not running")
        task = self._task_group.create_task(self._supervise(coro, name), name=f"{self.id}:{name}")
        self._background_tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._background_tasks.discard(t)
            coro.close()  # one cancelled before it started was never awaited: no warning for that

        task.add_done_callback(done)
        return task

    async def _supervise(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        try:
            await coro
        except Exception as exc:
            # Logged now, not when the group unwinds: main()'s clean-up may take a while.
            self.log.error("task_failed", task=name, error=f"{exc.__class__.__name__}: {exc}", exc_info=exc)
            self.failed = self.failed or f"{name}: {exc.__class__.__name__}: {exc}"
            self.stopping.set()
            raise  # the group cancels main() and the other tasks

    async def in_thread(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` on this node's compute thread (module docstring); returns what it returns."""
        fut = asyncio.get_running_loop().run_in_executor(self._compute_pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait({fut})  # the call runs to its end before the caller's clean-up touches its data
            raise

    async def leave(self, reason: str) -> None:
        """Stop heartbeating and tell the scheduler this node is leaving."""
        await self.stop_heartbeat()
        if self.scheduler is None or self.scheduler_lost:
            return
        try:
            await self.scheduler.request(Leave(reason=reason), timeout_s=2.0)
        except HmpError as exc:
            self.log.info("leave_unanswered", error=str(exc))

    def fail(self, why: str) -> None:
        """The node has failed: log and record why, stop, and cancel ``main()`` now unless it is the caller
        (its ``finally`` blocks still run)."""
        self.log.error("node_failed", reason=why)
        self.failed = why
        self.stopping.set()
        main = self._main_task
        if main is not None and main is not asyncio.current_task() and not main.done():
            main.cancel()

    async def run(self, pending_signals: list[int] | None = None, ready: Callable[[str], None] | None = None) -> int:
        """Serve until stopped; returns the process exit code. ``pending_signals`` are signals that arrived before
        the loop took them over (see ``hmp.nodes.main``); they stop the node as soon as it starts. ``ready`` is
        called with the bound address once the node serves (``hmp.nodes.main --ready-file``)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT) if self.handles_signals else ():
            loop.add_signal_handler(sig, self._on_signal, sig)
        for sig in list(pending_signals or ()):
            self._on_signal(sig)
        # Every endpoint this process opens, whichever module opens it, speaks for this job (its token, and
        # with [security] curve its keys: hmp.transport.security).
        try:
            curve = security.from_config(self.cfg, self.id)
        except HmpError:
            self._compute_pool.shutdown(wait=False)
            raise
        settings = EndpointSettings(limits=self.limits, frame_bytes=self.cfg.limits.frame_bytes,
                                    job_token=self.cfg.job.token, security=curve,
                                    metrics=TransportMetrics() if self.cfg.metrics.enabled else None)
        set_process_settings(settings)  # before the server: every endpoint opened from now on counts
        self.server = Server(self.node.bind, self.handlers(), name=self.id, settings=settings,
                             authorize=self.authorize)
        try:
            await self.server.start()
        except zmq.ZMQError as exc:
            self.server = None
            set_process_settings(None)
            self._compute_pool.shutdown(wait=False)
            if exc.errno == zmq.EADDRINUSE:
                raise ConfigError(self.cfg.path, f"nodes[id={self.id}].bind",
                                  f"an address free to bind: {self.node.bind} is already in use (another job or "
                                  f"process listens there; stop it or choose another port)") from None
            raise ConfigError(self.cfg.path, f"nodes[id={self.id}].bind",
                              f"an address this host can bind: {self.node.bind}: {exc}") from None
        self.log.info("serving", address=self.server.address, pid=os.getpid(), curve=curve is not None,
                      token=bool(self.cfg.job.token))
        if ready is not None:
            ready(self.server.address)
        if self.cfg.metrics.enabled:
            try:
                self.metrics_endpoint = await MetricsEndpoint.start(self)
            except ConfigError:  # port taken, or no prometheus-client: exit 2, after closing what is open
                await self.shutdown()
                raise
            self.log.info("metrics_serving", url=self.metrics_endpoint.url)
        try:
            async with asyncio.TaskGroup() as group:
                self._task_group = group
                self._main_task = group.create_task(self._run_main(), name=f"{self.id}:main")
        except* Exception:
            pass  # background tasks' exceptions: logged, and the node marked failed, when they were raised
        finally:
            self._task_group = self._main_task = None
            await self.shutdown()
        self.log.info("stopped", failed=self.failed)
        if self.config_error is not None:  # hmp.nodes.main prints it as the one line and exits 2
            raise self.config_error
        return 1 if self.failed else 0

    async def _run_main(self) -> None:
        try:
            await self.main()
        except ConfigError as exc:  # e.g. its own load of bad data: the launcher's one line, and exit 2
            self.config_error = exc
            self.fail(f"{exc.__class__.__name__}: {exc}")
        except HmpError as exc:
            self.fail(f"{exc.__class__.__name__}: {exc}")
        except Exception as exc:  # a crash must still close sockets and report
            self.log.exception("node_crashed")
            self.failed = f"{exc.__class__.__name__}: {exc}"
        finally:
            self._task_group = None  # no new background tasks; the ones still running end with main()
            for task in list(self._background_tasks):
                task.cancel()

    def _on_signal(self, sig: int) -> None:
        self.log.info("signal", signal=signal.Signals(sig).name)
        self.stopping.set()

    async def shutdown(self) -> None:
        if self.server is not None:
            await self.server.close(grace_s=2.0)
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.metrics_endpoint is not None:  # after the sockets: scrapes still answer while they close
            endpoint, self.metrics_endpoint = self.metrics_endpoint, None
            await endpoint.stop()
        set_process_settings(None)  # this process's endpoints no longer speak for the job
        # A call still running (main() was cancelled mid-step) finishes on its own; the process exits after it.
        self._compute_pool.shutdown(wait=False, cancel_futures=True)
