"""Run a topology's daemons on a Ray cluster: the engine behind ``hmp-launch --engine ray`` (docs/ray.md).

    async with hmp.ray_engine.RayCluster("conf/local.toml", address="auto") as cluster:
        report = await cluster.train()

Each daemon is what ``python -m hmp.nodes.main ROLE --config F --id N`` runs, as a process owned by one Ray
actor (:class:`DaemonActor`; between them a small keeper process, :data:`_KEEPER`): the daemon code is the same
as under :class:`hmp.cluster.LocalCluster`, and the daemon gets ``PR_SET_PDEATHSIG`` so that it stops (SIGTERM,
gracefully) when its actor dies, however it dies.
An actor asks Ray for what its node's config asks for: ``num_cpus`` = ``threads``, ``num_gpus = 1`` for a
``gpu_worker`` on CUDA, and, for a node whose ``host`` is not this machine (``127.0.0.1``), either Ray's own
``node:<ip>`` resource (``host`` is a Ray node's IP) or the custom resource ``hmp_host:<host>`` (declared with
``ray start --resources '{"hmp_host:<host>": 100}'``). The PS shards go into one placement group, one bundle
each, strategy SPREAD.

Addresses are learnt, never guessed: every daemon binds ``tcp://<its Ray node's IP>:0``; the scheduler's
actor reads the address the scheduler reports (its ``serving`` log line) and the other daemons get it in
their config, then report their own address when they join. Each daemon reads a config derived from the
job's (:func:`derived_config`) in which paths are absolute; the same absolute paths must exist on every Ray
node (a shared file system, or the same layout everywhere).

Logs: each daemon writes its structured log to ``<report_dir>/logs/<id>.log`` on its Ray node; for a node
that does not share this driver's file system, the driver pulls the lines into the same path here at each
poll, so the logs of the whole job are where the driver runs. So is the report: the scheduler's report
files are copied here when the scheduler's node is elsewhere, and ``report.json`` gets a ``ray`` section
(the Ray nodes each daemon ran on, and the daemons lost with Ray's error).

Metrics (``[metrics] enabled``): each daemon serves its Prometheus endpoint on its node (:mod:`hmp.metrics`), and
its actor reads it every ``metrics_interval_s`` and records the same metrics through ``ray.util.metrics``
(:class:`RayMetrics`), so that Ray's metrics agent and dashboard have them; the daemon never imports Ray.

Failures come from Ray: an actor that dies (``ray.kill``, its node lost) is a lost node: for a worker the job
goes on without it while ``[train] min_workers`` remain (``[job] restarts`` are refused under Ray for now); a
lost shard or scheduler fails the job (:class:`hmp.cluster.JobFailed`, with Ray's error). ``stop()`` stops every daemon (SIGTERM through its actor), kills every actor, removes the placement
group, and shuts down the Ray instance it started. Nothing is detached: when the driver dies, Ray kills its
actors, and their daemons follow.

Without ``address`` (and no Ray running in this process) a local Ray instance is started, sized to this
machine: its CPUs (at least what the topology asks for, as the local launcher also lets daemons share the
cores), its GPUs, and every ``host`` the config names, since this machine stands for all of them.
Importing this module needs Ray (``pip install "hmp[ray]"``); nothing else in hmp imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _exc:  # an optional extra: say how to get it
    raise ImportError(f"the Ray engine needs Ray: pip install \"hmp[ray]\" ({_exc})") from _exc

import structlog

from hmp.emulate import dumps_toml

if TYPE_CHECKING:
    from hmp.config import Config

# What this module imports at the top is what every actor imports too (Ray loads DaemonActor's module by name in
# each actor's process): ray, the standard library, structlog and hmp.emulate (which imports hmp.errors only).
# Torch, zmq and the job assembly are imported inside RayCluster's methods, which run in the driver only, so an
# actor starts in well under a second and its daemon child pays for torch once.

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
#: Bytes of a daemon's log one ``drain_log`` call returns (the driver asks again at its next poll).
LOG_CHUNK_BYTES = 1 << 20
#: Largest report file copied from the scheduler's node (report.json, loss.png, ...); larger ones stay there.
REPORT_FILE_MAX_BYTES = 64 << 20
#: The daemon's process before it knows what to run: ``python -c _PRELUDE``. Importing hmp.nodes.main installs its
#: early-signal handlers (a SIGTERM now is a graceful stop later) and imports torch; then one JSON line on stdin, the
#: arguments of ``python -m hmp.nodes.main``, runs the daemon exactly as that would. Its end (the actor gone):
#: exit 0 without starting.
_PRELUDE = """
import json, sys
from hmp.nodes import main
line = sys.stdin.readline()
if not line:
    sys.exit(0)
