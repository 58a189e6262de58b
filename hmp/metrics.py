"""Each daemon's counters and histograms, in the Prometheus text format over HTTP (docs/metrics.md).

Nothing is counted into Prometheus objects as it happens: the transport and the nodes keep plain
numbers, :func:`snapshot` reads them on the event loop, and :class:`MetricsEndpoint` serves them
from a thread of its own, so that a scrape never waits on the loop nor the loop on a scrape. The
module never imports Ray (Ray's actor re-exports the same snapshot). Details: docs/metrics.md,
"How it is served, and what it costs".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hmp.config import WORKER_ROLES, Config, Role
from hmp.errors import ConfigError
from hmp.transport import LatencyHistogram, TransportMetrics, process_settings

#: A daemon (:class:`hmp.nodes.base.Node`; not imported: the daemons import this module, not the reverse).
Node = Any

#: A scrape waits this long for the node's event loop to take a snapshot, then answers 503.
SNAPSHOT_TIMEOUT_S = 2.0
#: A scraper's connection is dropped after this long without progress (bounds ``stop()`` too).
REQUEST_TIMEOUT_S = 5.0

#: ``snapshot()``'s value of one metric: ``{"type": "counter" | "gauge" | "histogram", "help": str,
#: "unit": str, "samples": [(labels, value), ...]}``; a histogram's value is ``{"buckets": [(upper bound,
#: cumulative count), ..., (inf, count)], "sum": float, "count": int}``.
Metric = dict[str, Any]


# ---------------------------------------------------------------------------------------------- snapshot
class _Builder:
    """Collects the metrics of one snapshot; every sample gets the node's ``node`` and ``role`` labels."""

    def __init__(self, node_id: str, role: str) -> None:
        self.base = {"node": node_id, "role": role}
        self.out: dict[str, Metric] = {}

    # Positional-only: any keyword is a label (``kind``, ``code``, ``peer``, ...).
    def add(self, name: str, type_: str, help: str, value: Any, unit: str = "", /, **labels: Any) -> None:
        m = self.out.get(name)
        if m is None:
            m = self.out[name] = {"type": type_, "help": help, "unit": unit, "samples": []}
        m["samples"].append(({**self.base, **{k: str(v) for k, v in labels.items()}}, value))

    def counter(self, name: str, help: str, value: float, unit: str = "", /, **labels: Any) -> None:
        self.add(name, "counter", help, float(value), unit, **labels)

    def gauge(self, name: str, help: str, value: float | None, unit: str = "", /, **labels: Any) -> None:
        self.add(name, "gauge", help, float("nan") if value is None else float(value), unit, **labels)

    def histogram(self, name: str, help: str, hist: LatencyHistogram, unit: str = "seconds", /,
                  **labels: Any) -> None:
        self.add(name, "histogram", help, {"buckets": hist.cumulative(), "sum": hist.sum, "count": hist.count},
                 unit, **labels)


def snapshot(node: Node) -> dict[str, Metric]:
    """Every metric of ``node`` now: ``{name: Metric}`` (see :data:`Metric`), plain Python values.

    Call it on the node's event loop thread (the values are read without locks; :class:`MetricsEndpoint`
    does so for its scrapes). Counter names are without the ``_total`` the text format adds. Every sample
    carries the labels ``node`` (its id) and ``role``; the others are per metric (docs/metrics.md).
    """
    b = _Builder(node.id, str(node.node.role))
    now = time.monotonic()
    b.gauge("hmp_uptime_seconds", "seconds since the daemon started", now - node.started, "seconds")
    b.gauge("hmp_step", "the daemon's step as its heartbeats report it (a shard: its version)", node.step)
    _transport(b, process_settings().metrics, node)
    hb = getattr(node, "heartbeat_rtt", None)
    if isinstance(hb, LatencyHistogram):
        b.histogram("hmp_heartbeat_rtt_seconds", "round trip of this daemon's heartbeats to the scheduler", hb)
        b.gauge("hmp_heartbeat_last_rtt_seconds", "round trip of the last answered heartbeat",
                getattr(node, "heartbeat_last_rtt_s", None), "seconds")
    collect = ROLE_COLLECTORS.get(str(node.node.role))
    if collect is not None:
        collect(b, node, now)
    return b.out


