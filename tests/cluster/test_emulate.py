"""Emulated hosts: network namespaces on a shaped bridge, and everything removed afterwards; whole
topologies run on them (``LocalCluster(cfg, hosts=...)``, ``hmp-launch CONFIG --hosts HOSTS``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hmp.cluster import LocalCluster
from hmp.emulate import EmulatedHosts, EmulationUnavailable, HostSpec, load_hosts, remove_stale
from hmp.errors import ConfigError
from tests.support import digits_job_text

# one worker runs the module: its subnets and fixed ports differ only from each other
pytestmark = pytest.mark.xdist_group("emulate")

BIN = str(Path(sys.executable).with_name("hmp-launch"))

# A receiver that counts bytes and prints the seconds they took, and a sender of N bytes.
RECEIVER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5301)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.perf_counter(); n += len(b)
    print(n, time.perf_counter() - t0, flush=True)
""")
SENDER = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection((sys.argv[1], 5301), timeout=20)
    s.sendall(b"x" * int(sys.argv[2])); s.close()
""")


def _ns_with(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]


@pytest.fixture
def two_hosts():
    try:
        hosts = EmulatedHosts([HostSpec("h0", bandwidth_mbit=80), HostSpec("h1", bandwidth_mbit=80)],
                              "10.231.9.0/24")
        hosts.start()
    except EmulationUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    try:
        yield hosts
    finally:
        hosts.close()
        assert not _ns_with(hosts.tag)


def _transfer_s(hosts: EmulatedHosts, nbytes: int) -> float:
    rx = hosts.popen("h1", [sys.executable, "-c", RECEIVER, hosts.address("h1")], stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == "ready"
    tx = hosts.popen("h0", [sys.executable, "-c", SENDER, hosts.address("h1"), str(nbytes)])
    assert tx.wait(timeout=30) == 0
    n, seconds = rx.stdout.readline().split()
    rx.wait(timeout=10)
    assert int(n) == nbytes
    return float(seconds)


def test_hosts_reach_each_other_over_a_rate_limited_link(two_hosts):
    """Two emulated hosts talk over their own addresses, and a transfer takes about bytes / link rate
    (80 Mbit/s: 4 MB in ~0.4 s), not loopback speed."""
    nbytes = 4_000_000
    seconds = _transfer_s(two_hosts, nbytes)
    mbit = nbytes * 8 / seconds / 1e6
    assert 40 < mbit < 88, f"{mbit:.1f} Mbit/s over an 80 Mbit/s link"


def test_close_stops_processes_and_removes_every_namespace(two_hosts):
    """Processes started in a host are stopped at close, and no namespace of the run is left."""
    proc = two_hosts.popen("h0", [sys.executable, "-c", "import time; time.sleep(60)"])
    tag = two_hosts.tag
    assert len(_ns_with(tag)) == 3  # the switch and two hosts
    two_hosts.close()
    assert proc.poll() is not None
    assert not _ns_with(tag)


def test_a_killed_harness_leaves_namespaces_that_the_next_start_removes():
    """SIGKILL of a harness process leaves its namespaces; remove_stale (run by every start) removes them."""
    script = textwrap.dedent("""
        import time
        from hmp.emulate import EmulatedHosts, EmulationUnavailable, HostSpec
        h = EmulatedHosts([HostSpec("h0")], "10.231.10.0/24")
        try:
            h.start()
        except EmulationUnavailable as exc:
            print("unavailable", exc, flush=True); raise SystemExit(0)
        print(h.tag, flush=True); time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if line.startswith("unavailable"):
            pytest.skip(line)
        tag = line
        assert len(_ns_with(tag)) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not any(n.startswith(tag) for n in remove_stale()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _ns_with(tag)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        remove_stale()


@pytest.mark.parametrize("text, key", [
    ("[[hosts]]\nname = 'H0'\n", "hosts[0].name"),
    ("[[hosts]]\nname = 'h0'\n[[hosts]]\nname = 'h0'\n", "hosts[1].name"),
    ("[[hosts]]\nname = 'h0'\nbandwidth_mbit = 0\n", "hosts[0].bandwidth_mbit"),
    ("[[hosts]]\nname = 'h0'\nlatency = 1\n", "hosts[0].latency"),
    ("[network]\nsubnet = '8.8.8.0/24'\n[[hosts]]\nname = 'h0'\n", "network.subnet"),
    ("[network]\nsubnet = '10.0.0.0/30'\n[[hosts]]\nname = 'a'\n[[hosts]]\nname = 'b'\n[[hosts]]\nname = 'c'\n",
     "network.subnet"),
    ("hosts = 3\n", "hosts"),
])
def test_bad_hosts_files_name_the_key(tmp_path, text, key):
    """A bad hosts file is a ConfigError naming the file and the key."""
    p = tmp_path / "hosts.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_hosts(p)
    assert info.value.key == key and str(p) in str(info.value)


def test_cli_runs_commands_in_hosts_and_reports_their_exit_code(tmp_path):
    """hmp-emulate runs each --run command in its host with the other hosts' addresses filled in,
    and exits with the worst exit code; a bad file exits 2."""
    p = tmp_path / "hosts.toml"
    p.write_text("[network]\nsubnet = '10.231.11.0/24'\n[[hosts]]\nname = 'a'\n[[hosts]]\nname = 'b'\n")
    cmd = [sys.executable, "-m", "hmp.emulate", str(p), "--run", "a:ip -4 -br addr | grep -q {a}",
           "--run", "b:exit 3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if "cannot create a network namespace" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 3, r.stderr
    assert "10.231.11.1" in r.stdout and "10.231.11.2" in r.stdout
    p.write_text("[[hosts]]\nname = 7\n")
    r = subprocess.run([sys.executable, "-m", "hmp.emulate", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "hosts[0].name" in r.stderr


# ----------------------------------------------------------------------------- topologies on emulated hosts
def _hosts_file(tmp: Path, subnet: str, names: list[str], mbit: float = 1000) -> Path:
    p = tmp / "hosts.toml"
    p.write_text(f"[network]\nsubnet = '{subnet}'\n" + "".join(
        f"\n[[hosts]]\nname = '{n}'\nbandwidth_mbit = {mbit}\ndelay_ms = 0.0\n" for n in names))
    return p


def _job_file(tmp: Path, nodes: list[tuple[str, str, str, str]], *, target: float = 0.95, epochs: int = 30,
              max_seconds: float = 150, consistency: str = "async", extra: str = "") -> Path:
    """A digits job whose nodes are (id, role, host, more keys); the scheduler binds a fixed port."""
    ps = "[ps]\nchunk_bytes = 16384\n" if consistency != "allreduce" else ""
    text = digits_job_text(tmp, name="emu", consistency=consistency, target=target, epochs=epochs,
                           max_seconds=max_seconds) + ps + extra
    for nid, role, host, more in nodes:
        text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"\nhost = "{host}"\n{more}\n'
    path = tmp / "job.toml"
    path.write_text(text)
    return path


def _events(log: Path, event: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == event:
            out.append(e)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _pids_running(needle: str) -> list[int]:
    """Processes whose command line holds ``needle``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle.encode() in (d / "cmdline").read_bytes() and _alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


FOUR = [("scheduler", "scheduler", "h0", 'bind = "tcp://127.0.0.1:47100"'), ("ps0", "ps", "h0", ""),
        ("ps1", "ps", "h1", ""), ("cpu0", "cpu_worker", "h2", "batch_size = 16"),
        ("gpu0", "gpu_worker", "h3", 'device = "cpu"\nbatch_size = 128')]


def test_a_node_on_an_unknown_host_is_a_config_error(tmp_path):
    """A node whose host is not in the hosts file: ConfigError naming the config, nodes[i].host and the hosts
    (before any namespace is made); hmp-launch exits 2 with that message."""
    hosts = _hosts_file(tmp_path, "10.231.12.0/24", ["h0", "h1"])
    cfg = _job_file(tmp_path, [("scheduler", "scheduler", "h0", 'bind = "tcp://127.0.0.1:47100"'),
                               ("ps0", "ps", "h1", ""), ("cpu0", "cpu_worker", "h7", "")])
    with pytest.raises(ConfigError) as info:
        LocalCluster(cfg, hosts=hosts)
    assert info.value.key == "nodes[2].host" and info.value.path == str(cfg)
    assert str(hosts) in str(info.value) and "['h0', 'h1']" in str(info.value) and "'h7'" in str(info.value)
    r = subprocess.run([BIN, str(cfg), "--hosts", str(hosts)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "nodes[2].host" in r.stderr and "h7" in r.stderr


async def test_a_four_host_emulated_topology_trains_digits_end_to_end(tmp_path):
    """Scheduler and ps0 on h0, ps1 on h1, cpu0 on h2, gpu0 on h3 (1 Gbit/s links): the job trains to 0.95
    through the API and ends by finish(), every daemon bound its own host's address, status() answered through the
    relay in the scheduler's host, and no namespace, process or derived config is left afterwards."""
    hosts_file = _hosts_file(tmp_path, "10.231.12.0/24", ["h0", "h1", "h2", "h3"])
    cfg = _job_file(tmp_path, FOUR, target=0.999, epochs=500)
    cluster = LocalCluster(cfg, hosts=hosts_file, grace_s=5)
    statuses: list[dict] = []
    try:
        async with cluster:
            assert cluster.hosts is not None
            tag, address = cluster.hosts.tag, {h: cluster.hosts.address(h) for h in cluster.hosts.names}
            derived = Path(cluster.config_path)
            assert derived.exists() and derived != cfg
            # The target is out of reach: the job runs until status() (through the relay) has shown every
            # member and an accuracy of 0.95, then finish() (through the relay too) ends it.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                st = await cluster.status(timeout_s=5.0)
                if st:
                    statuses.append(st)
                    if set(st.get("members", {})) >= {n[0] for n in FOUR[1:]} and st["best_accuracy"] >= 0.95:
                        break
                await asyncio.sleep(0.2)
            await cluster.finish("seen enough", timeout_s=10.0)
            report = await cluster.train(timeout_s=200)
    except EmulationUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    # Cleaned up: namespaces, every process (daemons and the status relay), the derived config.
    assert not _ns_with(tag)
    assert all(p.returncode is not None and not _alive(p.pid) for p in cluster.procs.values())
    assert not _pids_running(str(derived.parent)) and not _pids_running(address["h0"])
    assert not derived.parent.exists()
    # Trained.
    assert report["final"]["best_reported_accuracy"] >= 0.95
    # The final evaluation is of the parameters when finish() arrived: async pushes still landing make it
    # noisier than the best report, so it only has to show a trained model.
    assert report["final"]["test_accuracy"] >= 0.85
    assert set(report["workers"]) == {"cpu0", "gpu0"}
    assert all(w["updates"] > 0 and w["bytes_out"] > 0 for w in report["workers"].values())
    # status() worked from outside the hosts' network: the scheduler had every other daemon as a member.
    members = [set(st.get("members", {})) for st in statuses]
    assert any(m >= {n[0] for n in FOUR[1:]} for m in members), members
    # Each daemon served on its host's address (the scheduler on its configured port), and joined the
    # scheduler at h0's address.
    logs = tmp_path / "run" / "logs"
    for nid, _, host, _ in FOUR:
        (serving,) = _events(logs / f"{nid}.log", "serving")
        assert serving["address"].startswith(f"tcp://{address[host]}:"), (nid, serving)
        if nid == "scheduler":
            assert serving["address"] == f"tcp://{address['h0']}:47100"
        else:
            (joined,) = _events(logs / f"{nid}.log", "joined")
            assert joined["scheduler"] == f"tcp://{address['h0']}:47100"
            assert joined["address"] == serving["address"]


async def test_finish_reaches_the_scheduler_on_its_emulated_host(tmp_path):
    """finish() (through the status relay) ends a job that would otherwise run for minutes; the report
    names the reason."""
    hosts_file = _hosts_file(tmp_path, "10.231.16.0/24", ["a", "b"])
    cfg = _job_file(tmp_path, [("scheduler", "scheduler", "a", 'bind = "tcp://127.0.0.1:47100"'),
                               ("ps0", "ps", "a", ""), ("cpu0", "cpu_worker", "b", "batch_size = 16")],
                    target=1.0, epochs=1000, max_seconds=150)
    cluster = LocalCluster(cfg, hosts=hosts_file, grace_s=5)
    try:
        async with cluster:
            assert cluster.hosts is not None
            tag = cluster.hosts.tag
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                st = await cluster.status()
                if st and st.get("workers", {}).get("cpu0", {}).get("updates", 0) > 5:
                    break
                await asyncio.sleep(0.3)
            else:
                pytest.fail("the worker made no updates in 120 s (or status never answered)")
            t0 = time.monotonic()
            await cluster.finish("enough for the test")
            report = await cluster.train(timeout_s=60)
            assert time.monotonic() - t0 < 60
    except EmulationUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    assert "enough for the test" in report["final"]["stop_reason"]
    assert all(p.returncode == 0 for p in cluster.procs.values())
    assert not _ns_with(tag)


def test_hmp_launch_on_hosts_removes_everything_when_terminated(tmp_path):
    """hmp-launch --hosts, SIGTERMed mid-job: exit 130, every daemon stopped, every namespace removed."""
    hosts_file = _hosts_file(tmp_path, "10.231.14.0/24", ["a", "b"])
    cfg = _job_file(tmp_path, [("scheduler", "scheduler", "a", 'bind = "tcp://127.0.0.1:47100"'),
                               ("ps0", "ps", "a", ""), ("cpu0", "cpu_worker", "b", "batch_size = 16")],
                    target=1.0, epochs=1000, max_seconds=150)
    out = (tmp_path / "out.txt").open("w")
    proc = subprocess.Popen([BIN, str(cfg), "--hosts", str(hosts_file)], stdout=out, stderr=subprocess.STDOUT)
    try:
        prefix = f"hmpemu{proc.pid}-"
        log = tmp_path / "run" / "logs" / "cpu0.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and _events(log, "joined")):
            if proc.poll() is not None:
                text = (tmp_path / "out.txt").read_text()
                if "no emulated hosts here" in text:
                    pytest.skip(text.strip().splitlines()[-1])
                pytest.fail(f"hmp-launch exited {proc.returncode}:\n{text}")
            assert time.monotonic() < deadline, "cpu0 did not join in 120 s"
            time.sleep(0.2)
        namespaces = _ns_with(prefix)
        assert len(namespaces) == 3  # the bridge's and two hosts'
        pids = [int(p) for ns in namespaces
                for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        assert len(pids) >= 3  # the three daemons
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130, (tmp_path / "out.txt").read_text()
        assert not _ns_with(prefix)
        assert not [p for p in pids if _alive(p)]
        assert "interrupted" in (tmp_path / "out.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        out.close()
        remove_stale()


async def test_a_four_worker_ring_on_four_emulated_hosts_trains_digits(tmp_path):
    """consistency = "allreduce": four workers on h0..h3 (1 Gbit/s links) sum their gradients in a ring over
    the hosts' addresses, reach the target, and end with bit-identical replicas."""
    hosts_file = _hosts_file(tmp_path, "10.231.15.0/24", ["h0", "h1", "h2", "h3"])
    nodes = [("scheduler", "scheduler", "h0", 'bind = "tcp://127.0.0.1:47110"')]
    nodes += [(f"w{i}", "cpu_worker", f"h{i}", "") for i in range(4)]
    cfg = _job_file(tmp_path, nodes, consistency="allreduce", epochs=60,
                    extra="[collective]\nbucket_bytes = 16384\nsmall_bytes = 4096\npiece_bytes = 4096\n")
    cluster = LocalCluster(cfg, hosts=hosts_file, grace_s=5)
    try:
        async with cluster:
            assert cluster.hosts is not None
            tag, address = cluster.hosts.tag, {h: cluster.hosts.address(h) for h in cluster.hosts.names}
            report = await cluster.train(timeout_s=200)
    except EmulationUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    assert not _ns_with(tag)
    assert report["consistency"] == "allreduce"
    assert report["final"]["test_accuracy"] >= 0.93
    assert [r["generation"] for r in report["rings"]] == [1]
    finals = [report["series"][f"w{i}"][-1] for i in range(4)]
    assert len({f["updates"] for f in finals}) == 1 and finals[0]["updates"] > 0
    assert len({f["params_crc32"] for f in finals}) == 1
    logs = tmp_path / "run" / "logs"
    for i in range(4):
        (serving,) = _events(logs / f"w{i}.log", "serving")
        assert serving["address"].startswith(f"tcp://{address[f'h{i}']}:"), serving
