"""Run a whole topology on this machine from Python: the API behind ``hmp-launch``.

    async with hmp.LocalCluster("conf/local.toml") as cluster:
        report = await cluster.train()

Every daemon is its own OS process (what ``python -m hmp.nodes.main ROLE --config F --id N`` runs, forked from
a server that has imported torch once: :mod:`hmp.nodes.forkserver`; on emulated hosts each enters its host's
network namespace after the fork; ``HMP_FORKSERVER=0`` execs each), its log in
``<report_dir>/logs/<id>.log``. ``train()`` watches them (the lifecycle every engine shares:
:class:`hmp.launcher.base.Launcher`): if a PS shard or the scheduler exits non-zero the
others are stopped and :class:`JobFailed` names it; leaving the ``async with`` block stops whatever still
runs (SIGTERM, then SIGKILL after a grace period), so no process outlives the cluster.

Workers are elastic (docs/architecture.md, "Elastic workers"): a worker that exits non-zero or is killed
while the job runs is started again (same id, a new process; its log ``<id>.<n>.log``) while its role's
``[job] restarts`` allows, and rejoins the job; so does a PS shard (``restarts = {ps = 1}``), which resumes
from its last checkpoint while the workers wait for it; :attr:`LocalCluster.restarts` lists each restart. Past
that limit the job goes on without it, the scheduler judging whether enough workers remain (``[train]
min_workers``); if the job then fails, :class:`JobFailed` names the first worker that exited non-zero.

With ``[metrics] enabled`` each daemon serves its metrics over HTTP (docs/metrics.md) and writes the URL
into ``<report_dir>/metrics/<id>.json``: ``start()`` waits (bounded) until every daemon it started has
written its own and logs each (``metrics_endpoint``); :attr:`LocalCluster.metrics_urls` lists those serving
now.

On emulated hosts (``LocalCluster(cfg, hosts="conf/hosts4.toml")`` or a :class:`~hmp.emulate.EmulatedHosts`;
docs/emulate.md): each ``[[nodes]] host`` names a host of the hosts file, each daemon runs inside its
host's network namespace and binds its host's address (the daemons read a derived config, written in a
temporary folder of the cluster's). This process stays in the machine's own namespace, which cannot
reach those addresses, so ``status()`` and ``finish()`` dial a Unix socket that a small relay process in the
scheduler's host forwards to the scheduler (:mod:`hmp.launcher.relay`). Hosts the cluster started
(given as a path, or an instance not yet started) are removed with everything in them at ``stop()``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from hmp import job
from hmp.config import WORKER_ROLES, Config, Role
from hmp.emulate import EmulatedHosts, check_placement, topology_on_hosts
from hmp.errors import ConfigError
from hmp.launcher import terminate
from hmp.launcher.base import JobFailed, JobTimedOut, Launcher
from hmp.metrics import check_ports, read_urls
from hmp.nodes.forkserver import ForkedProcess, ForkServer, ForkServerExited
from hmp.nodes.forkserver import enabled as forkserver_enabled

__all__ = ["JobFailed", "JobTimedOut", "LocalCluster", "START_ORDER"]

_log = structlog.get_logger("hmp").bind(role="launcher")

# scheduler, ps, cpu_worker, gpu_worker; a user_worker is the user's own program (docs/own_loop.md)
START_ORDER = tuple(r for r in Role if r != Role.USER_WORKER)

#: ``start()`` waits at most this long for the daemons' metrics URLs ([metrics] enabled) before going on
#: without the missing ones (logged).
METRICS_URL_WAIT_S = 30.0


class LocalCluster(Launcher):
    """Starts, watches and stops every daemon of ``config`` on this host."""

    def __init__(self, config: Config | str | os.PathLike, *, config_path: str | None = None,
                 env: dict[str, str] | None = None, resume: bool = False, grace_s: float = 10.0,
                 hosts: EmulatedHosts | str | os.PathLike | None = None) -> None:
        cfg = config if isinstance(config, Config) else job.load(config)
        #: emulated hosts the daemons run on (None: this machine's own network); a hosts file is loaded here,
        #: its namespaces are made by start()
        self.hosts: EmulatedHosts | None = None
        self._own_hosts = False
        if hosts is not None:
            self.hosts = hosts if isinstance(hosts, EmulatedHosts) else EmulatedHosts.from_file(hosts)
            self._own_hosts = not self.hosts.started
            check_placement(cfg.nodes, self.hosts.names, config_path or cfg.path, self.hosts.source)
        check_ports(cfg, emulated=self.hosts is not None)  # a fixed metrics port: one daemon per host
        super().__init__(cfg, env=env, resume=resume, grace_s=grace_s, config_path=config_path)
        bad = {r: n for r, n in self.cfg.job.restarts.items() if r not in (*WORKER_ROLES, Role.PS) and n}
        if bad:
            raise ConfigError(self.cfg.path, "job.restarts",
                              f"restart counts for {', '.join(sorted(WORKER_ROLES))} and ps only: restarting "
                              f"the scheduler mid-job is not supported yet; got "
                              f"{', '.join(f'{r} = {n}' for r, n in sorted(bad.items()))}")
        self._hosts_dir: str | None = None  # the derived config's folder, removed by stop()
        self._relay: asyncio.subprocess.Process | None = None  # emulated hosts: hmp.launcher.relay
        self._logs: dict[str, Any] = {}
        self._forkserver_logged = False

    @property
    def procs(self) -> dict[str, asyncio.subprocess.Process | ForkedProcess]:
        """Each daemon's process (the latest, for a restarted one), by node id."""
        return self.daemons

    async def start(self) -> None:
        self._begin()
        if self.hosts is not None:
            await self._start_hosts()
        for role in START_ORDER:
            for node in self.cfg.by_role(role):
                await self._start_node(node.id)
        if self.cfg.metrics.enabled:
            await self._list_metrics_urls(METRICS_URL_WAIT_S)

    @property
    def metrics_urls(self) -> dict[str, str]:
        """``{node id: URL}`` of the metrics endpoints serving now (``[metrics] enabled``; docs/metrics.md)."""
        return read_urls(self.cfg, {nid: p.pid for nid, p in self.procs.items() if p.returncode is None})

    async def _list_metrics_urls(self, timeout_s: float) -> None:
        """Wait until every daemon still running serves its metrics (at most ``timeout_s``), and log the URLs."""
        deadline = time.monotonic() + timeout_s
        while True:
            urls = self.metrics_urls
            running = {nid for nid, p in self.procs.items() if p.returncode is None}
            if running <= urls.keys() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        for nid, url in urls.items():
            _log.info("metrics_endpoint", node=nid, url=url)
        if running - urls.keys():
            _log.warning("metrics_endpoint_missing", nodes=sorted(running - urls.keys()), waited_s=timeout_s)

    async def _start_node(self, node_id: str, log_name: str = "", resume: bool = False) -> None:
        """Start daemon ``node_id`` (again, for a restart: its log then goes to ``log_name``; a shard
        restarted mid-job resumes from its checkpoint)."""
        node = self.cfg.node(node_id)
        args = [node.role, "--config", self.config_path, "--id", node.id]
        if (node.role == Role.PS and (self.resume or resume)) or (node.role == Role.SCHEDULER and self.resume):
            args.append("--resume")
        log = self._log_paths[node.id] = self.log_dir / (log_name or f"{node.id}.log")
        if forkserver_enabled():  # a fork of a process that has imported torch already (docs/architecture.md)
            self.procs[node.id] = await self._fork(node.host, args, str(log))
            self._log_forkserver_ready()
            _log.info("daemon_started", node=node.id, pid=self.procs[node.id].pid, log=str(log))
            return
        cmd = [sys.executable, "-m", "hmp.nodes.main", *args]
        if self.hosts is not None:
            cmd = self.hosts.command(node.host, cmd)  # `ip netns exec` execs the daemon: same pid
        if node.id in self._logs:
            self._logs.pop(node.id).close()
        logf = self._logs[node.id] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        # A new session: a Ctrl-C on the terminal reaches the launcher only, which stops
        # the daemons in order instead of all of them dying at once.
        self.procs[node.id] = await asyncio.create_subprocess_exec(
            *cmd, stdout=logf, stderr=asyncio.subprocess.STDOUT, env=self.env, start_new_session=True)
        _log.info("daemon_started", node=node.id, pid=self.procs[node.id].pid, log=str(log))

    def _log_forkserver_ready(self) -> None:
        """Once: when the fork server had imported what daemons need, and how long that took it."""
        server = ForkServer.shared()
        if self._forkserver_logged or server.ready_at is None:
            return
        self._forkserver_logged = True
        _log.info("forkserver_ready", at=round(server.ready_at, 3), import_s=server.import_s)

    async def _exit_code(self, node_id: str) -> tuple[int | None, str]:
        return await self.procs[node_id].wait(), ""

    def _alive(self, node_id: str) -> bool:
        proc = self.procs.get(node_id)
        return proc is not None and proc.returncode is None

    async def _fork(self, host: str, args: list[str], log: str) -> ForkedProcess:
        """Fork the daemon from this process's fork server (into its emulated host's network, if any)."""
        netns = self.hosts.netns(host) if self.hosts is not None else None
        try:
            return await ForkServer.shared().spawn(args, env=self.env, log=log, netns=netns)
        except ForkServerExited:  # it ended (killed?) before its reader thread saw it: shared() starts another
            return await ForkServer.shared().spawn(args, env=self.env, log=log, netns=netns)

    async def _start_hosts(self) -> None:
        """Make the hosts (when the cluster owns them), write the config the daemons read there, and start the
        relay through which this process reaches the scheduler."""
        assert self.hosts is not None
        if self._own_hosts:
            await self.hosts.start_async()  # completes even if cancelled: stop() then removes it all
        address = {n.host: self.hosts.address(n.host) for n in self.cfg.nodes}
        self._hosts_dir = tempfile.mkdtemp(prefix="hmp-hosts-")
        derived = Path(self._hosts_dir) / Path(self.config_path).name
        derived.write_text(topology_on_hosts(self.config_path, self.cfg.nodes, address))
        s = job.load(derived).scheduler  # the daemons must accept it as it is
        self.config_path = str(derived)
        path = Path(self._hosts_dir) / "scheduler.sock"
        log = self._logs["status-relay"] = open(self.log_dir / "status-relay.log", "wb")  # noqa: SIM115
        self._relay = await asyncio.create_subprocess_exec(
            *self.hosts.command(self.cfg.scheduler.host, [sys.executable, "-m", "hmp.launcher.relay", str(path),
                                                          s.advertise or s.bind]),
            stdin=asyncio.subprocess.PIPE, stdout=log, stderr=asyncio.subprocess.STDOUT, env=self.env,
            start_new_session=True)
        self._scheduler_address = f"ipc://{path}"

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one daemon (tests use it to crash a node)."""
        self.procs[node_id].send_signal(sig)

    async def _stop_daemons(self) -> None:
        if self._relay is not None and self._relay.stdin is not None:
            self._relay.stdin.close()  # the relay exits at the end of its input
            await terminate([self._relay], 3.0, sig=None)
        await terminate(self.procs.values(), self.grace_s)

    def _release(self) -> None:
        """Close the logs; emulated hosts the cluster made are removed with whatever still runs in them."""
        for f in self._logs.values():
            f.close()
        self._logs.clear()
        if self.hosts is not None and self._own_hosts:
            self.hosts.close()  # blocking on purpose: it must happen even if this task is cancelled again
        if self._hosts_dir is not None:
            shutil.rmtree(self._hosts_dir, ignore_errors=True)
            self._hosts_dir = None
