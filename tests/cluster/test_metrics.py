"""Prometheus metrics (docs/metrics.md): real daemons serve them over HTTP, the counters move while a job
runs, the endpoints go away with their daemons, and nothing is bound when metrics are off."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hmp import plots
from hmp.cluster import LocalCluster
from hmp.errors import ConfigError
from hmp.job import load
from hmp.metrics import snapshot, url_file
from hmp.nodes.base import Node
from hmp.transport import process_settings

from tests.support import free_port, write_config

ROOT = Path(__file__).resolve().parents[2]


def _with_metrics(path: Path, port: int = 0) -> Path:
    path.write_text(path.read_text() + f"\n[metrics]\nenabled = true\nport = {port}\n")
    return path


def _scrape(url: str, timeout: float = 10.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels without node and role): value}`` of one scrape."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("node", "role")))
            out[(s.name, labels)] = s.value
    return out


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2.0)
        try:
            s.connect((host, int(port)))
        except ConnectionRefusedError:
            return True
    return False


def _metrics_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.endswith("-metrics")]


async def test_a_running_job_s_daemons_serve_metrics_that_move_and_go_away_with_them(tmp_path):
    """Scheduler, shard and worker each serve their metrics; two scrapes a second apart show samples,
    updates, bytes per peer, requests by kind and latencies moving; after the job every port is refused and
    every URL file gone. The job's report draws the three panels, every report point in them."""
    path = _with_metrics(write_config(tmp_path, target=0.9999, epochs=500, max_seconds=60))
    cfg = load(path)
    async with LocalCluster(path) as cluster:
        urls = cluster.metrics_urls
        assert set(urls) == {"scheduler", "ps0", "ps1", "cpu0", "gpu0"}, urls
        assert all(u.startswith("http://127.0.0.1:") and u.endswith("/metrics") for u in urls.values()), urls
        worker = ("hmp_worker_samples_total", ())
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(_scrape, urls["cpu0"])).get(worker, 0) <= 0:
            assert time.monotonic() < deadline, "cpu0 never trained"
            await asyncio.sleep(0.2)
        names = ("scheduler", "ps0", "cpu0")
        first = {n: await asyncio.to_thread(_scrape, urls[n]) for n in names}
        await asyncio.sleep(1.0)
        second = {n: await asyncio.to_thread(_scrape, urls[n]) for n in names}

        def moved(node: str, name: str, **labels: str) -> None:
            key = (name, tuple(sorted(labels.items())))
            assert second[node].get(key, 0) > first[node].get(key, 0), (node, key, first[node].get(key),
                                                                         second[node].get(key))

        moved("cpu0", "hmp_worker_samples_total")
        moved("cpu0", "hmp_worker_updates_total")
        moved("cpu0", "hmp_sent_bytes_total", peer="ps0")
        moved("cpu0", "hmp_received_bytes_total", peer="ps0")
        moved("cpu0", "hmp_request_seconds_count", kind="push")
        moved("ps0", "hmp_shard_updates_total")
        moved("ps0", "hmp_received_bytes_total", peer="cpu0")
        moved("ps0", "hmp_sent_bytes_total", peer="gpu0")
        moved("ps0", "hmp_server_requests_total", kind="push")
        moved("scheduler", "hmp_server_requests_total", kind="heartbeat")
        moved("scheduler", "hmp_requests_received_total", peer="gpu0")
        assert second["cpu0"][("hmp_heartbeat_rtt_seconds_count", ())] > 0
        assert second["cpu0"][("hmp_worker_samples_per_second", ())] > 0
        assert second["ps0"][("hmp_server_inflight_cap", ())] >= 1
        assert 0 < second["scheduler"][("hmp_scheduler_update_share", (("worker", "cpu0"),))] < 1
        await cluster.finish("metrics test done")
        report = await cluster.train(timeout_s=60)
    for node, url in urls.items():
        assert _refused(url), f"{node}'s metrics port still open after the job"
        assert not url_file(cfg, node).exists(), node
    drawn = plots.plot_report(report, tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert set(drawn) == set(plots.PANELS)
    for worker in ("cpu0", "gpu0"):
        points = len(report["series"][worker])
        assert drawn["loss"][worker] == points >= 2, (worker, drawn)
        assert drawn["throughput"][worker] >= points - 2, (worker, drawn)  # the final report may be too close
        assert drawn["update shares"][worker] >= points, (worker, drawn)


async def _serve(node: Node) -> asyncio.Task:
    task = asyncio.create_task(node.run())
    deadline = time.monotonic() + 20
    while node.server is None or (node.cfg.metrics.enabled and node.metrics_endpoint is None):
        assert not task.done(), task.result()
        assert time.monotonic() < deadline, "the node did not start"
        await asyncio.sleep(0.02)
    return task


async def test_an_endpoint_serves_survives_bad_requests_and_stops_with_its_daemon(tmp_path):
    """A daemon's endpoint serves its own labels, answers garbage with an HTTP error and serves on; once the
    daemon stops, the port is refused, its thread is gone and its URL file removed."""
    cfg = load(_with_metrics(write_config(tmp_path)))
    node = Node(cfg, "ps0")
    task = await _serve(node)
    try:
        url = node.metrics_endpoint.url
        assert json.loads(url_file(cfg, "ps0").read_text())["url"] == url
        assert _metrics_threads() == ["ps0-metrics"]
        with socket.create_connection(("127.0.0.1", node.metrics_endpoint.port), timeout=5) as s:
            s.sendall(b"\x00\x01 not http at all\r\n\r\n")
            answer = await asyncio.to_thread(s.recv, 1024)
        assert b"400" in answer, answer[:200]  # a bad request, answered (as HTTP/0.9: no status line)
        scraped = await asyncio.to_thread(_scrape, url)
        assert scraped[("hmp_uptime_seconds", ())] > 0
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        assert 'hmp_uptime_seconds{node="ps0",role="ps"}' in text
        # A loop that does not answer (here: busy with this very call) costs the scraper a 503 after
        # SNAPSHOT_TIMEOUT_S, not a hang, and the endpoint serves on.
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(url, timeout=10)
        assert (await asyncio.to_thread(_scrape, url))[("hmp_uptime_seconds", ())] > 0
        snap = snapshot(node)  # the plain dict other exporters push
        assert snap["hmp_server_inflight_cap"]["type"] == "gauge"
        assert snap["hmp_uptime_seconds"]["samples"][0][0] == {"node": "ps0", "role": "ps"}
    finally:
        node.stopping.set()
        assert await asyncio.wait_for(task, 20) == 0
    assert _refused(url)
    assert _metrics_threads() == []
    assert not url_file(cfg, "ps0").exists()
    assert process_settings().metrics is None


async def test_metrics_are_off_by_default_and_bind_nothing(tmp_path):
    cfg = load(write_config(tmp_path))
    assert not cfg.metrics.enabled
    node = Node(cfg, "ps0")
    task = await _serve(node)
    try:
        assert node.metrics_endpoint is None and process_settings().metrics is None
        assert _metrics_threads() == []
        assert not (cfg.report_dir / "metrics").exists()
    finally:
        node.stopping.set()
        assert await asyncio.wait_for(task, 20) == 0


async def test_a_taken_metrics_port_is_a_config_error_naming_the_key(tmp_path):
    """In process: ConfigError on metrics.port, the node's server closed again; as a daemon: exit code 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = _with_metrics(write_config(tmp_path), port=port)
        node = Node(load(path), "ps0")
        with pytest.raises(ConfigError, match=r"metrics\.port.*port %d" % port):
            await asyncio.wait_for(node.run(), 20)
        assert node.server is not None and not node.server.reading  # closed again
        assert process_settings().metrics is None and _metrics_threads() == []
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "hmp.nodes.main", "ps", "--config", str(path), "--id", "ps0"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "HMP_FORKSERVER": "0"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "metrics.port" in proc.stderr


def test_a_fixed_port_shared_by_daemons_of_one_host_is_refused_before_any_starts(tmp_path):
    path = _with_metrics(write_config(tmp_path), port=free_port())
    with pytest.raises(ConfigError, match=r"metrics\.port.*scheduler, ps0, ps1"):
        LocalCluster(path)
