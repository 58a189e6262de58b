"""Run a whole topology on this machine from Python: the API behind ``hmp-launch``.

    async with hmp.LocalCluster("conf/local.toml") as cluster:
        report = await cluster.train()

Every daemon is its own OS process (what ``python -m hmp.nodes.main ROLE --config F --id N`` runs, forked from
a server that has imported torch once: :mod:`hmp.nodes.forkserver`; on emulated hosts each enters its host's
network namespace after the fork; ``HMP_FORKSERVER=0`` execs each), its log in
``<report_dir>/logs/<id>.log``. ``train()`` watches them: if a PS shard or the scheduler exits non-zero the
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
reach those addresses, so ``status()`` and ``finish()`` go through a small relay process started in the
scheduler's host (:data:`_RELAY`: JSON lines on its stdin and stdout). Hosts the cluster started
(given as a path, or an instance not yet started) are removed with everything in them at ``stop()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from hmp import job
from hmp.config import WORKER_ROLES, Config, Role
from hmp.emulate import EmulatedHosts, check_placement, topology_on_hosts
from hmp.errors import ConfigError, HmpError, RequestTimeout
from hmp.messages import Shutdown, Status
from hmp.metrics import check_ports, read_urls
from hmp.nodes.forkserver import ForkedProcess, ForkServer, ForkServerExited
from hmp.nodes.forkserver import enabled as forkserver_enabled
from hmp.transport import security
from hmp.transport.endpoint import Client
from hmp.transport.shm import cleanup_stale

_log = structlog.get_logger("hmp").bind(role="launcher")

START_ORDER = tuple(Role)  # scheduler, ps, cpu_worker, gpu_worker

#: ``start()`` waits at most this long for the daemons' metrics URLs ([metrics] enabled) before going on
#: without the missing ones (logged).
METRICS_URL_WAIT_S = 30.0

#: The status relay on emulated hosts: ``python -c _RELAY SCHEDULER_ADDRESS KEY_DIR HANDSHAKE_TIMEOUT_S`` inside
#: the scheduler's host (``KEY_DIR``: the absolute key folder, whose ``launcher`` key it dials with, when
#: CURVE is on; "" when off). It prints ``{"ready": true}``, then answers each request line ``{"id", "op":
#: "status" | "finish", "timeout_s", "reason"}`` with ``{"id", "state"}`` or ``{"id", "error", "timeout"}``;
#: it exits at the end of its stdin (the launcher closed it, or died).
_RELAY = r"""
import asyncio, json, os, sys
out = os.fdopen(os.dup(1), "w")  # the channel to the launcher; anything else printed goes to stderr
os.dup2(2, 1)
from hmp.errors import HmpError, RequestTimeout
from hmp.messages import Shutdown, Status
from hmp.transport.endpoint import Client
from hmp.transport.security import Curve

async def main(address, key_dir, handshake_timeout_s):
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    curve = False
    if key_dir:
        curve = Curve.load(key_dir, "launcher", serve=False, handshake_timeout_s=float(handshake_timeout_s))
    client = Client(address, name="launcher", timeout_s=5.0, job_token=os.environ.get("HMP_JOB_TOKEN", ""),
                    security=curve)
    await client.connect()
    out.write('{"ready": true}\n'); out.flush()
    try:
        while line := await reader.readline():
            req = json.loads(line)
            reply = {"id": req["id"]}
            try:
                if req["op"] == "status":
                    r = await client.request(Status(), timeout_s=req["timeout_s"])
                    reply["state"] = r.state if isinstance(r, Status) else None
                else:
                    await client.request(Shutdown(reason=req["reason"], finish=True), timeout_s=req["timeout_s"])
            except HmpError as exc:
                reply.update(error=f"{type(exc).__name__}: {exc}", timeout=isinstance(exc, RequestTimeout))
            out.write(json.dumps(reply, default=str) + "\n"); out.flush()
    finally:
        await client.close()

