"""The same daemons on a Ray cluster (``hmp-launch --engine ray``, :class:`hmp.ray_engine.RayCluster`): the
digits job end to end, a daemon's actor killed with ``ray.kill`` handled like a lost node, nothing left
afterwards, and two Ray nodes on two emulated hosts. One local Ray instance serves the module."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hmp.errors import ConfigError
from hmp.transport.shm import cleanup_stale
from tests.support import digits_job_text, free_port, write_config

# one worker runs the module: one Ray instance, one emulated subnet
pytestmark = pytest.mark.xdist_group("ray")

ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'hmp[ray]')")

from hmp.ray_engine import RayCluster  # noqa: E402  (needs ray)

LAUNCH = [sys.executable, "-m", "hmp.launch"]
RAY_BIN = str(Path(sys.executable).with_name("ray"))
SUBNET = "10.231.13.0/24"  # the emulated-hosts tests' own range, apart from tests/cluster/test_emulate.py's
#: this module's job name: its shared-memory check must not see the segments of a test running beside it
JOB = "raytest"


#: Where the module's Ray instance exports its metrics (Ray's metrics agent: only with ray[default]).
METRICS_EXPORT_PORT = free_port()
#: Ray's metrics agent can run here: its modules need ray[default]'s packages (the minimal ray has none).
RAY_AGENT = all(importlib.util.find_spec(m) for m in ("aiohttp", "grpc", "opentelemetry"))


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for the module (logical CPUs for five one-thread daemons, on this machine's cores);
    its metrics exported on METRICS_EXPORT_PORT every half second (where Ray's metrics agent runs)."""
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=100 * 1024 * 1024, _metrics_export_port=METRICS_EXPORT_PORT,
             _system_config={"metrics_report_interval_ms": 500} if RAY_AGENT else None)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def assert_nothing_left(daemon_pids: list[int], job_name: str = JOB) -> None:
    """No daemon process, no actor holding resources, no live placement group, no shared-memory file of the job."""
    deadline = time.monotonic() + 15
    while True:
        alive = [p for p in daemon_pids if _pid_alive(p)]
        total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        # (this test process's own arena, from a PSClient of an earlier test, lives until it exits: not the job's)
        shm = [n for n in os.listdir("/dev/shm")
               if n.startswith(f"hmp.{job_name}.") and n.split(".")[3:4] != [str(os.getpid())]]
        if not (alive or free < total or groups or shm) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not alive, f"daemon processes left: {alive}"
    assert free == total, f"actors still hold CPUs: {free} of {total} free"
    assert not groups, f"placement groups left: {groups}"
    assert not shm, f"shared memory left: {shm}"


