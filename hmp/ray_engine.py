"""Run a topology's daemons on a Ray cluster: the engine behind ``hmp-launch --engine ray`` (docs/ray.md).

    async with hmp.ray_engine.RayCluster("conf/local.toml", address="auto") as cluster:
        report = await cluster.train()

Each daemon is what ``python -m hmp.nodes.main ROLE --config F --id N`` runs, as a process owned by one Ray
actor (:class:`~hmp.launcher.ray_actor.DaemonActor`; between them a small keeper process,
:mod:`hmp.launcher.keeper`): the daemon code is the same as under :class:`hmp.cluster.LocalCluster`, so is the
lifecycle (both are a :class:`hmp.launcher.base.Launcher`), and the daemon gets ``PR_SET_PDEATHSIG`` so that
it stops (SIGTERM, gracefully) when its actor dies, however it dies.
An actor asks Ray for what its node's config asks for: ``num_cpus`` = ``threads``, ``num_gpus = 1`` for a
``gpu_worker`` on CUDA, and, for a node whose ``host`` is not this machine (``127.0.0.1``), either Ray's own
``node:<ip>`` resource (``host`` is a Ray node's IP) or the custom resource ``hmp_host:<host>`` (declared with
``ray start --resources '{"hmp_host:<host>": 100}'``). The PS shards go into one placement group, one bundle
each, strategy SPREAD.

Addresses are learnt, never guessed: every daemon binds ``tcp://<its Ray node's IP>:0``; the scheduler's
actor reads the address the scheduler bound (from its ``--ready-file``, written once it serves) and the other
daemons get it in their config, then report their own address when they join. Each daemon reads a config
derived from the job's (:func:`derived_config`) in which paths are absolute; the same absolute paths must exist
on every Ray node (a shared file system, or the same layout everywhere).

Logs: each daemon writes its structured log to ``<report_dir>/logs/<id>.log`` on its Ray node; for a node
that does not share this driver's file system, the driver pulls the lines into the same path here at each
poll, so the logs of the whole job are where the driver runs. So is the report: the scheduler's report
files are copied here when the scheduler's node is elsewhere, and ``report.json`` gets a ``ray`` section
(the Ray nodes each daemon ran on, and the daemons lost with Ray's error).

Metrics (``[metrics] enabled``): each daemon serves its Prometheus endpoint on its node (:mod:`hmp.metrics`), and
its actor reads it every ``metrics_interval_s`` and records the same metrics through ``ray.util.metrics``
(:class:`~hmp.launcher.ray_actor.RayMetrics`), so that Ray's metrics agent and dashboard have them; the daemon
never imports Ray.

Failures come from Ray: an actor that dies (``ray.kill``, its node lost) is a lost node: for a worker the job
goes on without it while ``[train] min_workers`` remain (``[job] restarts`` are refused under Ray for now); a
lost shard (unless ``[ps] replicas = 2``) or scheduler fails the job (:class:`~hmp.launcher.base.JobFailed`,
with Ray's error). ``stop()`` stops every daemon (SIGTERM through its actor), kills every actor, removes the
placement group, and shuts down the Ray instance it started. Nothing is detached: when the driver dies, Ray kills its
actors, and their daemons follow.

Without ``address`` (and no Ray running in this process) a local Ray instance is started, sized to this
machine: its CPUs (at least what the topology asks for, as the local launcher also lets daemons share the
cores), its GPUs, and every ``host`` the config names, since this machine stands for all of them.
Importing this module needs Ray (``pip install "hmp[ray]"``); nothing else in hmp imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tomllib
from pathlib import Path
from typing import Any

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _exc:  # an optional extra: say how to get it
    raise ImportError(f"the Ray engine needs Ray: pip install \"hmp[ray]\" ({_exc})") from _exc

import structlog

from hmp.config import WORKER_ROLES, Config, Role
from hmp.emulate import dumps_toml
from hmp.errors import ConfigError
from hmp.launcher.base import JobFailed, Launcher
from hmp.launcher.ray_actor import LOG_CHUNK_BYTES, DaemonActor, RayMetrics, parse_metrics_text

__all__ = ["DaemonActor", "RayCluster", "RayMetrics", "derived_config", "host_resources", "init_ray",
           "parse_metrics_text"]

# Lazy (bound at first use): this module may be imported before hmp-launch configures logging.
_log = structlog.get_logger("hmp", role="launcher", engine="ray")

#: Custom Ray resource a node must hold for daemons whose ``host`` is ``<host>`` (not an IP of a Ray node).
HOST_RESOURCE = "hmp_host:{host}"
#: How much of a host resource each daemon takes: any node declaring the resource takes thousands of daemons.
HOST_AMOUNT = 0.001
#: ``host`` values that mean "wherever Ray puts it" (the config's default is this machine's loopback).
ANY_HOST = frozenset({"", "127.0.0.1", "localhost", "::1"})
#: Object store of a local Ray instance: nothing but small control messages go through it.
LOCAL_OBJECT_STORE_BYTES = 100 * 1024 * 1024
#: Seconds between two reads of a daemon's metrics endpoint by its actor (``[metrics] enabled`` under Ray), which records
#: them through ``ray.util.metrics``; Ray's own export to its metrics agent runs every ``metrics_report_interval_ms``
#: (10 s by default), so a shorter period adds nothing there.
METRICS_INTERVAL_S = 5.0
#: start() waits this long for each daemon's metrics URL (it writes it just after it serves).
METRICS_URL_WAIT_S = 10.0


def init_ray(**kwargs: Any) -> None:
    """``ray.init`` (no dashboard, no logs to the driver) keeping this process's SIGINT and SIGTERM handlers: Ray's
    own SIGTERM handler exits at once, the caller's (hmp-launch, hmp-manager: stop every daemon first) stays."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.init(**{"include_dashboard": False, "log_to_driver": False, "configure_logging": False, **kwargs})
    finally:
        for s, h in saved.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(s, h)


