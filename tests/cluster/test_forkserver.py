"""The fork server that LocalCluster starts daemons from (hmp/nodes/forkserver.py): a forked daemon behaves like
``python -m hmp.nodes.main``: its own session, log, environment, exit code, and a graceful early SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from hmp.nodes.forkserver import ForkServer
from tests.support import write_config


@pytest.fixture
def server():
    return ForkServer.shared()  # the one LocalCluster uses in this process (it has imported torch already)


async def test_a_bad_argument_exits_2_with_usage_in_the_daemons_log(server, tmp_path):
    log = tmp_path / "bad.log"
    proc = await server.spawn(["scheduler", "--no-such-flag"], env=dict(os.environ), log=str(log))
    assert await asyncio.wait_for(proc.wait(), 60) == 2
    assert proc.returncode == 2
    assert "usage: hmp-scheduler" in log.read_text()


async def test_a_config_error_names_the_key_and_the_environment_is_the_requested_one(server, tmp_path):
    """The daemon reads HMP_* overrides from the environment given in the request, not the server's."""
    cfg = write_config(tmp_path)
    log = tmp_path / "s.log"
    env = {**os.environ, "HMP_MAX_SECONDS": "soon"}
    proc = await server.spawn(["scheduler", "--config", str(cfg), "--id", "scheduler"], env=env, log=str(log),
                              cwd=str(tmp_path))
    assert await asyncio.wait_for(proc.wait(), 60) == 2
    text = log.read_text()
    assert "config error" in text and "train.max_seconds" in text and "$HMP_MAX_SECONDS" in text


async def test_sigterm_while_starting_is_graceful_and_sigkill_reads_as_minus_9(server, tmp_path):
    cfg = write_config(tmp_path)
    argv = ["scheduler", "--config", str(cfg), "--id", "scheduler"]
    first = await server.spawn(argv, env=dict(os.environ), log=str(tmp_path / "a.log"))
    for _ in range(200):  # the child calls setsid() right after the fork
        if os.getsid(first.pid) == first.pid:
            break
        await asyncio.sleep(0.01)
    assert os.getsid(first.pid) == first.pid  # its own session, as start_new_session gave
    first.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(first.wait(), 60) == 0, (tmp_path / "a.log").read_text()[-2000:]
    second = await server.spawn(argv, env=dict(os.environ), log=str(tmp_path / "b.log"))
    second.kill()
    assert await asyncio.wait_for(second.wait(), 60) == -signal.SIGKILL
    second.kill()  # reaped: a no-op, never a signal to a recycled pid


async def test_spawning_after_the_server_is_gone_fails_clearly(tmp_path):
    srv = ForkServer()
    srv.close()
    for _ in range(100):  # the reader thread notices the end of the server's output
        if not srv.alive:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(OSError, match="fork server exited"):
        await srv.spawn(["scheduler"], env=dict(os.environ), log=str(tmp_path / "x.log"))


def test_a_launcher_killed_with_sigkill_leaves_no_daemon_running(tmp_path):
    """hmp-launch dies at once (SIGKILL): its fork server sees the end of its stdin and exits, and each daemon,
    told by the kernel that its parent died, stops gracefully within seconds instead of training on."""
    cfg = write_config(tmp_path, target=0.999, epochs=500)
    launcher = subprocess.Popen([sys.executable, "-m", "hmp.launch", str(cfg)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        logs = tmp_path / "run" / "logs"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                (logs / f"{n}.log").exists() and "joined" in (logs / f"{n}.log").read_text(errors="replace")
                for n in ("ps0", "ps1", "cpu0", "gpu0")):
            time.sleep(0.2)
        daemons = _daemon_pids(launcher.pid)
        assert len(daemons) == 5, daemons
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 30  # the scheduler's graceful stop may take its drain (3 heartbeats + 5 s)
        while time.monotonic() < deadline and any(_alive(p) for p in daemons):
            time.sleep(0.1)
        assert not [p for p in daemons if _alive(p)]
        for n in ("scheduler", "ps0", "ps1", "cpu0", "gpu0"):  # each stopped itself: no SIGKILL was needed
            assert '"event": "stopped"' in (logs / f"{n}.log").read_text(), n
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        launcher.stdout.close()


def _daemon_pids(launcher_pid: int) -> list[int]:
    """The launcher's fork server's children (the daemons)."""
    servers = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True,
                                              text=True).stdout.split()]
    return [int(p) for s in servers for p in subprocess.run(["pgrep", "-P", str(s)], capture_output=True,
                                                            text=True).stdout.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