def _transport(b: _Builder, tm: TransportMetrics | None, node: Node) -> None:
    server = node.server
    if server is not None:
        st = server.stats
        b.counter("hmp_server_received_bytes", "data-frame bytes of every message the server read", st["bytes_in"],
                  "bytes")
        b.counter("hmp_server_sent_bytes", "data-frame bytes of every reply the server sent", st["bytes_out"], "bytes")
        b.gauge("hmp_server_inflight_requests", "requests being handled or answered now: the server's queue "
                "(at the cap it stops reading and requests queue in the senders)", server.inflight)
        b.gauge("hmp_server_inflight_cap", "the most requests the server handles at once", server.max_inflight)
        b.counter("hmp_server_paused", "times the in-flight cap stopped the server reading", st["paused"])
        b.counter("hmp_server_shm_sent_bytes", "bytes of replies that went through shared-memory reply slots "
                  "(same host), not in hmp_server_sent_bytes", st["shm_bytes_out"], "bytes")
    if tm is None:
        return
    peers = {k: list(v) for k, v in tm.peers.items()}
    pending: dict[str, int] = {}
    for client in list(tm.clients):  # open clients: read live (closed ones were folded into peers)
        rec = peers.setdefault(client.peer_label, [0, 0, 0, 0, 0])
        rec[0] += client.stats["bytes_in"]
        rec[1] += client.stats["bytes_out"]
        rec[3] += client.stats["requests"]
        rec[4] += client.stats["shm_bytes_out"]
        pending[client.peer_label] = pending.get(client.peer_label, 0) + client.pending
    for peer, n in sorted(pending.items()):
        b.gauge("hmp_client_pending_requests", "this daemon's requests to the peer not answered yet", n, peer=peer)
    for peer, (bytes_in, bytes_out, req_in, req_out, shm_out) in sorted(peers.items()):
        b.counter("hmp_received_bytes", "data-frame bytes received from the peer (its requests and its replies)",
                  bytes_in, "bytes", peer=peer)
        b.counter("hmp_sent_bytes", "data-frame bytes sent to the peer (requests to it, replies to it)", bytes_out,
                  "bytes", peer=peer)
        b.counter("hmp_requests_received", "requests from the peer that the server accepted", req_in, peer=peer)
        b.counter("hmp_requests_sent", "requests sent to the peer", req_out, peer=peer)
        b.counter("hmp_shm_sent_bytes", "bytes of requests to the peer that went by shared-memory reference "
                  "(same host), not in hmp_sent_bytes", shm_out, "bytes", peer=peer)
    for cls, n in sorted(tm.served.items(), key=lambda kv: _kind(kv[0])):
        b.counter("hmp_server_requests", "requests the server accepted, by kind", n, kind=_kind(cls))
    for code, n in sorted(tm.server_errors.items()):
        b.counter("hmp_server_errors", "error replies the server sent (or would have, to one-way messages), by code",
                  n, code=code)
    for cls, hist in sorted(tm.latency.items(), key=lambda kv: _kind(kv[0])):
        b.histogram("hmp_request_seconds", "round trip of this daemon's answered requests, by kind", hist,
                    kind=_kind(cls))
    for (cls, code), n in sorted(tm.client_errors.items(), key=lambda kv: (_kind(kv[0][0]), kv[0][1])):
        b.counter("hmp_request_errors", "this daemon's requests that failed, by kind and code (the error reply's "
                  "code, or timeout, closed, peer_lost)", n, kind=_kind(cls), code=code)


def _kind(cls: type) -> str:
    kind = getattr(cls, "kind", None)
    return getattr(kind, "value", None) or cls.__name__


