"""What every launcher of a job's daemons shares: start, watch, restart, fail, stop.

:class:`Launcher` holds the lifecycle (``async with``, :meth:`~Launcher.train`, :meth:`~Launcher.wait`,
:meth:`~Launcher.status`, :meth:`~Launcher.finish`, :meth:`~Launcher.stop`) and the policy on a daemon's exit
(docs/architecture.md, "Elastic workers"): restart it while ``[job] restarts`` allows, leave a worker (or a
replicated shard) to the scheduler's judgement, otherwise fail the job with :class:`JobFailed`. An engine
says how a daemon is started, awaited and stopped: :class:`hmp.cluster.LocalCluster` (processes of this
machine or of its emulated hosts) and :class:`hmp.ray_engine.RayCluster` (children of Ray actors).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from hmp import job
from hmp.config import WORKER_ROLES, Config, Role
from hmp.config.toml_text import write_run_config
from hmp.errors import HmpError
from hmp.launcher import Service, tail
from hmp.launcher.diagnose import failure_line
from hmp.messages import Shutdown, Status
from hmp.transport import security
from hmp.transport.endpoint import Client
from hmp.transport.shm import cleanup_stale

_log = structlog.get_logger("hmp").bind(role="launcher")


class JobFailed(HmpError):
    """A daemon exited non-zero (or the job timed out); ``node`` names it, ``log_tail`` shows why, and ``cause`` says
    it in one line: the daemon, the cause from its log and, where there is a usual remedy, a hint
    (:func:`hmp.launcher.diagnose.failure_line`)."""

    def __init__(self, message: str, node: str = "", log_tail: str = "", cause: str = "") -> None:
        super().__init__(message + (f"\n--- last lines of {node}'s log ---\n{log_tail}" if log_tail else ""))
        self.node, self.log_tail = node, log_tail
        self.cause = cause or message


class JobTimedOut(JobFailed):
    """The job still ran when ``train()``'s timeout passed; it was stopped, its report written (status ``timeout``)."""


