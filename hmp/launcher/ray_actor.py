"""What runs in each Ray actor of :class:`hmp.ray_engine.RayCluster`: :class:`DaemonActor` (one daemon, a child
process under :mod:`hmp.launcher.keeper`) and :class:`RayMetrics` (its metrics through ``ray.util.metrics``).
Ray loads this module in every actor: it imports Ray and the standard library only (torch, zmq and the job
assembly stay in the driver), so an actor starts in well under a second and its daemon pays for torch once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from hmp.launcher import tail, terminate

#: Bytes of a daemon's log one ``drain_log`` call returns (the driver asks again at its next poll).
LOG_CHUNK_BYTES = 1 << 20
#: Largest report file copied from the scheduler's node (report.json, loss.png, ...); larger ones stay there.
REPORT_FILE_MAX_BYTES = 64 << 20
#: A read of a daemon's metrics endpoint waits this long (the endpoint answers 503 after 2 s itself).
METRICS_FETCH_TIMEOUT_S = 3.0
#: Most ``Histogram.observe`` calls one :meth:`RayMetrics.record` makes; the rest is carried to the next call, so a
#: daemon's burst of requests costs its actor a bounded time per period.
MAX_OBSERVATIONS = 20_000


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
        the driver learns the scheduler's address, then waits for :meth:`start` to say what to run
        (``python -m hmp.nodes.main -`` under :mod:`hmp.launcher.keeper`). Returns the keeper's pid; :meth:`start`
        returns the daemon's."""
        self.config_dir = tempfile.mkdtemp(prefix=f"hmp-ray-{self.node_id}-")
        self.log_path = log_path
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as logf:  # the child holds its own descriptor: it outlives this one
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hmp.launcher.keeper", str(os.getpid()), stdin=asyncio.subprocess.PIPE,
                stdout=logf, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **env},
                cwd=cwd if os.path.isdir(cwd) else self.config_dir, start_new_session=True)
        return self.proc.pid

    async def start(self, config_text: str, argv: list[str], serving_timeout_s: float,
                    metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Give the prepared daemon its derived config and arguments (``[ROLE, --id, N, ...]``) and wait until it
        serves: ``{"pid", "address"}`` (what it writes to its ``--ready-file``), or ``{"exit_code", "tail"}`` if it
        ended first (``exit_code`` None: it did not serve within ``serving_timeout_s`` and was stopped).
        ``metrics`` (``{"url_file", "tags", "interval_s"}``): record the daemon's metrics through Ray's while it
        runs (:meth:`_export_metrics`)."""
        assert self.proc is not None and self.proc.stdin is not None
        config, ready = Path(self.config_dir) / "job.toml", Path(self.config_dir) / "ready.json"
        config.write_text(config_text)
        with contextlib.suppress(ConnectionError):  # it has exited already: reported below
            argv = [argv[0], "--config", str(config), "--ready-file", str(ready), *argv[1:]]
            self.proc.stdin.write((json.dumps(argv) + "\n").encode())
            await self.proc.stdin.drain()
            self.proc.stdin.close()
        deadline = time.monotonic() + serving_timeout_s
        try:
            while True:
                with contextlib.suppress(OSError, ValueError):  # not written yet
                    found = json.loads(ready.read_text())
                    if metrics:
                        self.exporter = asyncio.ensure_future(self._export_metrics(found["pid"], **metrics))
                    return {"address": found["address"], "pid": found["pid"]}
                if self.proc.returncode is not None:
                    return {"exit_code": self.proc.returncode, "tail": tail(self.log_path)}
                if time.monotonic() > deadline:
                    await self.stop(5.0)
                    return {"exit_code": None, "tail": tail(self.log_path)}
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), 0.05)
        finally:
            # The daemon has read its config (or is gone): the files are not needed any more.
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
        await terminate([proc], grace_s)
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
