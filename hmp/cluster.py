"""Run a whole topology on this machine from Python: the API behind ``hmp-launch``.

    async with hmp.LocalCluster("conf/local.toml") as cluster:
        report = await cluster.train()

Every daemon is its own OS process (``python -m hmp.nodes.main ROLE --config F --id N``), its log in
``<report_dir>/logs/<id>.log``. ``train()`` watches them: if any exits non-zero the others are
stopped and :class:`JobFailed` names it; leaving the ``async with`` block stops whatever still
runs (SIGTERM, then SIGKILL after a grace period), so no process outlives the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from hmp import job
from hmp.config import Config, Role
from hmp.errors import HmpError
from hmp.messages import Shutdown, Status
from hmp.transport.endpoint import Client

START_ORDER = tuple(Role)  # scheduler, ps, cpu_worker, gpu_worker


class JobFailed(HmpError):
    """A daemon exited non-zero (or the job timed out); ``node`` names it, ``log_tail`` shows why."""

    def __init__(self, message: str, node: str = "", log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- last lines of {node}'s log ---\n{log_tail}" if log_tail else ""))
        self.node, self.log_tail = node, log_tail


class LocalCluster:
    """Starts, watches and stops every daemon of ``config`` on this host."""

    def __init__(self, config: Config | str | os.PathLike, *, config_path: str | None = None,
                 env: dict[str, str] | None = None, resume: bool = False, grace_s: float = 10.0) -> None:
        self.cfg = config if isinstance(config, Config) else job.load(config)
        self.config_path = config_path or self.cfg.path
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.resume = resume
        self.grace_s = grace_s
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.log_dir = self.cfg.report_dir / "logs"
        self._logs: dict[str, Any] = {}
        self._status_client: Client | None = None  # one socket for every status() poll, closed in stop()

    async def __aenter__(self) -> LocalCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for role in START_ORDER:
            for node in self.cfg.by_role(role):
                cmd = [sys.executable, "-m", "hmp.nodes.main", role, "--config", self.config_path, "--id", node.id]
                if role == Role.PS and self.resume:
                    cmd.append("--resume")
                logf = open(self.log_dir / f"{node.id}.log", "wb")  # noqa: SIM115 - closed in stop()
                self._logs[node.id] = logf
                # A new session: a Ctrl-C on the terminal reaches the launcher only, which stops
                # the daemons in order instead of all of them dying at once.
                self.procs[node.id] = await asyncio.create_subprocess_exec(
                    *cmd, stdout=logf, stderr=asyncio.subprocess.STDOUT, env=self.env, start_new_session=True)

    def log_tail(self, node_id: str, lines: int = 15) -> str:
        p = self.log_dir / f"{node_id}.log"
        try:
            return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def status(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The scheduler's status, or None if it does not answer. Every poll goes through one socket."""
        if self._status_client is None:
            s = self.cfg.scheduler
            self._status_client = Client(s.advertise or s.bind, name="launcher", timeout_s=timeout_s)
            await self._status_client.connect()
        try:
            reply = await self._status_client.request(Status(), timeout_s=timeout_s)
        except HmpError:
            return None
        return reply.state if isinstance(reply, Status) else None

    async def wait(self, timeout_s: float | None = None,
                   progress: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 1.0) -> None:
        """Wait until every daemon has exited; raise JobFailed at the first non-zero exit."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waits = {asyncio.create_task(p.wait()): nid for nid, p in self.procs.items()}
        try:
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    nid = waits[t]
                    if t.result() != 0:
                        raise JobFailed(f"daemon {nid} exited with code {t.result()}", nid, self.log_tail(nid))
                if progress is not None and self.procs[self.cfg.scheduler.id].returncode is None:
                    st = await self.status(timeout_s=min(poll_s, 2.0))
                    if st:
                        progress(st)
                if deadline is not None and time.monotonic() > deadline:
                    raise JobFailed(f"job still running after {timeout_s} s")
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
        return json.loads((self.cfg.report_dir / "report.json").read_text())

    async def finish(self, reason: str = "", timeout_s: float = 5.0) -> None:
        """Ask the scheduler to end the job now as if a stop rule had fired: the workers stop, the
        final evaluation runs and the report is written (``train()`` then returns it)."""
        await self.status(timeout_s=timeout_s)  # opens the one launcher socket
        assert self._status_client is not None
        await self._status_client.request(Shutdown(reason=reason, finish=True), timeout_s=timeout_s)

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one daemon (tests use it to crash a node)."""
        self.procs[node_id].send_signal(sig)

    async def stop(self) -> None:
        """Stop every daemon still running: SIGTERM, then SIGKILL after the grace period."""
        if self._status_client is not None:
            client, self._status_client = self._status_client, None
            await client.close()
        live = [p for p in self.procs.values() if p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        if live:
            _, still = await asyncio.wait([asyncio.create_task(p.wait()) for p in live], timeout=self.grace_s)
            for p in live:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                    await p.wait()
        for f in self._logs.values():
            f.close()
        self._logs.clear()