asyncio.run(main(*sys.argv[1:4]))
"""


class JobFailed(HmpError):
    """A daemon exited non-zero (or the job timed out); ``node`` names it, ``log_tail`` shows why."""

    def __init__(self, message: str, node: str = "", log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- last lines of {node}'s log ---\n{log_tail}" if log_tail else ""))
        self.node, self.log_tail = node, log_tail


class LocalCluster:
    """Starts, watches and stops every daemon of ``config`` on this host."""

    def __init__(self, config: Config | str | os.PathLike, *, config_path: str | None = None,
                 env: dict[str, str] | None = None, resume: bool = False, grace_s: float = 10.0,
                 hosts: EmulatedHosts | str | os.PathLike | None = None) -> None:
        self.cfg = config if isinstance(config, Config) else job.load(config)
        self.config_path = config_path or self.cfg.path
        #: emulated hosts the daemons run on (None: this machine's own network); a hosts file is loaded here,
        #: its namespaces are made by start()
        self.hosts: EmulatedHosts | None = None
        self._own_hosts = False
        self._hosts_dir: str | None = None  # the derived config's folder, removed by stop()
        self._scheduler_address = ""
        self._relay: asyncio.subprocess.Process | None = None
        self._relay_ready = False
        self._relay_rid = 0
        self._relay_lock = asyncio.Lock()  # one request at a time on the relay's pipes
        if hosts is not None:
            self.hosts = hosts if isinstance(hosts, EmulatedHosts) else EmulatedHosts.from_file(hosts)
            self._own_hosts = not self.hosts.started
            check_placement(self.cfg.nodes, self.hosts.names, self.config_path, self.hosts.source)
        check_ports(self.cfg, emulated=self.hosts is not None)  # a fixed metrics port: one daemon per host
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # The job's identity: every daemon started here gets it (hmp.job.with_env reads HMP_JOB_TOKEN) and
        # refuses messages without it, so that a second job on the same ports cannot join this one.
        self.job_token = self.env.get("HMP_JOB_TOKEN") or self.cfg.job.token or secrets.token_hex(16)
        self.env["HMP_JOB_TOKEN"] = self.job_token
        self.cfg = self.cfg.replace(job=dataclasses.replace(self.cfg.job, token=self.job_token))
        # With [security] curve, this process's own requests (status, finish) go with the launcher's key
        # (a missing key file is a ConfigError here, before any daemon starts); None: plain.
        self._launcher_security = security.from_config(self.cfg, "launcher", serve=False)
        self.resume = resume
        self.grace_s = grace_s
        bad = {r: n for r, n in self.cfg.job.restarts.items() if r not in (*WORKER_ROLES, Role.PS) and n}
        if bad:
            raise ConfigError(self.cfg.path, "job.restarts",
                              f"restart counts for {', '.join(sorted(WORKER_ROLES))} and ps only: restarting "
                              f"the scheduler mid-job is not supported yet; got "
                              f"{', '.join(f'{r} = {n}' for r, n in sorted(bad.items()))}")
        #: restarts of crashed workers so far, one ``{node, t, exit_code, attempt, log}`` each (``t``: seconds
        #: since start())
        self.restarts: list[dict[str, Any]] = []
        #: workers that exited non-zero and were not restarted: ``{node: exit code}``
        self.worker_exits: dict[str, int] = {}
        self._restarts_left = {n.id: int(self.cfg.job.restarts.get(n.role, 0))
                               for n in (*self.cfg.workers, *self.cfg.shards)}
        self._log_paths: dict[str, Path] = {}
        self._t_start = time.monotonic()
        self._stopping = False
        self.procs: dict[str, asyncio.subprocess.Process | ForkedProcess] = {}
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
        self._t_start = time.monotonic()
        cleanup_stale(self.cfg.job.name, self.cfg.shm.dir)  # shared memory left by this job's killed daemons
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
            return
        cmd = [sys.executable, "-m", "hmp.nodes.main", *args]
        if self.hosts is not None:
            cmd = self.hosts.command(node.host, cmd)  # `ip netns exec` execs the daemon: same pid
        if node.id in self._logs:
            self._logs.pop(node.id).close()
        logf = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self._logs[node.id] = logf
        # A new session: a Ctrl-C on the terminal reaches the launcher only, which stops
        # the daemons in order instead of all of them dying at once.
        self.procs[node.id] = await asyncio.create_subprocess_exec(
            *cmd, stdout=logf, stderr=asyncio.subprocess.STDOUT, env=self.env, start_new_session=True)

    async def _restart_node(self, node_id: str, code: int) -> bool:
        """Start a crashed worker or shard again if its role's ``[job] restarts`` allows and the job still runs."""
        scheduler = self.procs.get(self.cfg.scheduler.id)
        if self._stopping or self._restarts_left.get(node_id, 0) < 1 or scheduler is None \
                or scheduler.returncode is not None:
            return False
        self._restarts_left[node_id] -= 1
        attempt = sum(1 for r in self.restarts if r["node"] == node_id) + 1
        await self._start_node(node_id, log_name=f"{node_id}.{attempt}.log",
                               resume=self.cfg.node(node_id).role == Role.PS)
        entry = {"node": node_id, "t": round(time.monotonic() - self._t_start, 3), "exit_code": code,
                 "attempt": attempt, "log": str(self._log_paths[node_id])}
        self.restarts.append(entry)
        _log.warning("node_restarted", **entry, restarts_left=self._restarts_left[node_id])
        return True

    async def _fork(self, host: str, args: list[str], log: str) -> ForkedProcess:
        """Fork the daemon from this process's fork server (into its emulated host's network, if any)."""
        netns = self.hosts.netns(host) if self.hosts is not None else None
        try:
            return await ForkServer.shared().spawn(args, env=self.env, log=log, netns=netns)
        except ForkServerExited:  # it ended (killed?) before its reader thread saw it: shared() starts another
            return await ForkServer.shared().spawn(args, env=self.env, log=log, netns=netns)

    async def _start_hosts(self) -> None:
        """Make the hosts (when the cluster owns them) and write the config the daemons read there."""
        assert self.hosts is not None
        if self._own_hosts:
            await self.hosts.start_async()  # completes even if cancelled: stop() then removes it all
        address = {n.host: self.hosts.address(n.host) for n in self.cfg.nodes}
        self._hosts_dir = tempfile.mkdtemp(prefix="hmp-hosts-")
        derived = Path(self._hosts_dir) / Path(self.config_path).name
        derived.write_text(topology_on_hosts(self.config_path, self.cfg.nodes, address))
        derived_cfg = job.load(derived)  # the daemons must accept it as it is
        s = derived_cfg.scheduler
        self._scheduler_address = s.advertise or s.bind
        self.config_path = str(derived)

    def log_tail(self, node_id: str, lines: int = 15) -> str:
        p = self._log_paths.get(node_id) or self.log_dir / f"{node_id}.log"
        try:
            return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def status(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The scheduler's status, or None if it does not answer. Every poll goes through one socket."""
        if self.hosts is not None:
            reply = await self._relay_request({"op": "status"}, timeout_s, ready_s=timeout_s)
            return reply.get("state") if reply and "error" not in reply else None
        if self._status_client is None:
            s = self.cfg.scheduler
            self._status_client = Client(s.advertise or s.bind, name="launcher", timeout_s=timeout_s,
                                         job_token=self.job_token, security=self._launcher_security or False)
            await self._status_client.connect()
        try:
            reply = await self._status_client.request(Status(), timeout_s=timeout_s)
        except HmpError:
            return None
        return reply.state if isinstance(reply, Status) else None

    async def wait(self, timeout_s: float | None = None,
                   progress: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 1.0) -> None:
        """Wait until every daemon has exited; raise JobFailed at the first non-zero exit of a shard or the
        scheduler. A worker's non-zero exit restarts it (``[job] restarts``) or is left to the scheduler's
        judgement (``[train] min_workers``); JobFailed then names the first such worker."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waits = {asyncio.create_task(p.wait()): nid for nid, p in self.procs.items()}
        try:
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    nid, code = waits[t], t.result()
                    if code == 0:
                        continue
                    if self.cfg.node(nid).role == Role.PS and await self._restart_node(nid, code):
                        t2 = asyncio.create_task(self.procs[nid].wait())  # it resumes from its checkpoint
                        waits[t2] = nid
                        pending.add(t2)
                        continue
                    if self.cfg.node(nid).role == Role.PS and self.cfg.ps.replicas > 1:
                        _log.warning("shard_exited", node=nid, exit_code=code,
                                     note="its backup takes over ([ps] replicas = 2); the scheduler judges")
                        continue
                    if self.cfg.node(nid).role in WORKER_ROLES:
                        if await self._restart_node(nid, code):
                            t2 = asyncio.create_task(self.procs[nid].wait())
                            waits[t2] = nid
                            pending.add(t2)
                        else:
                            self.worker_exits.setdefault(nid, code)
                            _log.warning("worker_exited", node=nid, exit_code=code,
                                         note="the job goes on while [train] min_workers remain")
                        continue
                    if self.worker_exits:  # the job failed after (likely: because) a worker died
                        first, first_code = next(iter(self.worker_exits.items()))
                        raise JobFailed(f"daemon {first} exited with code {first_code}, then {nid} with code {code}",
                                        first, self.log_tail(first) + f"\n--- last lines of {nid}'s log ---\n"
                                        + self.log_tail(nid))
                    raise JobFailed(f"daemon {nid} exited with code {code}", nid, self.log_tail(nid))
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
        if self.hosts is not None:
            # The relay's first start (it imports torch) may take a while on a busy machine.
            reply = await self._relay_request({"op": "finish", "reason": reason}, timeout_s, ready_s=timeout_s + 60)
            if reply is None or reply.get("timeout"):
                raise RequestTimeout(f"no answer from the scheduler at {self._scheduler_address} to finish "
                                     f"within {timeout_s} s" + (f" ({reply['error']})" if reply else ""))
            if "error" in reply:
                raise HmpError(f"finish through the status relay failed: {reply['error']}")
            return
        await self.status(timeout_s=timeout_s)  # opens the one launcher socket
        assert self._status_client is not None
        await self._status_client.request(Shutdown(reason=reason, finish=True), timeout_s=timeout_s)

    async def _relay_request(self, request: dict[str, Any], timeout_s: float, ready_s: float) -> dict[str, Any] | None:
        """One request through the status relay (started on first use); None when the relay is not ready
        within ``ready_s`` or does not answer within ``timeout_s`` (a late answer is skipped later)."""
        async with self._relay_lock:
            return await self._relay_request_locked(request, timeout_s, ready_s)

    async def _relay_request_locked(self, request: dict[str, Any], timeout_s: float,
                                    ready_s: float) -> dict[str, Any] | None:
        assert self.hosts is not None
        if self._relay is None:
            curve = self._launcher_security
            argv = self.hosts.command(self.cfg.scheduler.host, [
                sys.executable, "-c", _RELAY, self._scheduler_address, str(curve.key_dir.resolve()) if curve else "",
                str(curve.handshake_timeout_s if curve else 0.0)])
            logf = self._logs.get("status-relay") or open(self.log_dir / "status-relay.log", "wb")  # noqa: SIM115
            self._logs["status-relay"] = logf  # closed in stop()
            self._relay = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=logf, env=self.env,
                start_new_session=True)
            self._relay_ready = False
        relay = self._relay
        assert relay.stdin is not None and relay.stdout is not None
        try:
            if not self._relay_ready:
                await self._relay_read(lambda m: bool(m.get("ready")), ready_s)
                self._relay_ready = True
            self._relay_rid += 1
            rid = self._relay_rid
            relay.stdin.write((json.dumps({**request, "id": rid, "timeout_s": timeout_s}) + "\n").encode())
            await relay.stdin.drain()
            return await self._relay_read(lambda m: m.get("id") == rid, timeout_s + 2.0)
        except TimeoutError:
            return None
        except (ConnectionError, EOFError):  # the relay died: the next request starts another
            await self._stop_relay()
            return None

    async def _relay_read(self, wanted: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """The relay's next line that is ``wanted`` (earlier ones: answers to requests given up on)."""
        assert self._relay is not None and self._relay.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            line = await asyncio.wait_for(self._relay.stdout.readline(), max(0.0, deadline - time.monotonic()))
            if not line:
                raise EOFError("status relay exited")
            msg = json.loads(line)
            if wanted(msg):
                return msg

    async def _stop_relay(self) -> None:
        relay, self._relay = self._relay, None
        if relay is None:
            return
        if relay.stdin is not None:
            relay.stdin.close()  # the relay exits at the end of its input
        try:
            await asyncio.wait_for(relay.wait(), 3.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                relay.kill()
            await relay.wait()

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one daemon (tests use it to crash a node)."""
        self.procs[node_id].send_signal(sig)

    async def stop(self) -> None:
        """Stop every daemon still running: SIGTERM, then SIGKILL after the grace period. Emulated hosts
        the cluster made are then removed with whatever still runs in them, also when this is cancelled."""
        self._stopping = True  # no more restarts
        try:
            if self._status_client is not None:
                client, self._status_client = self._status_client, None
                await client.close()
            await self._stop_relay()
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
        finally:
            for f in self._logs.values():
                f.close()
            self._logs.clear()
            if self.hosts is not None and self._own_hosts:
                self.hosts.close()  # blocking on purpose: it must happen even if this task is cancelled again
            if self._hosts_dir is not None:
                shutil.rmtree(self._hosts_dir, ignore_errors=True)
                self._hosts_dir = None
            cleanup_stale(self.cfg.job.name, self.cfg.shm.dir)  # a killed daemon's segments (docs/shm.md)
