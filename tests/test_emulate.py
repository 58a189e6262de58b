"""Emulated hosts: network namespaces on a shaped bridge, and everything removed afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hmp.emulate import EmulatedHosts, EmulationUnavailable, HostSpec, load_hosts, remove_stale
from hmp.errors import ConfigError

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