argv = json.loads(line)
sys.exit(main.ROLE_MAINS[argv[0]](argv[1:]))
"""
#: Between the actor and its daemon: ``python -c _KEEPER PRELUDE ACTOR_PID``. When an actor's process exits, Ray SIGKILLs its
#: child processes (``kill_child_processes_on_worker_exit``): that child is this keeper, not the daemon, whose
#: ``PR_SET_PDEATHSIG`` then gives it SIGTERM, a graceful stop (it leaves the job, frees its shared memory). The keeper
#: passes SIGTERM and SIGINT on, exits with the daemon's exit code (128 + N: killed by signal N), and gets SIGTERM
#: itself when the actor dies without killing it. Standard library only: it starts in milliseconds.
_KEEPER = """
import ctypes, os, signal, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[2]):  # the actor died before the prctl
    sys.exit(0)
me = os.getpid()
def arm():
    libc.prctl(1, signal.SIGTERM)
    if os.getppid() != me:
        os.kill(os.getpid(), signal.SIGTERM)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], preexec_fn=arm)
def forward(sig, _frame):
    try:
        child.send_signal(sig)
    except ProcessLookupError:
        pass
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
code = child.wait()
sys.exit(code if code >= 0 else 128 - code)
"""
#: Seconds between two reads of a daemon's metrics endpoint by its actor (``[metrics] enabled`` under Ray), which records
#: them through ``ray.util.metrics``; Ray's own export to its metrics agent runs every ``metrics_report_interval_ms``
#: (10 s by default), so a shorter period adds nothing there.
METRICS_INTERVAL_S = 5.0
#: A read of a daemon's metrics endpoint waits this long (the endpoint answers 503 after 2 s itself).
METRICS_FETCH_TIMEOUT_S = 3.0
#: start() waits this long for each daemon's metrics URL (it writes it just after it serves).
METRICS_URL_WAIT_S = 10.0
#: Most ``Histogram.observe`` calls one :meth:`RayMetrics.record` makes; the rest is carried to the next call, so a
#: daemon's burst of requests costs its actor a bounded time per period.
MAX_OBSERVATIONS = 20_000
_SERVING = re.compile(r"\bserving\b.*\baddress=(\S+)")


def serving(line: str) -> tuple[str, int] | None:
    """The address and pid in a daemon's ``serving`` log line (JSON or console rendering), else None."""
    if "serving" not in line:
        return None
    with contextlib.suppress(ValueError):
        ev = json.loads(line)
        if isinstance(ev, dict) and ev.get("event") == "serving" and ev.get("address"):
            return str(ev["address"]), int(ev.get("pid") or 0)
        return None
    m = _SERVING.search(line)
    pid = re.search(r"\bpid=(\d+)", line)
    return (m.group(1), int(pid.group(1)) if pid else 0) if m else None


def parse_metrics_text(text: str) -> dict[str, dict[str, Any]]:
    """A scrape of a daemon's endpoint (the Prometheus text format) as :func:`hmp.metrics.snapshot` returns it:
    ``{name: {"type", "help", "samples": [(labels, value), ...]}}``, counters without ``_total``, a histogram's
    value ``{"buckets": [(upper bound, cumulative count), ...], "sum", "count"}``."""
    from prometheus_client.parser import text_string_to_metric_families  # a dependency of hmp (its endpoint)

    out: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type not in ("counter", "gauge", "histogram"):
            continue
        samples: list[tuple[dict[str, str], Any]] = []
        if fam.type == "histogram":
            series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                h = series.setdefault(tuple(sorted(labels.items())), {"buckets": [], "sum": 0.0, "count": 0})
                if s.name.endswith("_bucket"):
                    h["buckets"].append((float(s.labels["le"]), int(s.value)))
                elif s.name.endswith("_sum"):
                    h["sum"] = float(s.value)
                elif s.name.endswith("_count"):
                    h["count"] = int(s.value)
            for key, h in series.items():
                h["buckets"].sort()
                samples.append((dict(key), h))
        else:
            samples = [(dict(s.labels), float(s.value)) for s in fam.samples
                       if s.name in (fam.name, f"{fam.name}_total")]
        out[fam.name] = {"type": fam.type, "help": fam.documentation, "samples": samples}
    return out