def _worker(b: _Builder, node: Any, now: float) -> None:
    m = getattr(node, "metrics", None)
    if not isinstance(m, dict):
        return
    b.counter("hmp_worker_samples", "training examples this worker has processed", m.get("samples", 0), "samples")
    b.counter("hmp_worker_updates", "updates this worker has pushed (steps)", m.get("updates", 0))
    t0 = getattr(node, "t_train0", 0.0) or 0.0
    wall = now - t0 if t0 else 0.0
    b.gauge("hmp_worker_samples_per_second", "examples per second since this worker began training",
            m.get("samples", 0) / wall if wall > 0 else 0.0, "samples/s")
    b.counter("hmp_worker_busy_seconds", "seconds spent computing (forward, backward, optimizer)",
              getattr(node, "busy_s", 0.0), "seconds")
    b.gauge("hmp_worker_loss", "training loss (moving average)", m.get("loss"))
    b.gauge("hmp_worker_epoch", "epoch this worker is in", m.get("epoch", 0))
    if "test_accuracy" in m:
        b.gauge("hmp_worker_test_accuracy", "test accuracy at this worker's last evaluation", m["test_accuracy"])
        b.gauge("hmp_worker_test_loss", "test loss at this worker's last evaluation", m.get("test_loss"))
    batch = getattr(node, "batch_size", None)
    if batch is not None:
        b.gauge("hmp_worker_batch_size", "this worker's batch size now", batch, "samples")
    if hasattr(node, "push_retries"):
        b.counter("hmp_worker_push_retries", "pushes and pulls sent again after a shard went down or moved",
                  node.push_retries)
    ps = getattr(node, "ps", None)
    if ps is not None and hasattr(ps, "bytes_out"):
        b.counter("hmp_worker_gradient_bytes", "gradient bytes pushed to the parameter server", ps.bytes_out, "bytes")
        b.counter("hmp_worker_parameter_bytes", "parameter bytes received from the parameter server", ps.bytes_in,
                  "bytes")
        b.gauge("hmp_worker_ps_version", "the parameter server's version in the last reply", getattr(ps, "version", 0))


def _shard(b: _Builder, node: Any, now: float) -> None:
    core = getattr(node, "core", None)
    if core is None or not hasattr(core, "updates_applied"):
        return
    b.counter("hmp_shard_updates", "updates applied (pushes: async, ssp; rounds: sync)", core.updates_applied)
    b.counter("hmp_shard_samples", "training examples behind the applied updates", core.samples, "samples")
    b.gauge("hmp_shard_version", "the shard's parameter version", core.version)
    up = now - node.started
    b.gauge("hmp_shard_updates_per_second", "updates applied per second since the shard started (rate() over "
            "hmp_shard_updates_total for a window)", core.updates_applied / up if up > 0 else 0.0, "updates/s")
    b.gauge("hmp_shard_live_workers", "workers the shard counts in sync rounds and SSP bounds",
            len(core.live_workers))
    for key, value in sorted(getattr(node, "stats", {}).items()):
        b.counter(f"hmp_shard_{key}", f"the shard's {key.replace('_', ' ')} so far", value)


def _scheduler(b: _Builder, node: Any, now: float) -> None:
    core = getattr(node, "core", None)
    membership = getattr(core, "membership", None)
    if membership is None:
        return
    states: dict[str, int] = {}
    for state in membership.states().values():
        states[state] = states.get(state, 0) + 1
    for state, n in sorted(states.items()):
        b.gauge("hmp_scheduler_members", "nodes of the topology in each membership state", n, state=state)
    b.gauge("hmp_scheduler_elapsed_seconds", "seconds since training began", core.elapsed(now), "seconds")
    b.gauge("hmp_scheduler_shards_down", "PS shards down now", len(core.shards_down))
    b.gauge("hmp_scheduler_best_accuracy", "best test accuracy reported so far", core.best_accuracy)
    report = core.run_report
    b.counter("hmp_scheduler_work_redone", "examples handed out again because their worker was gone",
              report.work_redone, "samples")
    latest = report.latest()
    total = sum(p.get("updates", 0) for p in latest.values()) or 1
    for worker, p in sorted(latest.items()):
        b.gauge("hmp_scheduler_worker_updates", "updates in the worker's last report", p.get("updates", 0),
                worker=worker)
        b.gauge("hmp_scheduler_worker_samples_per_second", "samples/s in the worker's last report",
                p.get("samples_per_s", 0.0), "samples/s", worker=worker)
        b.gauge("hmp_scheduler_update_share", "the worker's share of the updates reported so far",
                p.get("updates", 0) / total, worker=worker)