def host_resources(host: str, node_ips: set[str]) -> dict[str, float]:
    """The Ray resources that pin a daemon to ``host``: none for this machine's loopback (anywhere will do),
    Ray's ``node:<ip>`` for a Ray node's IP, else :data:`HOST_RESOURCE`."""
    if host in ANY_HOST:
        return {}
    if host in node_ips:
        return {f"node:{host}": HOST_AMOUNT}
    return {HOST_RESOURCE.format(host=host): HOST_AMOUNT}


def derived_config(config_path: str | os.PathLike, nodes: list[Any], ips: dict[str, str], scheduler_address: str,
                   report_dir: Path, checkpoint_dir: str) -> str:
    """The config file as the daemons on Ray read it: node ``id`` binds ``tcp://<ips[id]>:0`` (a node not in
    ``ips`` keeps its bind; the scheduler binds ``tcp://<ip>:*``), the scheduler is dialled at ``scheduler_address`` ("" in the scheduler's own
    copy: it binds port 0 and reports what it got), and every relative path is made absolute: data files and
    ``[security] key_dir`` relative to the config file's folder, ``report_dir`` and ``checkpoint_dir`` to this
    process's working directory."""
    path = Path(config_path)
    raw = tomllib.loads(path.read_text())
    raw_nodes = raw.get("nodes", [])
    if [n.get("id") for n in raw_nodes] != [n.id for n in nodes]:
        raise ConfigError(str(path), "nodes", "the nodes of the loaded config (the file changed since it was loaded)")
    for table, n in zip(raw_nodes, nodes):
        if n.id in ips:
            # ZeroMQ's wildcard port: the OS picks one, as with port 0, which the config refuses for the
            # scheduler (peers could not find it); here the peers learn it from the scheduler's actor instead.
            table["bind"] = f"tcp://{ips[n.id]}:{'*' if n.role == 'scheduler' else 0}"
            table["advertise"] = ""
        if n.role == "scheduler" and scheduler_address:
            table["bind"] = table["advertise"] = scheduler_address
    data = raw.get("data", {})
    for table, key in ((data, "path"), (data, "test_path"), (raw.get("security", {}), "key_dir")):
        if table.get(key) and not Path(table[key]).is_absolute():
            table[key] = str(path.resolve().parent / table[key])
    job_table = raw.setdefault("job", {})
    job_table["report_dir"] = str(report_dir.resolve())
    if checkpoint_dir:
        raw.setdefault("ps", {})["checkpoint_dir"] = str(Path(checkpoint_dir).resolve())
    return f"# {path} as the daemons on Ray read it (hmp.ray_engine)\n" + dumps_toml(raw)