class RayMetrics:
    """Records a daemon's metrics through ``ray.util.metrics`` (docs/metrics.md, "Under Ray"): each hmp metric
    becomes a Ray metric of the same name and kind, tagged with the hmp labels (``node``, ``role``, ``peer``,
    ``kind``, ...) and ``tags`` (``job``). Construct and call it in a process connected to Ray (an actor).

    :meth:`record` takes a snapshot (:func:`parse_metrics_text`) of cumulative values: a counter is increased by
    what it grew since the last call (``Counter.inc``), a gauge set, a histogram's new observations replayed
    (``Histogram.observe``, same bucket bounds) at the bucket's midpoint (above the last bound: twice it), which
    is what Ray's export counts a bucket's values as anyway: the counts per bucket are exact, the sum Ray's
    approximation. At most ``max_observations`` per call; the rest waits for the next.
    A gauge's series that leaves hmp's snapshot (e.g. a membership state no node is in now) is set to 0.
    A daemon whose counters go back (it restarted) starts again from zero."""

    def __init__(self, tags: dict[str, str] | None = None, max_observations: int = MAX_OBSERVATIONS) -> None:
        from ray.util import metrics as ray_metrics

        self._ray = ray_metrics
        self.tags = dict(tags or {})
        self.max_observations = max_observations
        self._metrics: dict[str, Any] = {}           # name -> the Ray metric
        self._keys: dict[str, tuple[str, ...]] = {}  # name -> its tag keys
        self._bounds: dict[str, list[float]] = {}    # histogram name -> its finite bucket bounds
        #: what went to Ray so far, per (name, tags): a counter's total, a gauge's value, a histogram's
        #: ``(per-bucket counts, sum of the values observed)``
        self.recorded: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self.records = 0

    def _metric(self, name: str, m: dict[str, Any]) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            keys = tuple(sorted({k for labels, _ in m["samples"] for k in labels} | set(self.tags)))
            self._keys[name] = keys
            if m["type"] == "counter":
                metric = self._ray.Counter(name, m["help"], tag_keys=keys)
            elif m["type"] == "gauge":
                metric = self._ray.Gauge(name, m["help"], tag_keys=keys)
            else:
                bounds = [le for le, _ in m["samples"][0][1]["buckets"] if le != float("inf")]
                self._bounds[name] = bounds
                metric = self._ray.Histogram(name, m["help"], boundaries=bounds, tag_keys=keys)
            self._metrics[name] = metric
        return metric

    def record(self, snap: dict[str, dict[str, Any]]) -> int:
        """Record one snapshot; returns the number of Ray calls made."""
        calls, budget = 0, self.max_observations
        for name, m in snap.items():
            if not m["samples"]:
                continue
            metric = self._metric(name, m)
            if getattr(metric, "_discard_metric", False):  # a name Ray refuses (warned once): nothing recorded
                continue
            keys = self._keys[name]
            for labels, value in m["samples"]:
                tags = {k: str(labels.get(k, self.tags.get(k, ""))) for k in keys}
                key = (name, tuple(sorted(tags.items())))
                if m["type"] == "gauge":
                    if value == value:  # NaN: no value yet (e.g. no heartbeat answered)
                        metric.set(value, tags=tags)
                        self.recorded[key] = value
                        calls += 1
                elif m["type"] == "counter":
                    done = self.recorded.get(key, 0.0)
                    if value < done:
                        done = 0.0
                    if value > done:
                        metric.inc(value - done, tags=tags)
                        calls += 1
                    self.recorded[key] = value
                else:
                    n, budget = self._observe(metric, name, key, value, tags, budget)
                    calls += n
            if m["type"] == "gauge":  # a series gone from hmp's (a membership state no node is in now) is 0
                seen = {tuple(sorted({k: str(labels.get(k, self.tags.get(k, ""))) for k in keys}.items()))
                        for labels, _ in m["samples"]}
                for gone in [k for k in self.recorded if k[0] == name and k[1] not in seen and self.recorded[k]]:
                    metric.set(0.0, tags=dict(gone[1]))
                    self.recorded[gone] = 0.0
                    calls += 1
        self.records += 1
        return calls

    def _observe(self, metric: Any, name: str, key: Any, h: dict[str, Any], tags: dict[str, str],
                 budget: int) -> tuple[int, int]:
        bounds = self._bounds[name]
        cumulative = [n for _, n in h["buckets"]]
        counts = [n - (cumulative[i - 1] if i else 0) for i, n in enumerate(cumulative)]
        done, sent_sum = self.recorded.get(key, ([0] * len(counts), 0.0))
        if len(done) != len(counts) or any(c < d for c, d in zip(counts, done)):
            done = [0] * len(counts)
        calls = 0
        for i, (c, d) in enumerate(zip(counts, done)):
            n = min(c - d, budget)
            if n <= 0:
                continue
            # Ray's own stand-in for a bucket's values (its export sums them so): the midpoint, 2 x the last bound
            value = (bounds[i] + (bounds[i - 1] if i else 0.0)) / 2 if i < len(bounds) else 2 * bounds[-1]
            for _ in range(n):
                metric.observe(value, tags=tags)
            done[i] += n
            sent_sum += n * value
            budget -= n
            calls += n
        self.recorded[key] = (done, sent_sum)
        return calls, budget

    def summary(self) -> dict[str, list[list[Any]]]:
        """What went to Ray: ``{name: [[tags, value], ...]}``; a histogram's value ``{"count", "sum"}``."""
        out: dict[str, list[list[Any]]] = {}
        for (name, tags), value in sorted(self.recorded.items()):
            if isinstance(value, tuple):
                value = {"count": sum(value[0]), "sum": value[1]}
            out.setdefault(name, []).append([dict(tags), value])
        return out