#: role -> the function adding its own metrics to a snapshot (``f(builder, node, now)``)
ROLE_COLLECTORS: dict[str, Callable[[_Builder, Any, float], None]] = {
    Role.SCHEDULER: _scheduler, Role.PS: _shard, **{r: _worker for r in WORKER_ROLES}}


# ---------------------------------------------------------------------------------------------- serving
def host_of(address: str) -> str:
    """The host part of a ZeroMQ address (``tcp://10.0.0.2:5555`` -> ``10.0.0.2``; ``*`` -> ``0.0.0.0``;
    ``ipc://``, ``inproc://`` -> ``127.0.0.1``)."""
    if not address.startswith("tcp://"):
        return "127.0.0.1"
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    host = host.strip("[]")
    return "0.0.0.0" if host in ("*", "") else host


def check_ports(cfg: Config, *, emulated: bool = False) -> None:
    """A fixed ``[metrics] port`` needs one daemon per host (each binds it): ConfigError when two would
    share one. ``emulated``: the daemons run on the emulated hosts their ``host`` names (each its own
    network), else all on this machine, where a wildcard bind (``*``, ``0.0.0.0``) clashes with any."""
    m = cfg.metrics
    if not m.enabled or m.port == 0:
        return
    by_host: dict[str, list[str]] = {}
    for n in cfg.nodes:
        host = host_of(n.bind)
        key = n.host if emulated else ("*" if host in ("0.0.0.0", "::") else host)
        by_host.setdefault(key, []).append(n.id)
    if not emulated and "*" in by_host and len(cfg.nodes) > 1:
        clash = ("every address", [n.id for n in cfg.nodes])
    else:
        clash = next(((h, ids) for h, ids in by_host.items() if len(ids) > 1), None)
    if clash is not None:
        raise ConfigError(cfg.path, "metrics.port",
                          f"port = 0 (the OS picks a free port per daemon) or one daemon per host: "
                          f"{', '.join(clash[1])} would all serve metrics on {clash[0]} port {m.port}")


def url_file(cfg: Config, node_id: str) -> Path:
    """Where daemon ``node_id`` writes its endpoint's ``{"node", "role", "url", "pid"}`` while it serves."""
    return cfg.report_dir / "metrics" / f"{node_id}.json"


def read_urls(cfg: Config, pids: dict[str, int] | None = None) -> dict[str, str]:
    """``{node id: metrics URL}`` of the daemons that serve now (their :func:`url_file`); with ``pids``,
    only files written by those processes (not a stale one of an earlier run)."""
    out = {}
    for n in cfg.nodes:
        try:
            info = json.loads(url_file(cfg, n.id).read_text())
        except (OSError, ValueError):
            continue
        if pids is None or info.get("pid") == pids.get(n.id):
            out[n.id] = str(info.get("url", ""))
    return out