class RayCluster(Launcher):
    """Starts, watches and stops every daemon of ``config`` as Ray actors; :class:`hmp.cluster.LocalCluster`'s
    interface (``async with``, ``train``, ``wait``, ``status``, ``finish``, ``kill``, ``stop``, ``restarts``,
    ``worker_exits``), from the same :class:`~hmp.launcher.base.Launcher`.

    ``address``: a Ray cluster to join (``"auto"``, ``"10.0.0.1:6379"``, ``"ray://..."``); None: the Ray
    instance this process already runs, else a local one sized to this machine (shut down by :meth:`stop`).
    ``ray_init``: extra ``ray.init`` arguments for a local instance. ``metrics_interval_s``: with ``[metrics]
    enabled``, how often each actor records its daemon's metrics through Ray's (:class:`RayMetrics`).
    ``num_cpus``: role -> ``num_cpus`` of its actors instead of ``threads`` (the job manager runs a ring job's
    scheduler with 0: its slots are the workers' CPUs)."""

    def __init__(self, config: Config | str | os.PathLike, *, address: str | None = None,
                 env: dict[str, str] | None = None, resume: bool = False, grace_s: float = 10.0,
                 ray_init: dict[str, Any] | None = None, metrics_interval_s: float = METRICS_INTERVAL_S,
                 num_cpus: dict[str, float] | None = None) -> None:
        super().__init__(config, env=env, resume=resume, grace_s=grace_s)
        self.address = address
        self.ray_init = dict(ray_init or {})
        self.metrics_interval_s = metrics_interval_s
        self.num_cpus = dict(num_cpus or {})
        bad = {r: n for r, n in self.cfg.job.restarts.items() if n}
        if bad:
            raise ConfigError(self.cfg.path, "job.restarts",
                              f"no restarts under Ray yet (a lost worker's share goes to the others while [train] "
                              f"min_workers remain; a shard resumes from a checkpoint on the node that wrote it); "
                              f"got {', '.join(f'{r} = {n}' for r, n in sorted(bad.items()))}")
        users = [n.id for n in self.cfg.by_role(Role.USER_WORKER)]
        if users:
            raise ConfigError(self.cfg.path, "nodes", f"no user_worker under Ray yet (its loop runs in your own "
                                                      f"process, docs/own_loop.md); found {users}")
        #: where each daemon runs: ``{node: {ip, hostname, ray_node, address, pid, log}}``
        self.placement: dict[str, dict[str, Any]] = {}
        #: ``[metrics] enabled``: ``{node: URL}`` of each daemon's endpoint (on its Ray node), known after start()
        self.metrics_urls: dict[str, str] = {}
        self._log_offsets: dict[str, int] = {}
        self._pg: Any = None
        self._own_ray = False
        self._scheduler_address = ""  # learnt from the scheduler's actor once it serves
        self._marker = self.log_dir / f".ray-driver-{self.job_token[:12]}"

    def _daemon_env(self, environ: dict[str, str]) -> dict[str, str]:
        # Only hmp's own variables travel to the daemons: the rest of this process's environment (PATH, a virtual
        # environment's) may not mean anything on another Ray node, whose actors have their own.
        return {**{k: v for k, v in environ.items() if k.startswith("HMP_")}, "PYTHONUNBUFFERED": "1"}

    @property
    def actors(self) -> dict[str, Any]:
        """Each daemon's Ray actor, by node id."""
        return self.daemons

    # ------------------------------------------------------------------------------------------- starting

    def _connect(self) -> None:
        """Join the Ray cluster at ``address``, use this process's, or start a local one sized to this machine."""
        if ray.is_initialized():
            return
        if self.address is not None:
            init_ray(address=self.address)
            return
        wanted = sum(n.threads for n in self.cfg.nodes)
        hosts = {n.host for n in self.cfg.nodes} - ANY_HOST
        kwargs = {"num_cpus": max(os.cpu_count() or 1, wanted), "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
                  "resources": {HOST_RESOURCE.format(host=h): 1000.0 for h in sorted(hosts)}, **self.ray_init}
        init_ray(**kwargs)
        self._own_ray = True
        _log.info("ray_started", cpus=kwargs["num_cpus"], hosts=sorted(hosts),
                  note="a local Ray instance: this machine stands for every host the config names")

    def _options(self, node: Any, node_ips: set[str]) -> dict[str, Any]:
        """``DaemonActor.options`` for ``node``: its CPUs, GPU and host (docs/ray.md, "Resources")."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus.get(str(node.role), node.threads),
                                "resources": host_resources(node.host, node_ips)}
        device = node.device or ("cuda" if node.role == Role.GPU_WORKER else "cpu")
        if node.role in WORKER_ROLES and device.startswith("cuda"):
            opts["num_gpus"] = 1
        return opts

    def _check_resources(self, node_ips: set[str]) -> None:
        """Every host resource a daemon asks for exists on some Ray node (else it would wait forever)."""
        have = ray.cluster_resources()
        for i, n in enumerate(self.cfg.nodes):
            for key in host_resources(n.host, node_ips):
                if key not in have:
                    hosts = sorted(k.split(":", 1)[1] for k in have if k.startswith("hmp_host:"))
                    raise ConfigError(self.cfg.path, f"nodes[{i}].host",
                                      f"a host of the Ray cluster: a Ray node's IP ({', '.join(sorted(node_ips))}) or "
                                      f"a name declared with `ray start --resources '{{\"hmp_host:{n.host}\": 100}}'` "
                                      f"(declared: {', '.join(hosts) or 'none'}); got {n.host!r}")

    async def start(self) -> None:
        self._begin()
        self._marker.write_text("a RayCluster driver runs here\n")
        self._connect()  # blocks this loop for a few seconds, before anything else runs on it
        node_ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        self._check_resources(node_ips)
        shards = self.cfg.shards
        if shards:
            bundles = []
            for s in shards:
                o = self._options(s, node_ips)
                bundles.append({"CPU": float(o["num_cpus"]), **o["resources"]})
            self._pg = placement_group(bundles, strategy="SPREAD", name=f"hmp-{self.cfg.job.name}-ps")
        sched = self.cfg.scheduler
        others = [n for n in self.cfg.nodes if n.id != sched.id]
        # Every daemon's process starts now and imports torch while the scheduler comes up; the others are told
        # its address once it serves.
        prepared = asyncio.gather(*(self._prepare_node(n.id, node_ips) for n in others))
        try:
            await self._prepare_node(sched.id, node_ips)
            await self._run_node(sched.id)
        except BaseException:
            prepared.cancel()
            await asyncio.gather(prepared, return_exceptions=True)
            raise
        await prepared
        await asyncio.gather(*(self._run_node(n.id) for n in others))
        if self.cfg.metrics.enabled:
            infos = await asyncio.gather(*(self.actors[nid].metrics_info.remote(METRICS_URL_WAIT_S)
                                           for nid in self.actors))
            self.metrics_urls = {nid: i["url"] for nid, i in zip(self.actors, infos) if i["url"]}

    async def _prepare_node(self, node_id: str, node_ips: set[str]) -> None:
        """Create ``node_id``'s actor where its resources are, and start its daemon's process there."""
        node = self.cfg.node(node_id)
        opts = self._options(node, node_ips)
        timeout_s = self.cfg.job.join_timeout_s
        if node.role == Role.PS:
            assert self._pg is not None
            try:
                await asyncio.wait_for(self._pg.ready(), timeout_s)
            except TimeoutError:
                raise JobFailed(f"Ray could not place the PS shards' placement group (one bundle per shard, "
                                f"SPREAD) within [job] join_timeout_s = {timeout_s} s; available: "
                                f"{ray.available_resources()}", node_id) from None
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=[s.id for s in self.cfg.shards].index(node_id))
        actor = self.actors[node_id] = DaemonActor.options(**opts).remote(node_id)
        try:
            info = await asyncio.wait_for(actor.node_info.remote(str(self._marker)), timeout_s)
        except TimeoutError:
            raise JobFailed(f"Ray did not start {node_id}'s actor within [job] join_timeout_s = {timeout_s} s: "
                            f"it asks for {opts.get('num_cpus')} CPUs, {opts.get('num_gpus', 0)} GPUs, "
                            f"{opts['resources'] or 'no other resources'}; available: "
                            f"{ray.available_resources()}", node_id) from None
        log = self._log_paths[node_id] = self.log_dir / f"{node_id}.log"
        self._log_offsets[node_id] = 0
        pid = await actor.prepare.remote(self.env, os.getcwd(), str(log.resolve()))
        self.placement[node_id] = {"ip": info["ip"], "hostname": info["hostname"], "ray_node": info["ray_node"],
                                   "shared_fs": info["shared"], "log": str(log), "pid": pid}

    async def _run_node(self, node_id: str) -> None:
        """Give ``node_id``'s prepared daemon its config (naming the scheduler's address) and wait until it serves."""
        node = self.cfg.node(node_id)
        placed = self.placement[node_id]
        is_scheduler = node.role == Role.SCHEDULER
        text = derived_config(self.config_path, list(self.cfg.nodes), {node_id: placed["ip"]},
                              "" if is_scheduler else self._scheduler_address, self.cfg.report_dir,
                              self.cfg.ps.checkpoint_dir)
        args = [node.role, "--id", node.id]
        if node.role in (Role.PS, Role.SCHEDULER) and self.resume:
            args.append("--resume")
        metrics = None
        if self.cfg.metrics.enabled:
            metrics = {"url_file": str(self.cfg.report_dir.resolve() / "metrics" / f"{node_id}.json"),
                       "tags": {"job": self.cfg.job.name}, "interval_s": self.metrics_interval_s}
        started = await self.actors[node_id].start.remote(text, args, self.cfg.job.join_timeout_s, metrics)
        placed.update(started)
        if "address" not in started:
            await self._pull_log(node_id)
            why = "did not serve within [job] join_timeout_s" if started["exit_code"] is None \
                else f"exited with code {started['exit_code']} before serving"
            raise JobFailed(f"daemon {node_id} on Ray node {placed['ip']} {why}", node_id, started["tail"])
        if is_scheduler:
            self._scheduler_address = started["address"]
        _log.info("daemon_started", node=node_id, host=node.host, ip=placed["ip"], hostname=placed["hostname"],
                  address=started["address"], pid=started["pid"], ray_node=placed["ray_node"][:12],
                  log=placed["log"] if placed["shared_fs"] else f"{placed['log']} (pulled from {placed['ip']})")

    # ------------------------------------------------------------------------------------------- watching

    async def _pull_log(self, node_id: str) -> None:
        """Copy the new part of a daemon's log from a node that does not share this file system."""
        placed, actor = self.placement.get(node_id), self.actors.get(node_id)
        if placed is None or placed.get("shared_fs") or actor is None:
            return
        with contextlib.suppress(ray.exceptions.RayError):
            while True:
                chunk = await actor.drain_log.remote(self._log_offsets[node_id])
                if not chunk:
                    return
                with open(self._log_paths[node_id], "ab") as f:
                    f.write(chunk)
                self._log_offsets[node_id] += len(chunk)
                if len(chunk) < LOG_CHUNK_BYTES:
                    return

    async def _poll(self) -> None:
        await asyncio.gather(*(self._pull_log(nid) for nid in self.actors))

    async def _exit_code(self, node_id: str) -> tuple[int | None, str]:
        return await self._await_exit(self.actors[node_id].wait.remote())

    def _alive(self, node_id: str) -> bool:
        return node_id in self.actors and node_id not in self._exits

    def kill(self, node_id: str) -> None:
        """Kill ``node_id``'s actor with ``ray.kill`` (its daemon then stops): a lost node, as a dead Ray node."""
        ray.kill(self.actors[node_id], no_restart=True)

    @staticmethod
    async def _await_exit(ref: Any) -> tuple[int | None, str]:
        try:
            return await ref, ""
        except ray.exceptions.RayError as exc:  # the actor died: Ray says why
            return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"

    async def _report(self) -> dict[str, Any]:
        report_dir = self.cfg.report_dir
        sched = self.cfg.scheduler.id
        if not self.placement.get(sched, {}).get("shared_fs", True):
            files = await self.actors[sched].report_files.remote(str(report_dir.resolve()))
            for name, data in files.items():
                (report_dir / name).write_bytes(data)
        path = report_dir / "report.json"
        report = json.loads(path.read_text())
        report["ray"] = {
            "address": ray.get_runtime_context().gcs_address,
            "nodes": {nid: {k: p.get(k) for k in ("ip", "hostname", "ray_node", "address", "pid", "log")}
                      for nid, p in self.placement.items()},
            "lost": self.lost,
        }
        if self.cfg.metrics.enabled:  # what each actor recorded through Ray's metrics (docs/metrics.md)
            infos = await asyncio.gather(*(self._await_exit(a.metrics_info.remote()) for a in self.actors.values()))
            report["ray"]["metrics"] = {nid: info for nid, (info, error) in zip(self.actors, infos) if not error}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(path)
        return report

    # ------------------------------------------------------------------------------------------- stopping

    def _release(self) -> None:
        """Kill every actor, remove the placement group, and shut down a Ray instance this cluster started."""
        if ray.is_initialized():
            for actor in self.actors.values():
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if self._pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(self._pg)
            self._pg = None
            if self._own_ray:
                ray.shutdown()
                self._own_ray = False
        self.actors.clear()
        with contextlib.suppress(OSError):
            self._marker.unlink()

    async def _stop_daemons(self) -> None:
        """SIGTERM each daemon through its actor (SIGKILL after the grace period); this job's shared memory on the
        other nodes."""
        if not ray.is_initialized():
            return
        live = {nid: a for nid, a in self.actors.items() if nid not in self._exits or self._exits[nid] is not None}
        stops = {nid: asyncio.ensure_future(self._await_exit(a.stop.remote(self.grace_s))) for nid, a in live.items()}
        if stops:
            await asyncio.wait(list(stops.values()), timeout=self.grace_s + 10)
        await asyncio.gather(*(self._pull_log(nid) for nid in live), return_exceptions=True)
        # Shared memory of this job on nodes other than this one (this one's: cleaned in stop()).
        here = ray.util.get_node_ip_address()
        by_ip: dict[str, Any] = {}
        for nid, a in live.items():
            p = self.placement.get(nid, {})
            if p.get("ip") and p["ip"] != here and not p.get("shared_fs"):
                by_ip.setdefault(p["ip"], a)
        cleanups = [asyncio.ensure_future(self._await_exit(a.cleanup_shm.remote(self.cfg.job.name, self.cfg.shm.dir)))
                    for a in by_ip.values()]
        if cleanups:
            await asyncio.wait(cleanups, timeout=30)
        for t in (*stops.values(), *cleanups):
            t.cancel()
