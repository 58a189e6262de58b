"""The keeper between a Ray actor and its daemon (hmp/launcher/keeper.py), without Ray: it starts
``python -m hmp.nodes.main -`` (arguments on stdin), passes SIGTERM on, and when it dies however it dies (Ray
SIGKILLs an actor's children) the daemon still gets SIGTERM and stops gracefully."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


from tests.support import write_config



def _start(tmp_path, name: str) -> tuple[subprocess.Popen, dict]:
    """A keeper (this process standing for the actor) running ps0; returns it and the daemon's ready file."""
    cfg, ready = write_config(tmp_path), tmp_path / f"{name}.ready"
    with open(tmp_path / f"{name}.log", "wb") as log:
        keeper = subprocess.Popen([sys.executable, "-m", "hmp.launcher.keeper", str(os.getpid())],
                                  stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    keeper.stdin.write((json.dumps(["ps", "--config", str(cfg), "--id", "ps0", "--ready-file", str(ready)])
                        + "\n").encode())
    keeper.stdin.close()
    deadline = time.monotonic() + 120
    while not ready.exists() and keeper.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return keeper, json.loads(ready.read_text())


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1][0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_to_the_keeper_stops_the_daemon_gracefully(tmp_path):
    keeper, ready = _start(tmp_path, "a")
    try:
        assert ready["pid"] != keeper.pid  # the daemon is the keeper's child, not the keeper
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(timeout=60) == 0, (tmp_path / "a.log").read_text()[-2000:]
        assert '"event": "stopped"' in (tmp_path / "a.log").read_text()
    finally:
        keeper.kill()
        keeper.wait()


def test_a_keeper_killed_with_sigkill_leaves_the_daemon_to_stop_itself(tmp_path):
    keeper, ready = _start(tmp_path, "b")
    keeper.kill()
    keeper.wait()
    assert _gone(ready["pid"], 60)
    assert '"event": "stopped"' in (tmp_path / "b.log").read_text()  # gracefully: PR_SET_PDEATHSIG's SIGTERM