class MetricsEndpoint:
    """``node``'s metrics over HTTP (module docstring). ``await MetricsEndpoint.start(node)`` on the node's
    loop, after its server is bound; ``await endpoint.stop()`` before the loop ends."""

    def __init__(self, node: Node, httpd: Any, thread: threading.Thread, url: str, url_path: Path | None) -> None:
        self.node, self._httpd, self._thread, self.url, self.url_path = node, httpd, thread, url, url_path
        self.port: int = httpd.server_address[1]

    @classmethod
    async def start(cls, node: Node, *, write_url: bool = True) -> MetricsEndpoint:
        """Bind ``[metrics] port`` on the host part of the node's bound address and serve; a port in use is
        a ConfigError naming ``metrics.port`` (no prometheus-client: one naming ``metrics.enabled``).
        ``write_url``: publish the URL in :func:`url_file`."""
        import asyncio

        try:
            from prometheus_client import CollectorRegistry
            from prometheus_client.exposition import (ThreadingWSGIServer, WSGIRequestHandler, make_server,
                                                      make_wsgi_app)
        except ImportError as exc:
            raise ConfigError(node.cfg.path, "metrics.enabled", f"false, or the prometheus-client package installed "
                                                                f"(pip install prometheus-client): {exc}") from None

        assert node.server is not None
        host = host_of(node.server.address)
        port = node.cfg.metrics.port
        loop = asyncio.get_running_loop()
        registry = CollectorRegistry(auto_describe=False)  # never collect at register: that needs the loop
        registry.register(_LoopCollector(node, loop))
        inner = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            try:
                return inner(environ, start_response)
            except Exception as exc:  # the loop did not answer in time, or the node is stopping
                start_response("503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
                return [f"{node.id}: no snapshot of the metrics: {exc.__class__.__name__}: {exc}\n".encode()]

        class Handler(WSGIRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # a stalled scraper's socket times out

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a line per scrape would drown the daemon's log

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = False  # server_close() joins the request threads: nothing is left running
            block_on_close = True

        try:
            httpd = make_server(host, port, app, Server, handler_class=Handler)
        except OSError as exc:
            raise ConfigError(node.cfg.path, "metrics.port",
                              f"a port free on {host} for {node.id}'s metrics: port {port}: {exc.strerror or exc}"
                              f" (another daemon or process holds it; 0 lets the OS pick)") from None
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                  name=f"{node.id}-metrics", daemon=True)
        thread.start()
        url_host = host_of(node.advertised) if node.advertised.startswith("tcp://") else host
        if url_host in ("0.0.0.0", "::"):
            url_host = socket.gethostname()
        url = f"http://{f'[{url_host}]' if ':' in url_host else url_host}:{httpd.server_address[1]}/metrics"
        path = None
        if write_url:
            path = url_file(node.cfg, node.id)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"node": node.id, "role": str(node.node.role), "url": url,
                                           "pid": os.getpid()}))
                tmp.replace(path)
            except OSError as exc:  # the endpoint serves all the same; only the launcher's listing lacks it
                node.log.warning("metrics_url_not_written", path=str(path), error=str(exc))
                path = None
        return cls(node, httpd, thread, url, path)

    async def stop(self) -> None:
        """Close the port and join the server's threads (off the loop: a scrape in flight needs the loop)."""
        import asyncio

        if self.url_path is not None:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(self.url_path.read_text()).get("pid") == os.getpid():
                    self.url_path.unlink()
            self.url_path = None
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return

        def close() -> None:
            httpd.shutdown()
            httpd.server_close()
            self._thread.join()

        await asyncio.to_thread(close)


class _LoopCollector:
    """A prometheus_client collector whose ``collect`` (on the HTTP thread) takes a :func:`snapshot` on the
    node's event loop and turns it into metric families there, off the loop."""

    def __init__(self, node: Node, loop: Any) -> None:
        self.node, self.loop = node, loop

    def collect(self) -> Iterator[Any]:
        fut: concurrent.futures.Future[dict[str, Metric]] = concurrent.futures.Future()

        def take() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(snapshot(self.node))
                except BaseException as exc:  # noqa: BLE001 - handed to the scrape, which answers 503
                    fut.set_exception(exc)

        self.loop.call_soon_threadsafe(take)
        try:
            snap = fut.result(SNAPSHOT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"the event loop did not answer within {SNAPSHOT_TIMEOUT_S} s") from None
        yield from families(snap)


def families(snap: dict[str, Metric]) -> Iterator[Any]:
    """prometheus_client metric families of a :func:`snapshot`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    for name, m in snap.items():
        keys = sorted({k for labels, _ in m["samples"] for k in labels})
        if m["type"] == "counter":
            fam: Any = CounterMetricFamily(name, m["help"], labels=keys)
        elif m["type"] == "gauge":
            fam = GaugeMetricFamily(name, m["help"], labels=keys)
        else:
            fam = HistogramMetricFamily(name, m["help"], labels=keys)
        for labels, value in m["samples"]:
            values = [labels.get(k, "") for k in keys]
            if m["type"] == "histogram":
                fam.add_metric(values, [(floatToGoString(le), n) for le, n in value["buckets"]], value["sum"])
            else:
                fam.add_metric(values, value)
        yield fam


__all__ = ["MetricsEndpoint", "Metric", "ROLE_COLLECTORS", "check_ports", "families", "host_of", "read_urls",
           "snapshot", "url_file"]