class Launcher(Service):
    """Starts, watches and stops every daemon of ``config`` (module docstring). An engine implements ``start()``,
    ``_exit_code(node_id)`` (once the daemon has ended: its exit code and "", or None and why it was lost),
    ``_alive(node_id)``, ``_stop_daemons()`` (SIGTERM, then SIGKILL after the grace period), and
    ``_start_node(node_id, log_name, resume)`` where ``[job] restarts`` are allowed."""

    def __init__(self, config: Config | str | os.PathLike, *, env: dict[str, str] | None, resume: bool,
                 grace_s: float, config_path: str | os.PathLike | None = None) -> None:
        self.cfg = config if isinstance(config, Config) else job.load(config)
        if config_path is None and (self.cfg.overrides or self.cfg.nodes_from_counts):
            config_path = write_run_config(self.cfg)  # the daemons read this config, which is not its file's
        self.config_path = str(config_path or self.cfg.path)
        self.resume = resume
        self.grace_s = grace_s
        self.env = self._daemon_env({**os.environ, **(env or {})})
        # The job's identity: every daemon started here gets it (hmp.job.with_env reads HMP_JOB_TOKEN) and
        # refuses messages without it, so that a second job on the same ports cannot join this one.
        self.job_token = self.env.get("HMP_JOB_TOKEN") or self.cfg.job.token or secrets.token_hex(16)
        self.env["HMP_JOB_TOKEN"] = self.job_token
        self.cfg = self.cfg.replace(job=dataclasses.replace(self.cfg.job, token=self.job_token))
        # With [security] curve, this process's own requests (status, finish) go with the launcher's key
        # (a missing key file is a ConfigError here, before any daemon starts); None: plain.
        self._launcher_security = security.from_config(self.cfg, "launcher", serve=False)
        #: restarts of crashed daemons so far, one ``{node, t, exit_code, attempt, log}`` each (``t``: seconds
        #: since start())
        self.restarts: list[dict[str, Any]] = []
        #: workers that exited non-zero (or were lost: -9) and were not restarted: ``{node: exit code}``
        self.worker_exits: dict[str, int] = {}
        #: daemons lost with their engine's handle (a Ray actor that died), one ``{node, t, error}`` each
        self.lost: list[dict[str, Any]] = []
        #: each daemon's handle (a process, a Ray actor), by node id
        self.daemons: dict[str, Any] = {}
        self._exits: dict[str, int | None] = {}  # node -> exit code seen by wait() (None: lost)
        self._restarts_left = {n.id: int(self.cfg.job.restarts.get(n.role, 0))
                               for n in (*self.cfg.workers, *self.cfg.shards)}
        self.log_dir = self.cfg.report_dir / "logs"
        self._log_paths: dict[str, Path] = {}
        s = self.cfg.scheduler
        self._scheduler_address = s.advertise or s.bind
        self._status_client: Client | None = None  # one socket for every status() poll, closed in stop()
        self._stopping = False
        self._t_start = time.monotonic()
        #: how the launcher ended the job when it did so itself ("timeout", "failed", "interrupted"; None: the job
        #: ended on its own): the status the scheduler writes in the report when asked to stop
        self.end_status: str | None = None
        #: where the job's token is written for clients outside the topology (``hmp.connect``), while the job runs
        self.token_file = self.cfg.report_dir / "job.token"

    def _daemon_env(self, environ: dict[str, str]) -> dict[str, str]:
        """The environment the daemons get, from this process's with the caller's ``env`` on top."""
        environ.setdefault("PYTHONUNBUFFERED", "1")
        return environ

    # ------------------------------------------------------------------------------------ the engine's part

    def _begin(self) -> None:
        """What every start() does first: the logs' folder, the clock, shared memory left by this job's killed
        daemons (docs/shm.md)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._t_start = time.monotonic()
        cleanup_stale(self.cfg.job.name, self.cfg.shm.dir)
        # Readable by this user only: whoever holds the token may take part in the job (docs/security.md).
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.job_token)

    @property
    def scheduler_address(self) -> str:
        """Where clients reach the job's scheduler (``hmp.connect``; with emulated hosts, the scheduler's host
        address inside its namespace)."""
        s = self.cfg.scheduler
        return s.advertise or s.bind

    def _release(self) -> None:
        """What the engine frees after its daemons; not a coroutine, so that a second cancel cannot cut it short."""

    async def _poll(self) -> None:
        """Called at each of wait()'s polls, before the exits are looked at."""

    async def _report(self) -> dict[str, Any]:
        return json.loads((self.cfg.report_dir / "report.json").read_text())

    # ------------------------------------------------------------------------------------ watching

    def log_tail(self, node_id: str, lines: int = 15) -> str:
        return tail(self._log_paths.get(node_id) or self.log_dir / f"{node_id}.log", lines)

    def log_path(self, node_id: str) -> Path:
        """Daemon ``node_id``'s log (its latest, for a restarted one)."""
        return self._log_paths.get(node_id) or self.log_dir / f"{node_id}.log"

    def failure_line(self, node_id: str, what: str) -> str:
        """One line on why daemon ``node_id`` failed (``what``: how it ended, when its log does not say)."""
        return failure_line(node_id, str(self.cfg.node(node_id).role), self.log_tail(node_id, 200), what)

    async def status(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The scheduler's status, or None if it does not answer. Every poll goes through one socket."""
        if not self._scheduler_address:
            return None
        if self._status_client is None:
            self._status_client = Client(self._scheduler_address, name="launcher", timeout_s=timeout_s,
                                         job_token=self.job_token, security=self._launcher_security or False)
            await self._status_client.connect()
        try:
            reply = await self._status_client.request(Status(), timeout_s=timeout_s)
        except HmpError:
            return None
        return reply.state if isinstance(reply, Status) else None

    async def finish(self, reason: str = "", timeout_s: float = 5.0) -> None:
        """Ask the scheduler to end the job now as if a stop rule had fired: the workers stop, the
        final evaluation runs and the report is written (``train()`` then returns it)."""
        await self.status(timeout_s=timeout_s)  # opens the one launcher socket
        assert self._status_client is not None
        await self._status_client.request(Shutdown(reason=reason, finish=True), timeout_s=timeout_s)

    async def _restart_node(self, node_id: str, code: int | None) -> bool:
        """Start a crashed worker or shard again if its role's ``[job] restarts`` allows and the job still runs."""
        if self._stopping or self._restarts_left.get(node_id, 0) < 1 or not self._alive(self.cfg.scheduler.id):
            return False
        self._restarts_left[node_id] -= 1
        attempt = sum(1 for r in self.restarts if r["node"] == node_id) + 1
        # A shard restarted mid-job resumes from its checkpoint.
        await self._start_node(node_id, log_name=f"{node_id}.{attempt}.log",
                               resume=self.cfg.node(node_id).role == Role.PS)
        entry = {"node": node_id, "t": round(time.monotonic() - self._t_start, 3), "exit_code": code,
                 "attempt": attempt, "log": str(self._log_paths[node_id])}
        self.restarts.append(entry)
        _log.warning("node_restarted", **entry, restarts_left=self._restarts_left[node_id])
        return True

    async def wait(self, timeout_s: float | None = None,
                   progress: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 1.0) -> None:
        """Wait until every daemon has exited; raise JobFailed at the first non-zero exit (or loss) of a shard or
        the scheduler. A worker's non-zero exit restarts it (``[job] restarts``) or is left to the scheduler's
        judgement (``[train] min_workers``); JobFailed then names the first such worker."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waits = {asyncio.ensure_future(self._exit_code(nid)): nid for nid in self.daemons}
        try:
            while waits:
                done, _ = await asyncio.wait(waits, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
                await self._poll()
                for t in done:
                    nid = waits.pop(t)
                    code, error = t.result()
                    self._exits[nid] = code
                    if code == 0:
                        continue
                    role = self.cfg.node(nid).role
                    what = f"lost ({error})" if code is None else f"exited with code {code}"
                    if code is None:
                        entry = {"node": nid, "t": round(time.monotonic() - self._t_start, 3), "error": error}
                        self.lost.append(entry)
                        _log.warning("node_lost", **entry, note="its daemon was stopped with it")
                    if role in (Role.PS, *WORKER_ROLES) and await self._restart_node(nid, code):
                        del self._exits[nid]  # a new process, which resumes the job (a shard: from its checkpoint)
                        waits[asyncio.ensure_future(self._exit_code(nid))] = nid
                    elif role == Role.PS and self.cfg.ps.replicas > 1:
                        _log.warning("shard_exited", node=nid, how=what,
                                     note="its backup takes over ([ps] replicas = 2); the scheduler judges")
                    elif role in WORKER_ROLES:
                        self.worker_exits.setdefault(nid, -9 if code is None else code)
                        _log.warning("worker_exited", node=nid, how=what,
                                     note="the job goes on while [train] min_workers remain")
                    elif self.worker_exits:  # the job failed after (likely: because) a worker died
                        first, first_code = next(iter(self.worker_exits.items()))
                        self.end_status = "failed"
                        raise JobFailed(f"daemon {first} exited with code {first_code}, then {nid} {what}",
                                        first, self.log_tail(first) + f"\n--- last lines of {nid}'s log ---\n"
                                        + self.log_tail(nid),
                                        cause=self.failure_line(first, f"exited with code {first_code}"))
                    else:
                        self.end_status = "failed"
                        raise JobFailed(f"daemon {nid} {what}", nid, self.log_tail(nid),
                                        cause=self.failure_line(nid, what))
                if progress is not None and self._alive(self.cfg.scheduler.id):
                    st = await self.status(timeout_s=min(poll_s, 2.0))
                    if st:
                        progress(st)
                if deadline is not None and time.monotonic() > deadline:
                    self.end_status = "timeout"
                    raise JobTimedOut(f"job still running after {timeout_s} s: stopped")
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def train(self, timeout_s: float | None = None,
                    progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Wait for the job to finish and return its report (``report.json`` as a dict)."""
        if timeout_s is None:
            timeout_s = self.cfg.train.max_seconds + self.cfg.job.join_timeout_s + 60
        await self.wait(timeout_s, progress)
        return await self._report()

    # ------------------------------------------------------------------------------------ stopping

    async def stop(self) -> None:
        """End the job: a scheduler still running is first asked to stop (it writes the report and the model of
        what was trained, with the status :attr:`end_status`, default ``interrupted``) and given the grace period
        to do so; then every daemon still running is stopped (SIGTERM, then SIGKILL after the grace period), and
        what the engine holds and this job's shared memory left by killed daemons (docs/shm.md) are freed, also
        when cancelled (a second Ctrl-C skips the wait for the scheduler)."""
        self._stopping = True  # no more restarts
        cancelled: BaseException | None = None
        try:
            try:
                await self._end_job()
            except asyncio.CancelledError as exc:
                cancelled = exc
            if self._status_client is not None:
                client, self._status_client = self._status_client, None
                with contextlib.suppress(Exception):
                    await client.close()
            await self._stop_daemons()
        finally:
            self._release()
            cleanup_stale(self.cfg.job.name, self.cfg.shm.dir)
            with contextlib.suppress(OSError):
                self.token_file.unlink()
        if cancelled is not None:
            raise cancelled

    async def _end_job(self) -> None:
        """Ask a scheduler that still runs to stop the job with :attr:`end_status` as its report's status, and wait
        (at most the grace period) until it has written the report and exited."""
        scheduler = self.cfg.scheduler.id
        if scheduler not in self.daemons or not self._alive(scheduler):
            return
        status = self.end_status or "interrupted"
        _log.info("stopping_job", status=status, note="the scheduler writes the report of what was trained")
        try:
            await self.status(timeout_s=2.0)  # opens the one launcher socket
            if self._status_client is None:
                return
            await self._status_client.request(Shutdown(reason=status), timeout_s=2.0)
            await asyncio.wait_for(self._exit_code(scheduler), self.grace_s)
        except (HmpError, TimeoutError) as exc:
            _log.warning("scheduler_did_not_stop", error=str(exc) or exc.__class__.__name__,
                         note="every daemon is stopped now; the report may be missing")