def test_ray_is_optional(tmp_path):
    """`import hmp` and the local launcher never import Ray; `--engine ray` without it: one line, exit 2."""
    code = "import sys, hmp, hmp.launch, hmp.cluster; hmp.LocalCluster; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    fake = tmp_path / "noray" / "ray"  # a `ray` that cannot be imported, as where it is not installed
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    cfg = write_config(tmp_path, name=JOB)
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([*LAUNCH, "--engine", "ray", str(cfg)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "hmp[ray]"' in lines[0], r.stderr


# ---------------------------------------------------------------------------------- two emulated hosts

HOSTS_NODES = [("scheduler", "scheduler", "h0", 'bind = "tcp://127.0.0.1:47100"  # under Ray: h0\'s IP, port *'), ("ps0", "ps", "h0", ""), ("ps1", "ps", "h1", ""),
               ("cpu0", "cpu_worker", "h0", "batch_size = 16"), ("gpu0", "gpu_worker", "h1",
                                                                 'device = "cpu"\nbatch_size = 128')]


def test_two_ray_nodes_on_two_emulated_hosts(tmp_path):
    """A Ray head on emulated host h0, a Ray worker node on h1: a job whose config puts shards and workers on
    both trains to its target, each daemon running (and its log saying so) on the host the config named;
    the namespaces and every Ray process in them are removed afterwards, also on failure."""
    from hmp.emulate import EmulatedHosts, EmulationUnavailable, HostSpec

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two Ray nodes on emulated hosts need root and iproute2's `ip netns`")
    hosts = EmulatedHosts([HostSpec("h0"), HostSpec("h1")], SUBNET)
    try:
        hosts.start()
    except EmulationUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    temp = tempfile.mkdtemp(prefix="hmpray")  # short: Ray's socket paths live under it
    try:
        ip = {h: hosts.address(h) for h in ("h0", "h1")}
        # A throw-away cluster on private addresses: no token authentication (or every process would need the token).
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        common = ["--num-cpus=4", "--object-store-memory=80000000", "--block", "--disable-usage-stats"]
        hosts.popen("h0", [RAY_BIN, "start", "--head", f"--node-ip-address={ip['h0']}", "--port=6379",
                           "--include-dashboard=false", f"--temp-dir={temp}", '--resources={"hmp_host:h0": 100}',
                           *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        hosts.popen("h1", [RAY_BIN, "start", f"--address={ip['h0']}:6379", f"--node-ip-address={ip['h1']}",
                           '--resources={"hmp_host:h1": 100}', *common],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        # Both nodes up before the job asks for hmp_host:h1 (the launcher refuses a host no node offers).
        probe = ("import ray, time; ray.init(address='%s:6379', log_to_driver=False); t = time.monotonic()\n"
                 "while len([n for n in ray.nodes() if n['Alive']]) < 2 and time.monotonic() - t < 40: time.sleep(0.2)\n"
                 "print(len([n for n in ray.nodes() if n['Alive']]))" % ip["h0"])
        up = subprocess.run(hosts.command("h0", [sys.executable, "-c", probe]), capture_output=True, text=True,
                            timeout=90, env=env)
        assert up.stdout.strip().endswith("2"), up.stdout + up.stderr
        text = digits_job_text(tmp_path, name="rayemu", target=0.9) + "\n[ps]\nchunk_bytes = 16384\n"
        for nid, role, host, extra in HOSTS_NODES:
            text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"\nhost = "{host}"\n{extra}\n'
        cfg = tmp_path / "job.toml"
        cfg.write_text(text)
        r = subprocess.run(hosts.command("h0", [*LAUNCH, "--engine", "ray", "--address", f"{ip['h0']}:6379",
                                                str(cfg)]), capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads((tmp_path / "run" / "report.json").read_text())
        assert report["final"]["test_accuracy"] >= 0.9
        for nid, _, host, _ in HOSTS_NODES:
            where = report["ray"]["nodes"][nid]
            assert where["ip"] == ip[host] and where["address"].startswith(f"tcp://{ip[host]}:"), (nid, where)
            log = (tmp_path / "run" / "logs" / f"{nid}.log").read_text()
            assert f'"address": "tcp://{ip[host]}:' in log, (nid, log[-2000:])  # the daemon's own `serving` line
            assert f'"node": "{nid}", "host": "{host}", "ip": "{ip[host]}"' in r.stderr, r.stderr
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("hmp.rayemu.")]  # the launcher cleaned up
    finally:
        # The throw-away Ray nodes need no graceful stop (the job's daemons are done, or the test failed): every
        # process in the namespaces is killed at once, instead of hosts.close()'s SIGTERM and grace periods.
        for h in hosts.hosts.values():
            for pid in subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        hosts.close()
        cleanup_stale("rayemu")  # a failed job's, its daemons killed above
        shutil.rmtree(temp, ignore_errors=True)
    for mark in (temp, SUBNET.rsplit(".", 1)[0] + "."):  # the head's temp dir, the nodes' addresses
        left = subprocess.run(["pgrep", "-f", mark], capture_output=True, text=True).stdout.split()
        assert not left, f"Ray processes left: {left}"


# ---------------------------------------------------------------------------------- one local Ray instance

async def test_host_no_ray_node_has_is_a_config_error(tmp_path, ray_address):
    """A node whose host no Ray node offers would wait forever: a ConfigError naming the key, nothing started.
    Restarts, not supported under Ray yet, are refused the same way."""
    cfg = write_config(tmp_path, name=JOB)
    text = cfg.read_text()
    cfg.write_text(text.replace("[model]", "restarts = {cpu_worker = 1}\n\n[model]", 1))
    with pytest.raises(ConfigError, match=r"job\.restarts.*cpu_worker = 1"):
        RayCluster(cfg)
    cfg.write_text(text.replace('id = "gpu0"', 'id = "gpu0"\nhost = "nowhere"'))
    with pytest.raises(ConfigError, match=r"nodes\[4\]\.host.*hmp_host:nowhere.*'nowhere'"):
        async with RayCluster(cfg):
            pass
    assert_nothing_left([])


def test_launch_engine_ray(tmp_path, ray_address):
    """`hmp-launch --engine ray --address ADDR CONFIG` trains the digits job to its target on the Ray cluster;
    each daemon's log and the report are where the launcher runs; nothing is left."""
    cfg = write_config(tmp_path, name=JOB, target=0.9, workers="cpu")
    r = subprocess.run([*LAUNCH, "--engine", "ray", "--address", ray_address, str(cfg)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "job finished: target accuracy" in r.stdout
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["final"]["test_accuracy"] >= 0.9
    nodes = report["ray"]["nodes"]
    assert sorted(nodes) == ["cpu0", "ps0", "ps1", "scheduler"]
    ip = ray.util.get_node_ip_address()
    for nid, where in nodes.items():
        assert where["ip"] == ip and where["address"].startswith(f"tcp://{ip}:"), where
        log = (tmp_path / "run" / "logs" / f"{nid}.log").read_text()
        assert '"serving"' in log and where["address"] in log
    assert report["ray"]["lost"] == []
    assert "SIGTERM handler" not in r.stderr  # Ray's noise; the launcher keeps its own handlers
    assert_nothing_left([w["pid"] for w in nodes.values()])


async def test_killed_actor_is_a_lost_node(tmp_path, ray_address):
    """Through the API: a worker's actor killed with ray.kill mid-job is a lost node (its daemon stops with it,
    Ray's error is logged and reported); the other worker trains on and the job ends with a report."""
    cfg = write_config(tmp_path, name=JOB, target=0.999, epochs=1000, max_seconds=60)
    async with RayCluster(cfg) as cluster:
        assert cluster.placement["scheduler"]["address"].startswith("tcp://")
        pids = [p["pid"] for p in cluster.placement.values()]
        waiter = asyncio.ensure_future(cluster.train(timeout_s=90))
        try:
            async def updates(wid: str) -> int:
                st = await cluster.status() or {}
                return int((st.get("workers", {}).get(wid) or {}).get("updates", 0))

            deadline = time.monotonic() + 30
            while await updates("cpu0") < 5 or await updates("gpu0") < 5:
                assert time.monotonic() < deadline and not waiter.done(), "the workers never trained"
                await asyncio.sleep(0.2)
            cpu0_pid = cluster.placement["cpu0"]["pid"]
            cluster.kill("cpu0")
            deadline = time.monotonic() + 20
            while _pid_alive(cpu0_pid) or not cluster.lost:  # the daemon stops with its actor; the driver sees it
                assert time.monotonic() < deadline, "cpu0's daemon outlived its actor, or the loss went unseen"
                await asyncio.sleep(0.1)
            before = await updates("gpu0")
            deadline = time.monotonic() + 20
            while await updates("gpu0") < before + 20:  # the job goes on with gpu0
                assert time.monotonic() < deadline and not waiter.done(), "the job did not go on without cpu0"
                await asyncio.sleep(0.2)
            await cluster.finish("test over")
            report = await waiter
        finally:
            waiter.cancel()
    assert [lost["node"] for lost in report["ray"]["lost"]] == ["cpu0"]
    cpu0_log = (tmp_path / "run" / "logs" / "cpu0.log").read_text()
    assert '"signal": "SIGTERM"' in cpu0_log and '"event": "stopped"' in cpu0_log, cpu0_log[-1500:]  # graceful
    assert "Actor" in report["ray"]["lost"][0]["error"], report["ray"]["lost"]
    assert cluster.worker_exits == {"cpu0": -9}
    assert report["final"]["stop_reason"].startswith("test over") or "test over" in json.dumps(report["final"])
    assert report["workers"]["gpu0"]["updates"] > report["workers"]["cpu0"]["updates"]
    assert_nothing_left(pids)


def test_a_killed_launcher_leaves_nothing(tmp_path, ray_address):
    """`hmp-launch --engine ray` killed with SIGKILL mid-job: Ray kills its actors (none is detached), each daemon
    gets SIGTERM from its keeper's death and stops gracefully; no process, actor, placement group or shared
    memory is left."""
    cfg = write_config(tmp_path, name=JOB, target=0.999, epochs=1000, max_seconds=60)
    launcher = subprocess.Popen([*LAUNCH, "--engine", "ray", "--address", ray_address, str(cfg)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logs = tmp_path / "run" / "logs"
    try:
        deadline = time.monotonic() + 60
        while not all(p.exists() and '"event": "training"' in p.read_text() for p in
                      (logs / "cpu0.log", logs / "gpu0.log")):
            assert time.monotonic() < deadline and launcher.poll() is None, "the job never started training"
            time.sleep(0.2)
    finally:
        launcher.kill()
        launcher.wait()
    pids = []
    for nid in ("scheduler", "ps0", "ps1", "cpu0", "gpu0"):
        serving = [json.loads(line) for line in (logs / f"{nid}.log").read_text().splitlines()
                   if '"event": "serving"' in line]
        pids.append(serving[0]["pid"])
    assert_nothing_left(pids)
    for nid in ("cpu0", "gpu0"):
        assert '"signal": "SIGTERM"' in (logs / f"{nid}.log").read_text()  # a graceful stop, not a SIGKILL


def _hist(buckets: list[tuple[float, int]], total: float) -> dict:
    return {"buckets": buckets, "sum": total, "count": buckets[-1][1]}


def test_ray_metrics_records_hmp_values_through_ray_metric_objects(ray_address):
    """RayMetrics, in a Ray worker with the real ray.util.metrics objects: a counter grows by what hmp's grew, a
    gauge series that leaves hmp's snapshot goes to 0, a histogram's new observations are replayed bucket by
    bucket (the mean when they fall into one bucket, else the bucket's upper bound; more than the per-call cap
    wait for the next call), so that its count is hmp's."""
    inf = float("inf")
    lat = "round trip"
    snaps = [
        {"hmp_c": {"type": "counter", "help": "c", "samples": [({"node": "w0"}, 3.0)]},
         "hmp_g": {"type": "gauge", "help": "g", "samples": [({"state": "live"}, 2.0), ({"state": "joining"}, 1.0)]},
         "hmp_h": {"type": "histogram", "help": lat,
                   "samples": [({"kind": "push"}, _hist([(0.1, 2), (1.0, 2), (inf, 2)], 0.1))]}},
        {"hmp_c": {"type": "counter", "help": "c", "samples": [({"node": "w0"}, 10.0)]},
         "hmp_g": {"type": "gauge", "help": "g", "samples": [({"state": "live"}, 3.0)]},
         "hmp_h": {"type": "histogram", "help": lat,
                   "samples": [({"kind": "push"}, _hist([(0.1, 2), (1.0, 8), (inf, 9)], 9.0))]}},
    ]
    snaps.append(snaps[1])  # the observations the cap held back

    @ray.remote(num_cpus=0)
    def record(snaps):
        from hmp.ray_engine import RayMetrics

        r = RayMetrics({"job": "j"}, max_observations=5)
        calls = [r.record(s) for s in snaps]
        return calls, r.summary(), {n: type(m).__name__ for n, m in r._metrics.items()}

    calls, summary, kinds = ray.get(record.remote(snaps), timeout=60)
    assert kinds == {"hmp_c": "Counter", "hmp_g": "Gauge", "hmp_h": "Histogram"}
    assert summary["hmp_c"] == [[{"job": "j", "node": "w0"}, 10.0]]
    assert summary["hmp_g"] == [[{"job": "j", "state": "joining"}, 0.0], [{"job": "j", "state": "live"}, 3.0]]
    # 2 in (0, 0.1] at 0.05; then 6 in (0.1, 1] at 0.55 (5 now, 1 at the next call) and 1 above 1 at 2 x 1.0
    (tags, hist), = summary["hmp_h"]
    assert tags == {"job": "j", "kind": "push"} and hist["count"] == 9
    assert hist["sum"] == pytest.approx(2 * 0.05 + 6 * 0.55 + 2.0)
    assert calls == [1 + 2 + 2, 1 + 2 + 5, 0 + 1 + 2]  # counter, gauges, observations


def _ray_export(port: int) -> list[tuple[str, dict, float]] | None:
    """The samples of the Ray node's metrics export, or None where nothing serves it (no Ray metrics agent)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return None
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_rays_metrics_export_carries_what_was_recorded(ray_address):
    """What RayMetrics records in an actor comes out of the Ray node's metrics export (Prometheus text, names
    prefixed ``ray_``), tagged with hmp's labels: read back from the export port. Needs Ray's metrics agent
    (``pip install "ray[default]"``); skipped with the minimal ray, whose nodes export nothing."""
    if not RAY_AGENT:
        pytest.skip("no Ray metrics agent exports here (the minimal `ray`; Ray's export needs ray[default])")
    deadline = time.monotonic() + 15
    while _ray_export(METRICS_EXPORT_PORT) is None:  # the agent starts serving a few seconds after Ray
        assert time.monotonic() < deadline, f"Ray's metrics agent does not serve port {METRICS_EXPORT_PORT}"
        time.sleep(0.2)
    inf = float("inf")

    @ray.remote(num_cpus=0)
    class Recorder:
        def __init__(self) -> None:
            from hmp.ray_engine import RayMetrics

            self.metrics = RayMetrics({"job": "readback"})

        def record(self, snap: dict) -> int:
            return self.metrics.record(snap)

    recorder = Recorder.remote()
    try:
        for samples, buckets in ((3.0, [(0.1, 2), (1.0, 2), (inf, 2)]), (10.0, [(0.1, 2), (1.0, 8), (inf, 9)])):
            ray.get(recorder.record.remote({
                "hmp_rb_samples": {"type": "counter", "help": "c", "samples": [({"node": "w0"}, samples)]},
                "hmp_rb_seconds": {"type": "histogram", "help": "h",
                                   "samples": [({"node": "w0"}, _hist(buckets, 1.0))]}}), timeout=30)
        deadline = time.monotonic() + 20
        while True:
            got = {name: value for name, labels, value in _ray_export(METRICS_EXPORT_PORT) or []
                   if labels.get("job") == "readback" and labels.get("node") == "w0"}
            if got.get("ray_hmp_rb_samples_total") == 10.0 and got.get("ray_hmp_rb_seconds_count") == 9.0:
                break
            assert time.monotonic() < deadline, f"Ray's export never carried the recorded values: {got}"
            time.sleep(0.3)
    finally:
        ray.kill(recorder)


# ---------------------------------------------------------------------------------- the job manager on Ray

RING_JOB = """
[job]
name = "ring"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end

[model]
name = "digits_mlp"
args = { hidden = [32] }

[data]
kind = "digits"

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9

[train]
batch_size = 32
epochs = 4                 # a second or two of training: several reads of each endpoint by its actor
max_seconds = 60
eval_every_s = 1.0

[metrics]
enabled = true

[submit]
min_workers = 2
max_workers = 2
workers = 2
model_type = "ring-tiny"   # known to the test's cost model: no profiling at submission
utility = { kind = "linear", value = 1.0, zero_at_s = 600 }
"""


async def test_job_manager_on_ray_with_metrics_through_ray(tmp_path, ray_address):
    """`JobManager(RayInventory())`: the hosts and slots are the Ray nodes' (a host per alive node, its whole
    CPUs), and a submitted ring job runs to completion on the node GADGET placed it on, each daemon an actor
    there. With [metrics] enabled each actor records its daemon's metrics through ray.util.metrics: the values
    it recorded (by the real Ray metric objects, in the actor) are hmp's (a worker's samples, its request
    latency histogram, the scheduler's membership), tagged with the job, node and role. Nothing is left."""
    from hmp.gadget.model import ModelType, RingCostModel
    from hmp.manager.service import DEFAULT_NETWORK, DONE, JobManager, cluster_spec
    from hmp.manager.ray_inventory import RayInventory

    job = tmp_path / "ring.toml"
    job.write_text(RING_JOB)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    inventory = RayInventory()
    grad_bytes = (64 * 32 + 32 + 32 * 10 + 10) * 4  # digits_mlp, hidden [32]
    cost = RingCostModel(cluster_spec(inventory.read()), [ModelType("ring-tiny", grad_bytes, 1e-3, 32)],
                         DEFAULT_NETWORK)
    async with JobManager(inventory, "gadget", run_dir=tmp_path / "runs", grace_s=3, cost=cost,
                          ray_options={"metrics_interval_s": 0.1}) as m:
        assert [(h.name, h.slots) for h in m.cluster.hosts] == [
            (n["NodeManagerAddress"], int(n["Resources"]["CPU"])) for n in nodes]
        assert m.cluster.total_slots == int(ray.cluster_resources()["CPU"])
        handle = await m.submit(job)
        result = await handle.wait(90)
    assert result.status == DONE, result.error
    host, ray_node = nodes[0]["NodeManagerAddress"], nodes[0]["NodeID"]
    assert result.placement == {host: 2}
    where = {"host": host, "ran_in": host, "ray_node": ray_node}
    assert result.nodes == {nid: where for nid in ("scheduler", "w0", "w1")}
    report = json.loads((Path(result.report_dir) / "report.json").read_text())
    recorded = report["ray"]["metrics"]
    job_name = f"ring-{result.job_id}"
    for w in ("w0", "w1"):
        info = recorded[w]
        assert info["url"].startswith("http://") and info["polls"] > 0, info
        (tags, samples), = info["recorded"]["hmp_worker_samples"]
        assert tags == {"job": job_name, "node": w, "role": "cpu_worker"}
        assert 0 < samples <= report["workers"][w]["samples"]  # a value of hmp's, up to its last read
        latency = [v for t, v in info["recorded"]["hmp_request_seconds"]]
        assert latency and all(v["count"] > 0 and v["sum"] > 0 for v in latency), latency
    states = {t["state"] for t, v in recorded["scheduler"]["recorded"]["hmp_scheduler_members"]}
    assert "live" in states, states  # recorded while the workers trained
    assert_nothing_left([w["pid"] for w in report["ray"]["nodes"].values()], job_name)


def test_manager_cli_engine_ray(ray_address):
    """`hmp-manager --engine ray --address ADDR`: its hosts and slots are the Ray cluster's (one host per node, its
    CPUs); SIGTERM stops it (exit 0) and its Ray connection with it."""
    bin_dir = Path(sys.executable).parent
    mgr = subprocess.Popen([bin_dir / "hmp-manager", "--engine", "ray", "--address", ray_address, "--bind",
                            "tcp://127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = mgr.stdout.readline()
        cpus = int(ray.cluster_resources()["CPU"])
        assert f"1 hosts from the Ray cluster at {ray_address} ({cpus} slots, under Ray)" in line, line
    finally:
        mgr.send_signal(signal.SIGTERM)
        try:
            assert mgr.wait(timeout=30) == 0
        finally:
            if mgr.poll() is None:
                mgr.kill()
                mgr.wait()
            mgr.stdout.close()
    assert_nothing_left([mgr.pid])
