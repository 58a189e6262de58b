"""The job manager's asyncio shell: submissions in, ring jobs started on the slots the scheduler chose.

    async with hmp.JobManager(hosts="conf/hosts4x2.toml", scheduler="gadget") as m:
        handle = await m.submit("conf/jobs/digits_small.toml")
        result = await handle.wait()          # a JobResult: status, JCT, queueing delay, placement, ...

The state (slots, queue, running jobs) and every decision live in :class:`~hmp.manager.core.ManagerCore`;
this shell loads job files (:mod:`hmp.manager.spec`), turns the core's :class:`~hmp.manager.core.Start`
decisions into running jobs, and tells the core when a job ends. Each admitted job is a topology of its
own (a per-job scheduler daemon and one ``cpu_worker`` per slot, each on the host the placement names,
the scheduler on a port of its own) run by a :class:`~hmp.cluster.LocalCluster` on the manager's
:class:`~hmp.emulate.EmulatedHosts` (several clusters share them), or on this machine's loopback when
the manager does not emulate its hosts (they are then only slot counts); with ``hosts=RayInventory(...)``
(:mod:`hmp.manager.ray_inventory`) the hosts and slots are a Ray cluster's nodes and each job runs on them
through the Ray engine (:class:`~hmp.ray_engine.RayCluster`, each daemon pinned to the node its placement
names). A job that fails (a daemon exits non-zero, e.g. a killed worker) ends alone: its cluster stops
its daemons, its slots return to the core, the other jobs go on.

``bind=``: the manager also serves ``submit`` and ``status`` requests (hmp's transport, docs/protocol.md)
for ``hmp-submit``; a job file it cannot run is answered with an ``error`` (``bad_config``) naming the
file and key, and nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from hmp import job as job_mod
from hmp.cluster import LocalCluster
from hmp.emulate import EmulatedHosts, load_hosts
from hmp.errors import ConfigError, HmpError, RequestError
from hmp.gadget.interface import ClusterSpec, HostSpec, PendingJob, Scheduler
from hmp.gadget.model import ModelType, NetworkConstants, RingCostModel
from hmp.manager.core import ManagerCore, Start
from hmp.manager.ray_inventory import RayInventory
from hmp.manager.spec import JobSpec, load_job, loads_job, profile_compute_s, topology
from hmp.launcher import Service
from hmp.launcher.base import JobFailed, Launcher
from hmp.messages import Ack, Kind, Message, Status, Submit
from hmp.transport.endpoint import Server

log = structlog.get_logger("hmp.manager")

#: A job's states: queued -> running -> done | failed; stopped when the manager stops first.
QUEUED, RUNNING, DONE, FAILED, STOPPED = "queued", "running", "done", "failed", "stopped"


@dataclasses.dataclass
class JobResult:
    """One job's record; times are seconds on the manager's clock (0: the manager's start)."""

    job_id: str
    name: str
    path: str
    model_type: str
    status: str = QUEUED
    submit_s: float = 0.0
    start_s: float = float("nan")
    end_s: float = float("nan")
    placement: dict[str, int] = dataclasses.field(default_factory=dict)   # host -> workers
    #: node id -> {"host": placed on, "ran_in": the emulated host its process was seen in ("" on loopback); under
    #: Ray: the host of the Ray node its actor ran on, and "ray_node": that node's id}
    nodes: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    final_accuracy: float = float("nan")
    stop_reason: str = ""
    updates: int = 0
    iteration_s: float = float("nan")            # measured: median over the ring's workers of their mean step time
    predicted_iteration_s: float = float("nan")  # the cost model's, averaged over the job's run
    utility: float = float("nan")
    error: str = ""
    report_dir: str = ""

    @property
    def queue_s(self) -> float:
        """Queueing delay: submission to start."""
        return self.start_s - self.submit_s

    @property
    def jct_s(self) -> float:
        """Job completion time: submission to end."""
        return self.end_s - self.submit_s

    @property
    def workers(self) -> int:
        return sum(self.placement.values())

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(queue_s=self.queue_s, jct_s=self.jct_s, workers=self.workers)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


class JobHandle:
    """What :meth:`JobManager.submit` returns: the job's id, its live record, and ``await wait()``."""

    def __init__(self, result: JobResult, done: asyncio.Future) -> None:
        self.job_id = result.job_id
        self.result = result
        self._done = done

    async def wait(self, timeout_s: float | None = None) -> JobResult:
        """The job's result once it has ended (done, failed or stopped)."""
        await asyncio.wait_for(asyncio.shield(self._done), timeout_s)
        return self.result

    def done(self) -> bool:
        return self._done.done()


#: The cost model's network constants before any calibration: emulated hosts' loopback (shared memory
#: between workers of one host) moves about 1 GB/s; a shaped link gives about 90% of its rate to one ring.
DEFAULT_NETWORK = NetworkConstants(intra_host_bytes_s=1e9, hop_latency_s=5e-4, link_efficiency=0.9)


def cluster_spec(specs: list[Any], cores: float | None = None) -> ClusterSpec:
    """The scheduler's view of a hosts file's hosts: slots and link rate (Mbit/s -> bytes/s). ``cores``: the
    hosts are emulated on one machine with that many cores, which all their workers share (one compute pool,
    ``local``: docs/gadget.md); None: no shared compute in the model."""
    pool = "local" if cores is not None else None
    return ClusterSpec(tuple(HostSpec(s.name, s.slots, s.bandwidth_mbit * 1e6 / 8, pool) for s in specs),
                       (("local", float(cores)),) if cores is not None else ())


def make_scheduler(name: str, seed: int = 0) -> Scheduler:
    """A scheduler of :mod:`hmp.gadget.schedulers` by name (gadget, fifo, first_fit, random, tiresias, optimal)."""
    from hmp.gadget.schedulers import make_scheduler as make

    try:
        return make(name, seed=seed)
    except (KeyError, ValueError) as exc:
        raise ConfigError("--scheduler", "scheduler", f"a scheduler name known to hmp.gadget ({exc})") from None


class JobManager(Service):
    """Runs submitted ring jobs on the slots of ``hosts`` (module docstring).

    ``hosts``: a hosts file (``[[hosts]] slots``, docs/emulate.md), an :class:`EmulatedHosts` (one already
    started stays the caller's and may be shared), a :class:`~hmp.manager.ray_inventory.RayInventory` (a Ray
    cluster's nodes; the jobs run under Ray, with ``ray_options`` for each job's
    :class:`~hmp.ray_engine.RayCluster`), or None: one logical host ``local`` with ``slots`` slots on this
    machine's loopback. ``emulate``: with a hosts file, run the jobs on emulated hosts (needs root)
    or only count their slots and run on the loopback. ``scheduler``: a name (:func:`make_scheduler`) or a
    :class:`~hmp.gadget.interface.Scheduler`. ``cost``: the cost model the scheduler sees (and whose
    predictions the results carry); by default :data:`DEFAULT_NETWORK` on the hosts' links, and a job whose
    ``model_type`` it does not know adds it: the job's gradient bytes and batch size, and its compute time
    measured here once (:func:`~hmp.manager.spec.profile_compute_s`). ``overrides``: section keys set in every job (e.g. a shorter
    ``train.max_seconds`` for tests). ``on_event``: called with (event name, JobResult) on start and end.
    ``status_linger_s``: see :meth:`stop`.
    """

    def __init__(self, hosts: str | os.PathLike | EmulatedHosts | None = None, scheduler: str | Scheduler = "gadget",
                 *, emulate: bool = True, slots: int = 2, cost: RingCostModel | None = None,
                 run_dir: str | os.PathLike = "runs/jobs", bind: str | None = None, port_base: int = 47400,
                 grace_s: float = 5.0, overrides: Mapping[str, Mapping[str, Any]] | None = None,
                 on_event: Callable[[str, JobResult], None] | None = None, seed: int = 0,
                 ray_options: Mapping[str, Any] | None = None, status_linger_s: float = 1.5) -> None:
        self.emulated: EmulatedHosts | None = None
        self._own_hosts = False
        #: the Ray cluster whose nodes are the hosts (None: not under Ray), and each node's RayHost by name
        self.ray: RayInventory | None = None
        self.ray_hosts: dict[str, Any] = {}
        self.ray_options = dict(ray_options or {})
        if isinstance(hosts, RayInventory):
            self.ray = hosts
            try:
                ray_hosts = hosts.read()
            except ValueError as exc:
                hosts.close()
                raise ConfigError(hosts.source, "hosts", str(exc)) from None
            self.ray_hosts = {h.name: h for h in ray_hosts}
            self.hosts_source = hosts.source
            specs = ray_hosts  # name, slots, bandwidth_mbit: what cluster_spec reads
        elif hosts is None:
            from hmp.emulate import HostSpec as EmuSpec
            specs = [EmuSpec("local", slots=slots)]
            self.hosts_source = "<local>"
        elif isinstance(hosts, EmulatedHosts):
            specs, self.hosts_source = hosts.specs, hosts.source
            self.emulated, self._own_hosts = hosts, not hosts.started
        else:
            specs, _ = load_hosts(hosts)  # a bad hosts file: ConfigError naming file and key
            self.hosts_source = str(hosts)
            if emulate:
                self.emulated, self._own_hosts = EmulatedHosts.from_file(hosts), True
        self.cluster = cluster_spec(specs)
        self.host_names = [h.name for h in self.cluster.hosts]
        self.scheduler = make_scheduler(scheduler, seed) if isinstance(scheduler, str) else scheduler
        self.cost = cost if cost is not None else RingCostModel(self.cluster, [], DEFAULT_NETWORK)
        self.core = ManagerCore(self.cluster, self.scheduler, self.cost)
        self.run_dir = Path(run_dir).resolve()
        self.bind = bind
        self.address = ""
        self.grace_s = grace_s
        #: seconds the server still answers ``status`` at stop() after the jobs it ended are marked stopped (above
        #: ``hmp-submit --wait``'s poll interval, so that a waiting client sees them)
        self.status_linger_s = status_linger_s
        self.overrides = {k: dict(v) for k, v in (overrides or {}).items()}
        self.on_event = on_event
        self.results: dict[str, JobResult] = {}
        self.specs: dict[str, JobSpec] = {}
        self.clusters: dict[str, Launcher] = {}  # running jobs' launchers (tests kill workers with them)
        self._done: dict[str, asyncio.Future] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._ids = itertools.count(1)
        self._ports = itertools.count(0)
        self._ports_in_use: set[int] = set()
        self._port_base = port_base
        self._t0 = time.monotonic()
        self._server: Server | None = None
        self._stopping = False

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.emulated is not None and self._own_hosts:
            await self.emulated.start_async()  # completes even if cancelled: stop() then removes it all
        self._t0 = time.monotonic()
        if self.bind:
            self._server = Server(self.bind, {Kind.SUBMIT: self.on_submit, Kind.STATUS: self.on_status},
                                  name="job-manager")
            self.address = await self._server.start()
        log.info("manager_started", hosts=self.hosts_source, slots={h.name: h.slots for h in self.cluster.hosts},
                 scheduler=getattr(self.scheduler, "name", type(self.scheduler).__name__), address=self.address,
                 emulated=self.emulated is not None)

    async def stop(self) -> None:
        """Stop every job (each cluster stops its daemons: SIGTERM, then the grace period), then the hosts. The
        server answers ``status`` until every job is marked ``stopped`` and ``status_linger_s`` more, so that a
        waiting ``hmp-submit --wait`` sees its job's end instead of a silent manager; new submissions are
        refused from the start."""
        self._stopping = True
        try:
            ending = [jid for jid, r in self.results.items() if r.status in (QUEUED, RUNNING)]
            tasks = [t for t in self._tasks.values() if not t.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            now = self.now()
            for jid, r in self.results.items():
                if r.status == QUEUED:
                    r.status, r.error, r.end_s = STOPPED, "the manager stopped before the job started", now
                    self.core.withdraw(jid)
                fut = self._done.get(jid)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            if self._server is not None:
                if ending and self.status_linger_s > 0:
                    await asyncio.sleep(self.status_linger_s)
                server, self._server = self._server, None
                await server.close()
        finally:
            if self.emulated is not None and self._own_hosts:
                self.emulated.close()  # blocking on purpose: it must happen even if this task is cancelled again
            if self.ray is not None:
                self.ray.close()  # a Ray connection or instance the inventory made

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ submissions
    async def submit(self, job: str | os.PathLike | JobSpec) -> JobHandle:
        """Queue a job file (path) or a loaded :class:`JobSpec`; the scheduler runs at once.
        A job file that cannot run here raises :class:`ConfigError` (file, key, expected); nothing changes."""
        spec = job if isinstance(job, JobSpec) else await asyncio.to_thread(load_job, job)
        return await self._admit(spec)

    async def submit_text(self, text: str, path: str = "<submitted>") -> JobHandle:
        """Queue a job file given as its TOML text (``path`` names it in errors)."""
        return await self._admit(await asyncio.to_thread(loads_job, text, path))

    async def _admit(self, spec: JobSpec) -> JobHandle:
        if self._stopping:
            raise HmpError("the job manager is stopping")
        total = self.cluster.total_slots
        if spec.min_workers > total:
            raise ConfigError(spec.path, "submit.min_workers", f"at most the cluster's {total} worker slots "
                                                               f"({self.hosts_source}), got {spec.min_workers}")
        await self._know_model(spec)
        utility = spec.utility
        job_id = f"j{next(self._ids)}"
        now = self.now()
        # More workers than the cluster has can never be given: ask for all of them at most.
        pending = PendingJob(job_id=job_id, submit_s=now, model=spec.model_type, min_workers=spec.min_workers,
                             max_workers=min(spec.max_workers, total), requested_workers=min(spec.workers, total),
                             samples=spec.samples, utility=utility)
        result = JobResult(job_id=job_id, name=spec.name, path=spec.path, model_type=spec.model_type, submit_s=now,
                           report_dir=str(self.run_dir / job_id))
        self.results[job_id], self.specs[job_id] = result, spec
        self._done[job_id] = asyncio.get_running_loop().create_future()
        log.info("job_submitted", job=job_id, name=spec.name, path=spec.path, workers=spec.workers,
                 min_workers=spec.min_workers, max_workers=spec.max_workers)
        self._act(self.core.submit(pending, now))
        return JobHandle(result, self._done[job_id])

    async def _know_model(self, spec: JobSpec) -> None:
        """Teach the cost model a job's model type it does not know yet (see the class docstring)."""
        if spec.model_type in self.cost.models:
            known = self.cost.models[spec.model_type]
            if (known.grad_bytes, known.local_bsz) != (spec.grad_bytes, spec.batch_size):
                raise ConfigError(spec.path, "submit.model_type",
                                  f"a model type name of its own: {spec.model_type!r} is already a model of "
                                  f"{known.grad_bytes:.0f} gradient bytes and batch size {known.local_bsz}, this job's "
                                  f"has {spec.grad_bytes} and {spec.batch_size}")
            return
        compute_s = await asyncio.to_thread(profile_compute_s, spec)
        self.cost = self.cost.with_models([ModelType(spec.model_type, float(spec.grad_bytes), compute_s, spec.batch_size)])
        self.core.cost = self.cost
        log.info("model_type_added", model_type=spec.model_type, grad_bytes=spec.grad_bytes, compute_s=compute_s,
                 batch_size=spec.batch_size)

    # ------------------------------------------------------------------ running jobs
    def _act(self, starts: list[Start]) -> None:
        for r in self.core.refused:
            log.warning("placement_refused", job=r.job_id, placement=list(r.placement), reason=r.reason)
        self.core.refused.clear()
        for s in starts:
            self._tasks[s.job_id] = asyncio.get_running_loop().create_task(self._run(s), name=f"job-{s.job_id}")

    def _port(self) -> int:
        """A scheduler port no running job uses (each job's rendezvous point): the next of 1000 in turn."""
        for _ in range(1000):
            port = self._port_base + next(self._ports) % 1000
            if port not in self._ports_in_use:
                break
        self._ports_in_use.add(port)
        return port

    async def _run(self, start: Start) -> None:
        jid = start.job_id
        result, spec = self.results[jid], self.specs[jid]
        result.status, result.start_s = RUNNING, self.now()
        result.placement = {h: n for h, n in zip(self.host_names, start.placement) if n}
        result.predicted_iteration_s = start.predicted_iteration_s
        self._event("job_started", result)
        cluster: Launcher
        port = 0
        try:
            job_dir = self.run_dir / jid
            job_dir.mkdir(parents=True, exist_ok=True)
            port = self._port()
            text = topology(spec, job_name=f"{spec.name}-{jid}", placement=result.placement, port=port,
                            report_dir=job_dir, extra=self.overrides)
            path = job_dir / "topology.toml"
            path.write_text(text)
            cfg = await asyncio.to_thread(job_mod.load, path)
            result.nodes = {n.id: {"host": n.host, "ran_in": ""} for n in cfg.nodes}
            if self.ray is not None:
                from hmp.ray_engine import RayCluster  # Ray: only when the hosts are a Ray cluster's

                # The ring's scheduler relays heartbeats and reports: no CPU of its own, the slots are the workers'.
                options = {"grace_s": self.grace_s, "num_cpus": {"scheduler": 0}, **self.ray_options}
                cluster = RayCluster(cfg, **options)
            else:
                cluster = LocalCluster(cfg, hosts=self.emulated, grace_s=self.grace_s)
            async with cluster:
                self.clusters[jid] = cluster
                watch = asyncio.ensure_future(self._watch_namespaces(cluster, result))
                try:
                    report = await cluster.train()
                finally:
                    watch.cancel()
                    await asyncio.gather(watch, return_exceptions=True)
            if self.ray is not None:
                self._read_ray_placement(result, report)
            self._read_report(result, report)
            result.status = DONE
        except asyncio.CancelledError:
            result.status, result.error = STOPPED, "the manager stopped"
            raise
        except Exception as exc:  # whatever goes wrong with one job (a daemon's exit, its files) fails that job only
            result.status, result.error = FAILED, f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, (JobFailed, HmpError, OSError)):
                log.exception("job_crashed", job=jid)
        finally:
            self.clusters.pop(jid, None)
            self._ports_in_use.discard(port)
            result.end_s = self.now()
            if not math.isnan(self.core.predicted_iteration_s(jid, result.end_s)):
                result.predicted_iteration_s = self.core.predicted_iteration_s(jid, result.end_s)
            result.utility = float(spec.utility(result.jct_s)) if result.status == DONE else 0.0
            (self.run_dir / jid).mkdir(parents=True, exist_ok=True)
            (self.run_dir / jid / "result.json").write_text(json.dumps(result.to_json(), indent=1))
            self._event("job_" + result.status, result)
            starts = self.core.finish(jid, result.end_s)
            if not self._stopping:
                self._act(starts)
            fut = self._done[jid]
            if not fut.done():
                fut.set_result(None)

    async def _watch_namespaces(self, cluster: Launcher, result: JobResult) -> None:
        """Record the emulated host each daemon's process really runs in (``/proc/PID/ns/net`` against the
        hosts' namespaces): evidence for the placement, beyond the config that asked for it."""
        hosts = self.emulated
        if hosts is None:
            return
        inode = {}
        for name, h in hosts.hosts.items():
            with contextlib.suppress(OSError):
                inode[os.stat(f"/run/netns/{h.netns}").st_ino] = name
        while any(not n["ran_in"] for n in result.nodes.values()):
            for nid, proc in list(cluster.daemons.items()):
                if nid in result.nodes and not result.nodes[nid]["ran_in"]:
                    with contextlib.suppress(OSError, ValueError):
                        link = os.readlink(f"/proc/{proc.pid}/ns/net")      # "net:[4026532345]"
                        result.nodes[nid]["ran_in"] = inode.get(int(link.split("[")[1].rstrip("]")), "")
            await asyncio.sleep(0.2)

    def _read_ray_placement(self, result: JobResult, report: dict[str, Any]) -> None:
        """Under Ray: the host (and Ray node) each daemon's actor really ran on, from the report's ``ray`` section."""
        by_node = {h.ray_node: name for name, h in self.ray_hosts.items()}
        for nid, where in report.get("ray", {}).get("nodes", {}).items():
            if nid in result.nodes:
                result.nodes[nid]["ran_in"] = by_node.get(str(where.get("ray_node")), "")
                result.nodes[nid]["ray_node"] = str(where.get("ray_node", ""))

    @staticmethod
    def _read_report(result: JobResult, report: dict[str, Any]) -> None:
        final = report.get("final", {})
        result.final_accuracy = float(final.get("test_accuracy", float("nan")))
        result.stop_reason = str(final.get("stop_reason", ""))
        steps, updates = [], 0
        for series in report.get("series", {}).values():
            last = next((p for p in reversed(series) if "step_s" in p), None)
            if last is not None:
                steps.append(float(last["step_s"]))
        for w in report.get("workers", {}).values():
            updates = max(updates, int(w.get("updates", 0)))
        result.updates = updates
        if steps:
            result.iteration_s = statistics.median(steps)

    def _event(self, name: str, result: JobResult) -> None:
        log.info(name, job=result.job_id, name=result.name, placement=result.placement, error=result.error or None)
        if self.on_event is not None:
            self.on_event(name, result)

    # ------------------------------------------------------------------ requests (hmp-submit)
    async def on_submit(self, msg: Submit, peer: bytes) -> Message:
        try:
            handle = await self.submit_text(msg.job, msg.path or "<submitted>")
        except ConfigError as exc:
            raise RequestError(str(exc), "bad_config") from None
        except HmpError as exc:
            raise RequestError(str(exc), "bad_request") from None
        return Ack(detail=handle.job_id)

    def state(self) -> dict[str, Any]:
        return {"hosts": {h.name: {"slots": h.slots, "free": f} for h, f in zip(self.cluster.hosts, self.core.free)},
                "scheduler": getattr(self.scheduler, "name", ""), "now_s": self.now(),
                "jobs": {jid: r.to_json() for jid, r in self.results.items()}}

    async def on_status(self, msg: Message, peer: bytes) -> Message:
        return Status(state=self.state())


__all__ = ["DONE", "FAILED", "JobHandle", "JobManager", "JobResult", "QUEUED", "RUNNING", "STOPPED", "cluster_spec",
           "make_scheduler"]