@ray.remote(max_restarts=0, max_task_retries=0)
class DaemonActor:
    """One daemon of the topology, a child process of this actor (docs/ray.md).

    Methods return plain values; the driver awaits :meth:`wait`, whose failure (``RayActorError``) is how
    it learns that the actor, and so its daemon, is gone."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = ""
        self.config_dir = ""
        #: ``[metrics] enabled``: the task reading the daemon's endpoint into Ray's metrics, and what it did
        self.exporter: asyncio.Task[None] | None = None
        self.recorder: RayMetrics | None = None
        self.metrics_url = ""
        self.metrics_polls = 0
        self.metrics_errors: list[str] = []

    async def node_info(self, marker: str) -> dict[str, Any]:
        """Where this actor runs; ``shared``: whether ``marker`` (a file the driver made) is visible here, i.e.
        this node shares the driver's file system."""
        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(), "pid": os.getpid(),
                "ray_node": ctx.get_node_id(), "shared": os.path.exists(marker)}

    async def prepare(self, env: dict[str, str], cwd: str, log_path: str) -> int:
        """Start the daemon's process, its output to ``log_path``: it imports torch and hmp's daemon code while
        the driver learns the scheduler's address, then waits for :meth:`start` to say what to run (:data:`_PRELUDE`).
        Returns the pid of its keeper (:data:`_KEEPER`); :meth:`start` returns the daemon's."""
        self.config_dir = tempfile.mkdtemp(prefix=f"hmp-ray-{self.node_id}-")
        self.log_path = log_path
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as logf:  # the child holds its own descriptor: it outlives this one
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _KEEPER, _PRELUDE, str(os.getpid()), stdin=asyncio.subprocess.PIPE, stdout=logf,
                stderr=asyncio.subprocess.STDOUT, env={**os.environ, **env},
                cwd=cwd if os.path.isdir(cwd) else self.config_dir,
                start_new_session=True)
        return self.proc.pid

    async def start(self, config_text: str, argv: list[str], serving_timeout_s: float,
                    metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Give the prepared daemon its derived config and arguments (``[ROLE, --id, N, ...]``) and wait until it
        serves: ``{"pid", "address"}``, or ``{"exit_code", "tail"}`` if it ended first (``exit_code`` None: it
        did not serve within ``serving_timeout_s`` and was stopped). ``metrics`` (``{"url_file", "tags",
        "interval_s"}``): record the daemon's metrics through Ray's while it runs (:meth:`_export_metrics`)."""
        assert self.proc is not None and self.proc.stdin is not None
        config = Path(self.config_dir) / "job.toml"
        config.write_text(config_text)
        with contextlib.suppress(ConnectionError):  # it has exited already: reported below
            self.proc.stdin.write((json.dumps([argv[0], "--config", str(config), *argv[1:]]) + "\n").encode())
            await self.proc.stdin.drain()
            self.proc.stdin.close()
        deadline = time.monotonic() + serving_timeout_s
        offset, partial = 0, b""
        try:
            while True:
                with open(self.log_path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
                offset += len(data)
                *lines, partial = (partial + data).split(b"\n")
                for line in lines:
                    found = serving(line.decode(errors="replace"))
                    if found:
                        if metrics:
                            self.exporter = asyncio.ensure_future(self._export_metrics(found[1], **metrics))
                        return {"address": found[0], "pid": found[1]}
                if self.proc.returncode is not None:
                    return {"exit_code": self.proc.returncode, "tail": self.tail()}
                if time.monotonic() > deadline:
                    await self.stop(5.0)
                    return {"exit_code": None, "tail": self.tail()}
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), 0.05)
        finally:
            # The daemon has read its config (or is gone): the file is not needed any more.
            shutil.rmtree(self.config_dir, ignore_errors=True)

    async def _export_metrics(self, pid: int, url_file: str, tags: dict[str, str], interval_s: float) -> None:
        """Until the daemon exits: every ``interval_s``, read its metrics endpoint (on this node; its URL from the
        file the daemon writes, :func:`hmp.metrics.url_file`, with its pid) and record them through
        ``ray.util.metrics`` (:class:`RayMetrics`). A failed read is counted and kept (the last few), not fatal."""
        import urllib.request

        def fetch(url: str) -> str:
            with urllib.request.urlopen(url, timeout=METRICS_FETCH_TIMEOUT_S) as r:
                return r.read().decode()

        assert self.proc is not None
        self.recorder = RayMetrics(tags)
        while self.proc.returncode is None:
            if not self.metrics_url:
                with contextlib.suppress(OSError, ValueError):
                    info = json.loads(Path(url_file).read_text())
                    if info.get("pid") == pid:
                        self.metrics_url = str(info["url"])
            if self.metrics_url:
                try:
                    text = await asyncio.to_thread(fetch, self.metrics_url)
                    self.recorder.record(parse_metrics_text(text))
                    self.metrics_polls += 1
                except Exception as exc:  # noqa: BLE001 - the daemon stopping, a 503: kept for metrics_info
                    self.metrics_errors = [*self.metrics_errors[-4:], f"{type(exc).__name__}: {exc}"]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()),
                                       interval_s if self.metrics_url else min(interval_s, 0.1))

    async def metrics_info(self, wait_url_s: float = 0.0) -> dict[str, Any]:
        """The daemon's metrics endpoint (waiting up to ``wait_url_s`` for its URL) and what went to Ray's
        metrics so far: ``{"url", "polls", "errors", "recorded": RayMetrics.summary()}``."""
        deadline = time.monotonic() + wait_url_s
        while not self.metrics_url and self.exporter is not None and not self.exporter.done() \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {"url": self.metrics_url, "polls": self.metrics_polls, "errors": self.metrics_errors,
                "recorded": self.recorder.summary() if self.recorder is not None else {}}

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait(self) -> int:
        """The daemon's exit code, once it has exited (negative: killed by that signal)."""
        assert self.proc is not None
        return await self.proc.wait()

    async def drain_log(self, offset: int) -> bytes:
        """Up to :data:`LOG_CHUNK_BYTES` of the daemon's log from byte ``offset``."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read(LOG_CHUNK_BYTES)
        except OSError:
            return b""

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM the daemon, SIGKILL it after ``grace_s``; its exit code (None: it never started)."""
        proc = self.proc
        if proc is None:
            return None
        if self.exporter is not None:
            self.exporter.cancel()
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()  # a daemon still waiting for its arguments ends at the end of its input
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        return proc.returncode

    async def report_files(self, report_dir: str) -> dict[str, bytes]:
        """The files directly in ``report_dir`` on this node (the scheduler's report, plots), each up to
        :data:`REPORT_FILE_MAX_BYTES`."""
        out: dict[str, bytes] = {}
        with contextlib.suppress(OSError):
            for p in Path(report_dir).iterdir():
                if p.is_file() and p.stat().st_size <= REPORT_FILE_MAX_BYTES:
                    out[p.name] = p.read_bytes()
        return out

    async def cleanup_shm(self, job_name: str, shm_dir: str) -> list[str]:
        """Remove this job's shared-memory segments on this node whose owner has exited (docs/shm.md)."""
        from hmp.transport.shm import cleanup_stale  # torch: imported once, at the end, on another node only

        return cleanup_stale(job_name, shm_dir)


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
        from hmp.errors import ConfigError

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


class RayCluster:
    """Starts, watches and stops every daemon of ``config`` as Ray actors; :class:`hmp.cluster.LocalCluster`'s
    interface (``async with``, ``train``, ``wait``, ``status``, ``finish``, ``kill``, ``stop``, ``restarts``,
    ``worker_exits``).

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
        from hmp import job
        from hmp.config import WORKER_ROLES, Config, Role
        from hmp.errors import ConfigError
        from hmp.transport import security

        self.cfg = config if isinstance(config, Config) else job.load(config)
        self.config_path = str(self.cfg.path)
        self.address = address
        self.ray_init = dict(ray_init or {})
        self.resume = resume
        self.grace_s = grace_s
        self.metrics_interval_s = metrics_interval_s
        self.num_cpus = dict(num_cpus or {})
        bad = {r: n for r, n in self.cfg.job.restarts.items() if n}
        if bad:
            raise ConfigError(self.cfg.path, "job.restarts",
                              f"no restarts under Ray yet (a lost worker's share goes to the others while [train] "
                              f"min_workers remain; a shard resumes from a checkpoint on the node that wrote it); "
                              f"got {', '.join(f'{r} = {n}' for r, n in sorted(bad.items()))}")
        environ = {**os.environ, **(env or {})}
        # Only hmp's own variables travel to the daemons: the rest of this process's environment (PATH, a virtual
        # environment's) may not mean anything on another Ray node, whose actors have their own.
        self.env = {k: v for k, v in environ.items() if k.startswith("HMP_")}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.job_token = self.env.get("HMP_JOB_TOKEN") or self.cfg.job.token or secrets.token_hex(16)
        self.env["HMP_JOB_TOKEN"] = self.job_token
        self.cfg = self.cfg.replace(job=dataclasses.replace(self.cfg.job, token=self.job_token))
        self._launcher_security = security.from_config(self.cfg, "launcher", serve=False)
        self._role = Role
        self._worker_roles = WORKER_ROLES
        #: always empty: LocalCluster's interface (no restarts under Ray yet)
        self.restarts: list[dict[str, Any]] = []
        #: workers that exited non-zero or were lost: ``{node: exit code}`` (-9: the actor died)
        self.worker_exits: dict[str, int] = {}
        #: daemons whose actor died, one ``{node, t, error}`` each (``error``: Ray's, first line)
        self.lost: list[dict[str, Any]] = []
        #: where each daemon runs: ``{node: {ip, hostname, ray_node, address, pid, log}}``
        self.placement: dict[str, dict[str, Any]] = {}
        #: ``[metrics] enabled``: ``{node: URL}`` of each daemon's endpoint (on its Ray node), known after start()
        self.metrics_urls: dict[str, str] = {}
        self.actors: dict[str, Any] = {}
        self._exits: dict[str, int | None] = {}  # node -> exit code (None: its actor died)
        self._log_paths: dict[str, Path] = {}
        self._log_offsets: dict[str, int] = {}
        self._pg: Any = None
        self._own_ray = False
        self._scheduler_address = ""
        self._status_client: Any = None
        self._stopping = False
        self._t_start = time.monotonic()
        self.log_dir = self.cfg.report_dir / "logs"
        self._marker = self.log_dir / f".ray-driver-{self.job_token[:12]}"

    async def __aenter__(self) -> RayCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # ------------------------------------------------------------------------------------------- starting

    def _connect(self) -> None:
        """Join the Ray cluster at ``address``, use this process's, or start a local one sized to this machine."""
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        common = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        try:
            if self.address is not None:
                if ray.is_initialized():
                    return
                ray.init(address=self.address, **common)
            elif not ray.is_initialized():
                wanted = sum(n.threads for n in self.cfg.nodes)
                hosts = {n.host for n in self.cfg.nodes} - ANY_HOST
                kwargs = {"num_cpus": max(os.cpu_count() or 1, wanted), "object_store_memory": LOCAL_OBJECT_STORE_BYTES,
                          "resources": {HOST_RESOURCE.format(host=h): 1000.0 for h in sorted(hosts)},
                          **common, **self.ray_init}
                ray.init(**kwargs)
                self._own_ray = True
                _log.info("ray_started", cpus=kwargs["num_cpus"], hosts=sorted(hosts),
                          note="a local Ray instance: this machine stands for every host the config names")
        finally:
            # ray.init installs its own SIGTERM handler (exit at once); the caller's (hmp-launch: stop every
            # daemon, then exit 130) stays in charge.
            for s, h in saved.items():
                with contextlib.suppress(TypeError, ValueError):
                    signal.signal(s, h)

    def _options(self, node: Any, node_ips: set[str]) -> dict[str, Any]:
        """``DaemonActor.options`` for ``node``: its CPUs, GPU and host (docs/ray.md, "Resources")."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus.get(str(node.role), node.threads),
                                "resources": host_resources(node.host, node_ips)}
        device = node.device or ("cuda" if node.role == self._role.GPU_WORKER else "cpu")
        if node.role in self._worker_roles and device.startswith("cuda"):
            opts["num_gpus"] = 1
        return opts

    def _check_resources(self, node_ips: set[str]) -> None:
        """Every host resource a daemon asks for exists on some Ray node (else it would wait forever)."""
        from hmp.errors import ConfigError

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
        from hmp.transport.shm import cleanup_stale

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._marker.write_text("a RayCluster driver runs here\n")
        self._t_start = time.monotonic()
        cleanup_stale(self.cfg.job.name, self.cfg.shm.dir)
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
            await self._start_node(sched.id)
        except BaseException:
            prepared.cancel()
            await asyncio.gather(prepared, return_exceptions=True)
            raise
        await prepared
        await asyncio.gather(*(self._start_node(n.id) for n in others))
        if self.cfg.metrics.enabled:
            infos = await asyncio.gather(*(self.actors[nid].metrics_info.remote(METRICS_URL_WAIT_S)
                                           for nid in self.actors))
            self.metrics_urls = {nid: i["url"] for nid, i in zip(self.actors, infos) if i["url"]}

    def _job_failed(self, message: str, node: str = "", tail: str = "") -> Exception:
        from hmp.cluster import JobFailed

        return JobFailed(message, node, tail)

    async def _prepare_node(self, node_id: str, node_ips: set[str]) -> None:
        """Create ``node_id``'s actor where its resources are, and start its daemon's process there."""
        node = self.cfg.node(node_id)
        opts = self._options(node, node_ips)
        timeout_s = self.cfg.job.join_timeout_s
        if node.role == self._role.PS:
            assert self._pg is not None
            try:
                await asyncio.wait_for(self._pg.ready(), timeout_s)
            except TimeoutError:
                raise self._job_failed(f"Ray could not place the PS shards' placement group (one bundle per shard, "
                                       f"SPREAD) within [job] join_timeout_s = {timeout_s} s; available: "
                                       f"{ray.available_resources()}", node_id) from None
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=[s.id for s in self.cfg.shards].index(node_id))
        actor = self.actors[node_id] = DaemonActor.options(**opts).remote(node_id)
        try:
            info = await asyncio.wait_for(actor.node_info.remote(str(self._marker)), timeout_s)
        except TimeoutError:
            raise self._job_failed(f"Ray did not start {node_id}'s actor within [job] join_timeout_s = {timeout_s} s: "
                                   f"it asks for {opts.get('num_cpus')} CPUs, {opts.get('num_gpus', 0)} GPUs, "
                                   f"{opts['resources'] or 'no other resources'}; available: "
                                   f"{ray.available_resources()}", node_id) from None
        log = self._log_paths[node_id] = self.log_dir / f"{node_id}.log"
        self._log_offsets[node_id] = 0
        pid = await actor.prepare.remote(self.env, os.getcwd(), str(log.resolve()))
        self.placement[node_id] = {"ip": info["ip"], "hostname": info["hostname"], "ray_node": info["ray_node"],
                                   "shared_fs": info["shared"], "log": str(log), "pid": pid}

    async def _start_node(self, node_id: str) -> None:
        """Give ``node_id``'s prepared daemon its config (naming the scheduler's address) and wait until it serves."""
        node = self.cfg.node(node_id)
        placed = self.placement[node_id]
        is_scheduler = node.role == self._role.SCHEDULER
        text = derived_config(self.config_path, list(self.cfg.nodes), {node_id: placed["ip"]},
                              "" if is_scheduler else self._scheduler_address, self.cfg.report_dir,
                              self.cfg.ps.checkpoint_dir)
        args = [node.role, "--id", node.id]
        if node.role in (self._role.PS, self._role.SCHEDULER) and self.resume:
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
            raise self._job_failed(f"daemon {node_id} on Ray node {placed['ip']} {why}", node_id, started["tail"])
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

    def log_tail(self, node_id: str, lines: int = 15) -> str:
        p = self._log_paths.get(node_id) or self.log_dir / f"{node_id}.log"
        try:
            return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def status(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The scheduler's status, or None if it does not answer. Every poll goes through one socket."""
        from hmp.errors import HmpError
        from hmp.messages import Status
        from hmp.transport.endpoint import Client

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
        """Ask the scheduler to end the job now as if a stop rule had fired (as :meth:`LocalCluster.finish`)."""
        from hmp.messages import Shutdown

        await self.status(timeout_s=timeout_s)
        assert self._status_client is not None
        await self._status_client.request(Shutdown(reason=reason, finish=True), timeout_s=timeout_s)

    def kill(self, node_id: str) -> None:
        """Kill ``node_id``'s actor with ``ray.kill`` (its daemon then stops): a lost node, as a dead Ray node."""
        ray.kill(self.actors[node_id], no_restart=True)

    @staticmethod
    async def _await_exit(ref: Any) -> tuple[int | None, str]:
        try:
            return await ref, ""
        except ray.exceptions.RayError as exc:  # the actor died: Ray says why
            return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"

    def _lost(self, nid: str, error: str) -> None:
        entry = {"node": nid, "t": round(time.monotonic() - self._t_start, 3), "error": error}
        self.lost.append(entry)
        _log.warning("node_lost", **entry, note="its Ray actor died; the daemon was stopped with it")

    async def wait(self, timeout_s: float | None = None,
                   progress: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 1.0) -> None:
        """Wait until every daemon has exited; raise JobFailed at the first non-zero exit or loss of a shard or
        the scheduler. A worker that exits non-zero or whose actor dies is left to the scheduler's judgement
        (``[train] min_workers``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waits = {asyncio.ensure_future(self._await_exit(a.wait.remote())): nid for nid, a in self.actors.items()}
        sched = self.cfg.scheduler.id
        try:
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
                await asyncio.gather(*(self._pull_log(nid) for nid in self.actors))
                for t in done:
                    nid = waits[t]
                    code, error = t.result()
                    self._exits[nid] = code
                    if code == 0:
                        continue
                    if code is None:
                        self._lost(nid, error)
                    what = f"lost ({error})" if code is None else f"exited with code {code}"
                    if self.cfg.node(nid).role in self._worker_roles:
                        self.worker_exits.setdefault(nid, -9 if code is None else code)
                        _log.warning("worker_exited", node=nid, how=what,
                                     note="the job goes on while [train] min_workers remain")
                        continue
                    if self.worker_exits:
                        first, first_code = next(iter(self.worker_exits.items()))
                        raise self._job_failed(f"daemon {first} exited with code {first_code}, then {nid} {what}",
                                               first, self.log_tail(first) + f"\n--- last lines of {nid}'s log ---\n"
                                               + self.log_tail(nid))
                    raise self._job_failed(f"daemon {nid} {what}", nid, self.log_tail(nid))
                if progress is not None and sched not in self._exits:
                    st = await self.status(timeout_s=min(poll_s, 2.0))
                    if st:
                        progress(st)
                if deadline is not None and time.monotonic() > deadline:
                    raise self._job_failed(f"job still running after {timeout_s} s")
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def train(self, timeout_s: float | None = None,
                    progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Wait for the job to finish and return its report (``report.json`` as a dict, written here, with a
        ``ray`` section: where each daemon ran, and the daemons lost with Ray's error)."""
        if timeout_s is None:
            timeout_s = self.cfg.train.max_seconds + self.cfg.job.join_timeout_s + 60
        await self.wait(timeout_s, progress)
        return await self._collect_report()

    async def _collect_report(self) -> dict[str, Any]:
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

    async def stop(self) -> None:
        """Stop every daemon (SIGTERM through its actor, SIGKILL after the grace period), kill every actor,
        remove the placement group, clean this job's shared memory on each node, and shut down a Ray
        instance this cluster started; also when cancelled."""
        self._stopping = True
        try:
            if self._status_client is not None:
                client, self._status_client = self._status_client, None
                with contextlib.suppress(Exception):
                    await client.close()
            if ray.is_initialized() and self.actors:
                await self._stop_actors()
        finally:
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
            from hmp.transport.shm import cleanup_stale

            cleanup_stale(self.cfg.job.name, self.cfg.shm.dir)
            with contextlib.suppress(OSError):
                self._marker.unlink()

    async def _stop_actors(self) -> None:
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
